"""RemoteStep: a script run on a host over SSH, as a Pulumi dynamic resource.

pulumi-command's provider cannot be built offline here (its module versions are not
served by the reachable Go proxy), so fimfleet carries this small equivalent. Each step
uploads its files (secrets included) over SFTP, then runs `apply`. `diff` is explicit:
the step runs again only when its scripts, files, triggers or the host's identity
(components/identity.py) change. `read` (used by `pulumi refresh` / `up --refresh`)
checks the step's marker on the host and runs the optional `check` script; either
failing marks the step as drifted, so the next `up` applies it again. `delete` runs
`destroy`, and skips it with a warning when the host is gone.

Every SSH session verifies the host key that the connection pins (`hostKey`, from
config or recorded on first contact by HostIdentity); an unpinned connection is refused,
so secrets are only ever uploaded to the host that was first trusted.

The provider object is pickled into the state with dill: it holds no client and no
secret; connections are opened inside each call.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shlex
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult

from components.errors import Error, readable_failures, warn

OUTPUT_TAIL = 4000
"""Bytes of stdout kept in state; scripts never print secrets, and stderr is only shown on failure."""
PROGRESS_PREFIX = "progress: "
"""A script's stderr lines with this prefix are shown live by `pulumi up` (long engine starts)."""
HEARTBEAT_S = 30.0
"""A labelled step that has said nothing for this long says it still runs, with its last output line."""
MARKER_DIR = "/var/lib/fimfleet/steps"
"""Each applied step leaves its digest here; a wiped host has none, so refresh finds it."""


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
    private_key: str
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


def _pkey(text: str):
    import paramiko

    errors = []
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text))
        except (paramiko.SSHException, ValueError) as e:
            errors.append(f"{kind.__name__}: {e}")
    raise Error("fimfleet:sshPrivateKey is not a usable private key: " + "; ".join(errors))


def key_text(key) -> str:
    return f"{key.get_name()} {key.get_base64()}"


