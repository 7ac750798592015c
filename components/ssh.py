"""SSH to fimfleet's hosts: verified sessions, scripts and file uploads (paramiko).

Every session verifies the host key that the connection pins (`hostKey`, from config or
recorded on first contact by HostIdentity); an unpinned connection is refused, so secrets
are only ever uploaded to the host that was first trusted. `shared_session` keeps one
verified connection per host for the life of the process, so the steps of one
`pulumi up` on a host pay one handshake and one login between them (components/remote.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from components.errors import Error

PROGRESS_PREFIX = "progress: "
"""A script's stderr lines with this prefix are shown live by `pulumi up` (long engine starts)."""
LATE_S = 30.0
"""How long past its time a script may take to report, once `timeout` on the host has stopped it."""
HEARTBEAT_S = 30.0
"""A labelled step that has said nothing for this long says it still runs, with its last output line."""

class HostKeyChanged(Error):
    """The host presented a key other than the pinned one: refuse before sending anything."""


class Unreachable(Error):
    """No SSH session could be opened within the retry budget."""


HostKeyChanged.__module__ = Unreachable.__module__ = "fimfleet"


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int
    user: str
    private_key: str = field(repr=False)
    host_key: str = ""
    """Pinned public key, `<type> <base64>`; empty only for HostIdentity's first contact."""
    bastion_host: str = ""
    bastion_port: int = 22
    bastion_user: str = ""
    bastion_host_key: str = ""
    connect_timeout_s: float = 20.0

    @classmethod
    def from_props(cls, c: dict) -> SshTarget:
        return cls(host=c["host"], port=int(c.get("port", 22)), user=c.get("user", "root"),
                   private_key=c["privateKey"], host_key=c.get("hostKey", "") or "",
                   bastion_host=c.get("bastionHost", "") or "", bastion_port=int(c.get("bastionPort", 22) or 22),
                   bastion_user=c.get("bastionUser", "") or "", bastion_host_key=c.get("bastionHostKey", "") or "")

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def _load_private_key(text):
    """(key, None), or (None, the fix): the SSH key as cryptography reads it, in any of its files'
    formats (OpenSSH, PKCS#8 from `openssl genpkey`, PKCS#1); ed25519, ECDSA or RSA, no passphrase."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    if not isinstance(text, str) or "PRIVATE KEY-----" not in text:
        return None, "must be a private key file's text (-----BEGIN ... PRIVATE KEY-----)"
    data = text.encode()
    load = serialization.load_ssh_private_key if b"OPENSSH PRIVATE KEY" in data else serialization.load_pem_private_key
    try:
        key = load(data, password=None)
    except TypeError:
        return None, ("is protected by a passphrase: give fimfleet a copy without one (it is kept as a Pulumi "
                      "secret): ssh-keygen -p -N '' -f COPY")
    except (ValueError, UnsupportedAlgorithm) as e:
        return None, f"is not a usable private key ({e})"
    if not isinstance(key, (ed25519.Ed25519PrivateKey, ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        return None, f"must be an ed25519, ECDSA or RSA key, not {type(key).__name__}"
    return key, None


def private_key_problem(text) -> str | None:
    """The fix for an SSH private key fimfleet cannot use, or None (config checks it at preview)."""
    return _load_private_key(text)[1]


def load_private_key(text):
    key, fix = _load_private_key(text)
    if fix:
        raise Error(f"fimfleet:sshPrivateKey {fix}")
    return key


def _pkey(text: str):
    """paramiko's key, from any format load_private_key reads (paramiko itself takes OpenSSH and PKCS#1 only)."""
    import paramiko
    from cryptography.hazmat.primitives import serialization

    openssh = load_private_key(text).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                   serialization.NoEncryption()).decode()
    errors = []
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(openssh))
        except (paramiko.SSHException, ValueError) as e:
            errors.append(f"{kind.__name__}: {e}")
    raise Error("fimfleet:sshPrivateKey is not a usable private key: " + "; ".join(errors))


def key_text(key) -> str:
    return f"{key.get_name()} {key.get_base64()}"


def fingerprint(text: str) -> str:
    import base64
    import binascii

    try:
        blob = base64.b64decode(text.split()[1], validate=True)
    except (IndexError, ValueError, binascii.Error):
        return "(an unreadable key)"
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


RSA_ALGORITHMS = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
"""Signature algorithms of one RSA host key: its line may name any of them (ssh-keyscan says ssh-rsa)."""


def host_key_algorithms(pinned: str) -> tuple[str, ...]:
    """The host key algorithms to offer for a pinned key: only its own, so a host with several
    keys (ed25519, ECDSA, RSA) presents the pinned one, not the one paramiko prefers."""
    kind = pinned.split()[0] if pinned else ""
    return RSA_ALGORITHMS if kind in RSA_ALGORITHMS else (kind,) if kind else ()


def _disabled(pinned: str) -> dict:
    """paramiko's disabled_algorithms for a pinned key: every host key algorithm but its own."""
    import paramiko

    allowed = host_key_algorithms(pinned)
    return {"keys": [k for k in paramiko.Transport._preferred_keys if k not in allowed]} if allowed else {}


