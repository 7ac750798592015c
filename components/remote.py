"""RemoteStep: a script run on a host over SSH, as a Pulumi dynamic resource.

pulumi-command's provider cannot be built offline here (its module versions are not
served by the reachable Go proxy), so fimfleet carries this small equivalent. Each step
uploads its files (secrets included) over SFTP, then runs `apply`. `diff` is explicit:
the step runs again only when its scripts, files or triggers change. `read` (used by
`pulumi refresh` / `up --refresh`) runs the optional `check` script; a failing check
marks the step as drifted, so the next `up` applies it again. `delete` runs `destroy`.

The provider object is pickled into the state with dill: it holds no client and no
secret; connections are opened inside each call.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult

OUTPUT_TAIL = 4000
"""Bytes of stdout kept in state; scripts never print secrets, and stderr is only shown on failure."""


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int
    user: str
    private_key: str
    bastion_host: str = ""
    bastion_port: int = 22
    bastion_user: str = ""
    connect_timeout_s: float = 20.0

    @classmethod
    def from_props(cls, c: dict) -> SshTarget:
        return cls(host=c["host"], port=int(c.get("port", 22)), user=c.get("user", "root"),
                   private_key=c["privateKey"], bastion_host=c.get("bastionHost", "") or "",
                   bastion_port=int(c.get("bastionPort", 22) or 22), bastion_user=c.get("bastionUser", "") or "")


def _pkey(text: str):
    import paramiko

    errors = []
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text))
        except (paramiko.SSHException, ValueError) as e:
            errors.append(f"{kind.__name__}: {e}")
    raise ValueError("sshPrivateKey is not a usable private key: " + "; ".join(errors))


def connect(t: SshTarget, retries: int = 3):
    """Open an SSH client (through the bastion if set); raises ConnectionError naming the host and port."""
    import paramiko

    key = _pkey(t.private_key)
    last: Exception | None = None
    for attempt in range(retries):
        try:
            sock = None
            if t.bastion_host:
                jump = paramiko.SSHClient()
                jump.set_missing_host_key_policy(paramiko.AutoAddPolicy())
                jump.connect(t.bastion_host, t.bastion_port, t.bastion_user or t.user, pkey=key,
                             timeout=t.connect_timeout_s, allow_agent=False, look_for_keys=False)
                sock = jump.get_transport().open_channel("direct-tcpip", (t.host, t.port), ("127.0.0.1", 0))
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
            client.connect(t.host, t.port, t.user, pkey=key, sock=sock, timeout=t.connect_timeout_s,
                           banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s,
                           allow_agent=False, look_for_keys=False)
            client.get_transport().set_keepalive(15)
            return client
        except (OSError, socket.timeout, paramiko.SSHException) as e:
            last = e
            time.sleep(2 * (attempt + 1))
    raise ConnectionError(f"cannot reach {t.user}@{t.host}:{t.port} over SSH: {last}. "
                          "Check fimfleet:host.address/port, the firewall, and fimfleet:sshPrivateKey")


def run(client, script: str, *, timeout_s: float = 1800, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run a bash script (fed on stdin, so it never shows in `ps`); returns (exit, stdout, stderr)."""
    exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in (env or {}).items())
    chan = client.get_transport().open_session()
    chan.settimeout(timeout_s)
    chan.exec_command("bash -s")
    chan.sendall((exports + "set -euo pipefail\n" + script).encode())
    chan.shutdown_write()
    out, err = io.BytesIO(), io.BytesIO()
    deadline = time.monotonic() + timeout_s
    while True:
        while chan.recv_ready():
            out.write(chan.recv(65536))
        while chan.recv_stderr_ready():
            err.write(chan.recv_stderr(65536))
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            break
        if time.monotonic() > deadline:
            chan.close()
            raise TimeoutError(f"remote script did not finish within {timeout_s:.0f}s")
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
                raise RuntimeError(f"mkdir {parent}: {err}")
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
        raise RuntimeError(f"preparing {part}: {err}")
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
        raise RuntimeError(f"installing {remote}: {err}")


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


def _digest(props: dict) -> str:
    """What the step applies: scripts, files and triggers. The connection is not part of it."""
    material = {k: props.get(k) for k in ("apply", "destroy", "files", "uploads", "env", "triggers")}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


class RemoteStepProvider(ResourceProvider):
    """Dynamic provider behind RemoteStep; see the module docstring."""

    def _exec(self, props: dict, script_key: str) -> str:
        script = props.get(script_key) or ""
        client = connect(SshTarget.from_props(props["connection"]))
        try:
            if script_key == "apply":
                if props.get("files"):
                    put_files(client, props["files"])
                for up in props.get("uploads") or ():
                    put_dir(client, up["local"], up["remote"])
            if not script:
                return ""
            code, out, err = run(client, script, timeout_s=float(props.get("timeoutS", 1800)), env=props.get("env"))
        finally:
            client.close()
        if code != 0:
            tail = (err or out)[-OUTPUT_TAIL:]
            raise RuntimeError(f"{props.get('label', 'remote step')}: {script_key} failed with exit {code} on "
                               f"{props['connection']['host']}:\n{tail}")
        return out[-OUTPUT_TAIL:]

    def _outs(self, props: dict, stdout: str) -> dict:
        return {**props, "stdout": stdout, "appliedDigest": _digest(props)}

    def create(self, props: dict[str, Any]) -> CreateResult:
        return CreateResult(id_=uuid.uuid4().hex, outs=self._outs(props, self._exec(props, "apply")))

    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        if olds.get("appliedDigest") == _digest(news):
            # Only the connection changed (e.g. a rotated SSH key): record it, apply nothing.
            return UpdateResult(outs={**news, "stdout": olds.get("stdout", ""), "appliedDigest": _digest(news)})
        return UpdateResult(outs=self._outs(news, self._exec(news, "apply")))

    def delete(self, _id: str, props: dict[str, Any]) -> None:
        if props.get("destroy"):
            self._exec(props, "destroy")

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        changed = [k for k in ("apply", "destroy", "files", "uploads", "env", "triggers", "check")
                   if olds.get(k) != news.get(k)]
        if olds.get("appliedDigest") != _digest(news):
            changed.append("appliedDigest")
        conn_old, conn_new = olds.get("connection") or {}, news.get("connection") or {}
        if conn_old != conn_new:
            changed.append("connection")
        replaces = ["connection"] if (conn_old.get("host"), conn_old.get("port")) != (conn_new.get("host"), conn_new.get("port")) else []
        return DiffResult(changes=bool(changed or replaces), replaces=replaces, delete_before_replace=True,
                          stables=["stdout"] if not changed else [])

    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        if not props.get("check"):
            return ReadResult(id_=id_, outs=props)
        client = connect(SshTarget.from_props(props["connection"]))
        try:
            code, out, err = run(client, props["check"], timeout_s=120, env=props.get("env"))
        finally:
            client.close()
        outs = dict(props)
        if code != 0:
            pulumi.log.warn(f"{props.get('label', 'remote step')}: drift found on {props['connection']['host']}: "
                            f"{(err or out).strip()[-1000:]}")
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
            "files": files, "uploads": uploads, "env": env, "triggers": triggers, "timeoutS": timeout_s,
            "label": label or name, "stdout": None, "appliedDigest": None,
        }, opts)