def fingerprint(text: str) -> str:
    import base64

    blob = base64.b64decode(text.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _pinning_policy(expected: str, seen: list[str], where: str, accept_key: str):
    """paramiko policy: record the presented key; refuse it unless it is the pinned one (if any)."""
    import paramiko

    class Pin(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            presented = key_text(key)
            seen.append(presented)
            if expected and presented.split()[:2] != expected.split()[:2]:
                raise HostKeyChanged(
                    f"the SSH host key of {where} changed: pinned {fingerprint(expected)}, presented "
                    f"{fingerprint(presented)}. Nothing was sent. If the host was rebuilt on purpose, check the new "
                    f"fingerprint on its console, then accept it: pulumi config set --path {accept_key} "
                    f"'{presented}' (nodes.<name>.hostKey with fimfleet:nodes) and run pulumi up again")

    return Pin()


@contextlib.contextmanager
def session(t: SshTarget, retries: int = 3, accept_key: str = "fimfleet:host.hostKey", first_contact: bool = False):
    """An SSH client to a verified host (through a verified bastion if set); both are closed after.

    Yields the client; `client.fimfleet_seen` holds the keys presented (bastion first, host
    last). Only HostIdentity's first contact may run without a pinned key (trust on first
    use). Raises HostKeyChanged at once, or Unreachable after `retries` attempts."""
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
                             timeout=t.connect_timeout_s, allow_agent=False, look_for_keys=False)
                sock = jump.get_transport().open_channel("direct-tcpip", (t.host, t.port), ("127.0.0.1", 0))
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(_pinning_policy(t.host_key, seen, t.where, accept_key))
            client.connect(t.host, t.port, t.user, pkey=key, sock=sock, timeout=t.connect_timeout_s,
                           banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s,
                           allow_agent=False, look_for_keys=False)
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
            last = e
            if attempt + 1 < retries:
                time.sleep(2 * (attempt + 1))
            continue
        try:
            yield client
        finally:
            client.close()
            if jump is not None:
                jump.close()
        return
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
    chan.settimeout(timeout_s)
    chan.exec_command("bash -s")
    chan.sendall((exports + "set -euo pipefail\n" + script).encode())
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
        if time.monotonic() > deadline:
            chan.close()
            raise Error(f"{label or 'remote script'} did not finish within {timeout_s:.0f}s")
        time.sleep(0.05)
    code = chan.recv_exit_status()
    return code, out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")


def put_files(client, files: list[dict]) -> None:
    """Atomically write files (tmp + rename) with their modes; parent directories are created."""
    sftp = client.open_sftp()
    try:
        for f in files:
            path, mode = f["path"], int(str(f.get("mode", "0644")), 8)
            parent = path.rsplit("/", 1)[0] or "/"
            code, _, err = run(client, f"mkdir -p {shlex.quote(parent)}")
            if code:
                raise Error(f"mkdir {parent}: {err}")
            tmp = f"{path}.fimfleet-{uuid.uuid4().hex[:8]}"
            with sftp.open(tmp, "w") as fh:
                sftp.chmod(tmp, mode)
                fh.write(f["content"].encode())
            sftp.posix_rename(tmp, path)
    finally:
        sftp.close()


def put_dir(client, local: str, remote: str) -> None:
    """Copy a local directory (binary files too) to `remote`, swapping it in whole at the end."""
    from pathlib import Path

    root = Path(local)
    part = remote.rstrip("/") + ".fimfleet-part"
    code, _, err = run(client, f"rm -rf {shlex.quote(part)} && mkdir -p {shlex.quote(part)}")
    if code:
        raise Error(f"preparing {part}: {err}")
    sftp = client.open_sftp()
    try:
        for path in sorted(root.rglob("*")):
            target = f"{part}/{path.relative_to(root).as_posix()}"
            if path.is_dir():
                sftp.mkdir(target)
            else:
                sftp.put(str(path), target)
    finally:
        sftp.close()
    code, _, err = run(client, f"rm -rf {shlex.quote(remote)} && mv {shlex.quote(part)} {shlex.quote(remote)}")
    if code:
        raise Error(f"installing {remote}: {err}")


def dir_digest(local: str) -> str:
    """Content hash of a local directory, so an unchanged model is not copied again."""
    from pathlib import Path

    h = hashlib.sha256()
    for path in sorted(Path(local).rglob("*")):
        if path.is_file():
            h.update(path.relative_to(local).as_posix().encode())
            with path.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


STEP_KEYS = ("apply", "destroy", "files", "uploads", "env", "triggers")


def _identity(props: dict) -> str | None:
    """The host identity (components/identity.py) that the connection carries, if any."""
    return (props.get("connection") or {}).get("identity")


def _digest(props: dict, with_identity: bool | None = None) -> str:
    """What the step applies: scripts, files, triggers and the host identity. Not how to connect."""
    material = {k: props.get(k) for k in STEP_KEYS}
    if with_identity if with_identity is not None else _identity(props) is not None:
        material["identity"] = _identity(props) or ""
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def _wanted(olds: dict, news: dict) -> str:
    """The digest `news` must have been applied with. A step recorded before host identities
    existed (none in its state) is compared without it, so an upgrade re-applies nothing."""
    return _digest(news, with_identity=_identity(olds) is not None)


def _marker(id_: str) -> str:
    return f"{MARKER_DIR}/{id_}"


def _target(props: dict) -> SshTarget:
    return SshTarget.from_props(props["connection"])


def _gone(props: dict) -> bool:
    return bool((props.get("connection") or {}).get("gone"))


class RemoteStepProvider(ResourceProvider):
    """Dynamic provider behind RemoteStep; see the module docstring."""

    def _exec(self, id_: str, props: dict, script_key: str) -> str:
        label = props.get("label", "remote step")
        script = props.get(script_key) or ""
        t = _target(props)
        with session(t) as client:
            if script_key == "apply":
                if props.get("files"):
                    put_files(client, props["files"])
                for up in props.get("uploads") or ():
                    put_dir(client, up["local"], up["remote"])
            code, out, err = (run(client, script, timeout_s=float(props.get("timeoutS", 1800)), env=props.get("env"),
                                  label=label) if script else (0, "", ""))
            if code == 0 and script_key == "apply":
                self._mark(client, id_, _digest(props))
            elif code == 0 and script_key == "destroy":
                run(client, f"rm -f {shlex.quote(_marker(id_))}")
        if code != 0:
            tail = "\n".join(l for l in (err or out).splitlines() if not l.startswith(PROGRESS_PREFIX))[-OUTPUT_TAIL:]
            raise Error(f"{label}: {script_key} failed with exit {code} on {t.where}:\n{tail}")
        return out[-OUTPUT_TAIL:]

    @staticmethod
    def _mark(client, id_: str, digest: str) -> None:
        code, _, err = run(client, f"mkdir -p {MARKER_DIR} && printf %s {digest} > {shlex.quote(_marker(id_))}")
        if code:
            raise Error(f"cannot record the step marker {_marker(id_)}: {err.strip()}")

    def _outs(self, props: dict, stdout: str) -> dict:
        return {**props, "stdout": stdout, "appliedDigest": _digest(props)}

    @readable_failures
    def create(self, props: dict[str, Any]) -> CreateResult:
        id_ = uuid.uuid4().hex
        return CreateResult(id_=id_, outs=self._outs(props, self._exec(id_, props, "apply")))

    @readable_failures
    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        if olds.get("appliedDigest") == _wanted(olds, news):
            # Same host, same content: only the connection changed (a rotated SSH key, a moved
            # host) or the step is being adopted into host identities. Record it, apply nothing.
            if not _gone(news):
                with session(_target(news)) as client:
                    self._mark(client, id_, _digest(news))
            return UpdateResult(outs={**news, "stdout": olds.get("stdout", ""), "appliedDigest": _digest(news)})
        return UpdateResult(outs=self._outs(news, self._exec(id_, news, "apply")))

    @readable_failures
    def delete(self, id_: str, props: dict[str, Any]) -> None:
        label, where = props.get("label", "remote step"), _target(props).where
        if _gone(props):
            warn(f"{label}: {where} is marked gone (fimfleet:host.gone); its destroy step was skipped, "
                 "so whatever it installed there stays")
            return
        try:
            self._exec(id_, props, "destroy")
        except Unreachable as e:
            warn(f"{label}: {e}. The destroy step was skipped and what it installed on {where} stays; "
                 "set fimfleet:host.gone: true (nodes.<name>.gone with fimfleet:nodes) to skip the retries next time")

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        changed = [k for k in (*STEP_KEYS, "check") if olds.get(k) != news.get(k)]
        if olds.get("appliedDigest") != _wanted(olds, news):
            changed.append("appliedDigest")
        if (olds.get("connection") or {}) != (news.get("connection") or {}):
            changed.append("connection")
        # A new address is an update, never a delete-before-replace: the old host may be gone.
        return DiffResult(changes=bool(changed), replaces=[], delete_before_replace=False,
                          stables=["stdout"] if not changed else [])

    @readable_failures
    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        label = props.get("label", "remote step")
        if _gone(props):
            warn(f"{label}: {_target(props).where} is marked gone; not checked")
            return ReadResult(id_=id_, outs=props)
        problems = []
        with session(_target(props)) as client:
            if _identity(props) is not None:
                code, out, _ = run(client, f"cat {shlex.quote(_marker(id_))} 2>/dev/null || true")
                if out.strip() != props.get("appliedDigest"):
                    problems.append("the step's marker is missing or stale (host wiped or rebuilt?)")
            if props.get("check"):
                code, out, err = run(client, props["check"], timeout_s=120, env=props.get("env"))
                if code != 0:
                    problems.append((err or out).strip()[-1000:])
        outs = dict(props)
        if problems:
            warn(f"{label}: drift found on {_target(props).where}: {'; '.join(problems)}")
            outs["appliedDigest"] = "drifted"
        return ReadResult(id_=id_, outs=outs)


class RemoteStep(Resource):
    """One idempotent step on a host: upload `files`, run `apply`; `check` finds drift; `destroy` undoes it."""

    stdout: pulumi.Output[str]
    appliedDigest: pulumi.Output[str]  # noqa: N815 - dynamic outputs keep their state names

    def __init__(self, name: str, *, connection: pulumi.Input[dict], apply: pulumi.Input[str],
                 label: str = "", check: pulumi.Input[str] | None = None, destroy: pulumi.Input[str] | None = None,
                 files: pulumi.Input[list] | None = None, uploads: list[dict] | None = None, env: pulumi.Input[dict] | None = None,
                 triggers: pulumi.Input[list] | None = None, timeout_s: int = 1800,
                 opts: pulumi.ResourceOptions | None = None):
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(
            additional_secret_outputs=["connection", "files", "env"]))
        super().__init__(RemoteStepProvider(), name, {
            "connection": connection, "apply": apply, "check": check, "destroy": destroy,
            "files": files, "uploads": uploads, "env": env, "triggers": triggers, "timeoutS": timeout_s, "label": label or name, "stdout": None, "appliedDigest": None,
        }, opts)