def _pinning_policy(expected: str, seen: list[str], where: str, accept_key: str):
    """paramiko policy: record the presented key; refuse it unless it is the pinned one (if any)."""
    import paramiko

    class Pin(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            presented = key_text(key)
            seen.append(presented)
            if expected and presented.split()[1:2] != expected.split()[1:2]:  # the blob names its type
                raise HostKeyChanged(
                    f"the SSH host key of {where} changed: pinned {fingerprint(expected)}, presented "
                    f"{fingerprint(presented)}. Nothing was sent. If the host was rebuilt on purpose, check the new "
                    f"fingerprint on its console, then accept it: pulumi config set --path {accept_key} "
                    f"'{presented}' (nodes.<name>.hostKey with fimfleet:nodes) and run pulumi up again")

    return Pin()


RETRIES = 3
"""Attempts to open a connection, 2 s and 4 s apart: rides out an sshd restart or a lost SYN."""


@contextlib.contextmanager
def session(t: SshTarget, retries: int = RETRIES, accept_key: str = "fimfleet:host.hostKey", first_contact: bool = False):
    """An SSH client to a verified host (through a verified bastion if set); both are closed after.

    Yields the client; `client.fimfleet_seen` holds the keys presented (bastion first, host
    last). Only HostIdentity's first contact may run without a pinned key (trust on first
    use). Raises HostKeyChanged at once, or Unreachable after `retries` attempts."""
    client, jump = _connect(t, retries, accept_key, first_contact)
    try:
        yield client
    finally:
        client.close()
        if jump is not None:
            jump.close()


SHARED_USERS = 4
"""Steps that use one shared connection at once (each holds at most 2 channels; sshd allows 10)."""


class _Shared:
    """One target's shared connection: who uses it, and the last failed attempt to open it."""

    def __init__(self) -> None:
        self.client = self.jump = None
        self.users = 0
        self.lock = threading.Lock()
        self.failed: tuple[float, Exception] | None = None  # (when it was given up, why)

    def alive(self) -> bool:
        """A channel opens within seconds: a host that went away (a dead TCP peer looks active) is not reused."""
        transport = self.client.get_transport() if self.client is not None else None
        if transport is None or not transport.is_active():
            return False
        try:
            transport.open_session(timeout=10).close()
            return True
        except Exception:  # noqa: BLE001 - paramiko raises several kinds here; any means reconnect
            return False

    def close(self) -> None:
        for c in (self.client, self.jump):
            if c is not None:
                c.close()
        self.client = self.jump = None


_shared: dict[SshTarget, _Shared] = {}
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_session(t: SshTarget):
    """Like `session`, but the connection stays open for the next step on the same target (same
    host, port, user, keys and bastion) in this process, so a deploy's steps on one host pay one
    handshake and one login between them. A dead connection is replaced; more than SHARED_USERS
    steps at once get a session of their own. Steps that waited while a connection could not be
    opened get that failure at once, as they would have in parallel (a host that is gone)."""
    arrived = time.monotonic()
    with _shared_lock:
        sh = _shared.setdefault(t, _Shared())
    with sh.lock:
        if sh.failed and sh.failed[0] >= arrived:
            raise sh.failed[1]
        alive = sh.alive()
        if not alive and sh.users == 0:
            sh.close()
            try:
                # A host that just failed every attempt gets one more per step, not three with backoff:
                # a destroy of a host that is gone reaches its end in seconds, each step still tried.
                sh.client, sh.jump = _connect(t, 1 if sh.failed else RETRIES, "fimfleet:host.hostKey", False)
            except Error as e:
                sh.failed = (time.monotonic(), e)
                raise
            sh.failed = None
            alive = True
        client = sh.client if alive and sh.users < SHARED_USERS else None
        sh.users += client is not None
    if client is None:
        with session(t) as own:
            yield own
        return
    try:
        yield client
    finally:
        with sh.lock:
            sh.users -= 1


def drop_shared() -> None:
    """Close every shared connection (tests whose hosts come and go within one process)."""
    with _shared_lock:
        for sh in _shared.values():
            sh.close()
        _shared.clear()


def _connect(t: SshTarget, retries: int, accept_key: str, first_contact: bool):
    """(client, jump or None), connected and verified; see `session`."""
    import paramiko

    if not t.host_key and not first_contact:
        raise Error(f"no pinned SSH host key for {t.where}: refusing to send anything (set fimfleet:host.hostKey, or nodes.<name>.hostKey)")
    key = _pkey(t.private_key)
    last: Exception | None = None
    for attempt in range(retries):
        jump = client = None
        seen: list[str] = []
        try:
            sock = None
            if t.bastion_host:
                jump = paramiko.SSHClient()
                jump.set_missing_host_key_policy(_pinning_policy(
                    t.bastion_host_key, seen, f"bastion {t.bastion_host}:{t.bastion_port}",
                    accept_key.replace("hostKey", "bastion.hostKey")))
                jump.connect(t.bastion_host, t.bastion_port, t.bastion_user or t.user, pkey=key,
                             timeout=t.connect_timeout_s, allow_agent=False, look_for_keys=False,
                             disabled_algorithms=_disabled(t.bastion_host_key))
                sock = jump.get_transport().open_channel("direct-tcpip", (t.host, t.port), ("127.0.0.1", 0))
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(_pinning_policy(t.host_key, seen, t.where, accept_key))
            client.connect(t.host, t.port, t.user, pkey=key, sock=sock, timeout=t.connect_timeout_s,
                           banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s,
                           allow_agent=False, look_for_keys=False, disabled_algorithms=_disabled(t.host_key))
            client.get_transport().set_keepalive(15)
            client.fimfleet_seen = seen
        except HostKeyChanged:
            for c in (client, jump):
                if c is not None:
                    c.close()
            raise
        except (OSError, socket.timeout, paramiko.SSHException) as e:
            for c in (client, jump):
                if c is not None:
                    c.close()
            if isinstance(e, paramiko.AuthenticationException) and not first_contact:
                # not retried: more refused logins only bring a host's fail2ban closer
                who = f"{t.bastion_user or t.user}@{t.bastion_host}" if jump is not None and client is None else \
                    f"{t.user}@{t.host}"
                raise Error(f"{who} refused fimfleet:sshPrivateKey ({e}): add its public key to "
                            f"~{who.split('@')[0]}/.ssh/authorized_keys there, or set the key that host trusts") from None
            last = e
            if attempt + 1 < retries:
                time.sleep(2 * (attempt + 1))
            continue
        return client, jump
    raise Unreachable(f"cannot reach {t.where} over SSH after {retries} attempts: {last}. "
                      "Check fimfleet:host.address/port (nodes.<name>.address/port with fimfleet:nodes), the firewall, "
                      "and fimfleet:sshPrivateKey")


def run(client, script: str, *, timeout_s: float = 1800, env: dict[str, str] | None = None,
        label: str = "") -> tuple[int, str, str]:
    """Run a bash script (fed on stdin, so it never shows in `ps`); returns (exit, stdout, stderr).

    stderr lines that start with PROGRESS_PREFIX are echoed at once to this process's stderr,
    which the Pulumi CLI shows while the step runs. A labelled step silent for HEARTBEAT_S
    says it still runs, with its last line of output, instead of minutes of bare dots."""
    exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in (env or {}).items())
    chan = client.get_transport().open_session()
    chan.settimeout(timeout_s + LATE_S)
    # `timeout` on the host stops the script's whole process group when its time is up (a closed
    # channel would not: the script would run on beside the next `up`'s copy). bash parses the
    # brace group whole before running it, so no command in it can read the rest of the script
    # as its stdin.
    chan.exec_command(f"timeout -k 10 {math.ceil(timeout_s)} bash -s")
    chan.sendall((exports + "set -euo pipefail\n{\n" + script + "\n} </dev/null\n").encode())
    chan.shutdown_write()
    out, err = io.BytesIO(), io.BytesIO()
    pending = b""
    started = said = time.monotonic()
    deadline = started + timeout_s
    last = ""

    def note(chunk: bytes) -> str:
        lines = [l.strip() for l in chunk.decode(errors="replace").splitlines() if l.strip()]
        return lines[-1][:160] if lines else last

    while True:
        while chan.recv_ready():
            chunk = chan.recv(65536)
            out.write(chunk)
            last = note(chunk)
        while chan.recv_stderr_ready():
            chunk = chan.recv_stderr(65536)
            err.write(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                if text.startswith(PROGRESS_PREFIX):
                    print(f"{label or 'remote step'}: {text[len(PROGRESS_PREFIX):]}", file=sys.stderr, flush=True)
                    said = time.monotonic()
                elif text.strip():
                    last = text.strip()[:160]
        if label and time.monotonic() - said >= HEARTBEAT_S:
            said = time.monotonic()
            print(f"{label}: still running, {said - started:.0f}s elapsed" + (f"; last output: {last}" if last else ""),
                  file=sys.stderr, flush=True)
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if time.monotonic() > deadline + LATE_S:
            chan.close()
            raise Error(f"{label or 'remote script'} did not finish within {timeout_s:.0f}s, and the host stopped "
                        "answering: it may still run there. Check the host, then rerun `pulumi up`")
        time.sleep(0.05)
    code = chan.recv_exit_status()
    if code == -1:  # the channel closed without an exit status: the connection went away
        raise Error(f"{label or 'remote script'}: the SSH connection closed before the script finished; what it "
                    "did on the host is unknown. Rerun `pulumi up`: each step converges")
    if code == 124 and time.monotonic() >= deadline - 1:
        raise Error(f"{label or 'remote script'} did not finish within {timeout_s:.0f}s and was stopped on the "
                    "host; see the host's journal for what it waited on, then rerun `pulumi up`")
    return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")
