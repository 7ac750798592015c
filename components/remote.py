"""RemoteStep: a script run on a host over SSH, as a Pulumi dynamic resource.

pulumi-command's provider cannot be built offline here (its module versions are not
served by the reachable Go proxy), so fimfleet carries this small equivalent. Each step
uploads its files (secrets included) over SFTP, then runs `apply`. `diff` is explicit:
the step runs again only when its scripts, files, triggers or the host's identity
(components/identity.py) change. `read` (used by `pulumi refresh` / `up --refresh`)
checks the step's marker on the host and runs the optional `check` script; either
failing marks the step as drifted, so the next `up` applies it again. `delete` runs
`destroy`, and skips it with a warning when the host is gone.

Every SSH session verifies the host's pinned key (components/ssh.py), so secrets are only
ever uploaded to the host that was first trusted.

The provider object is pickled into the state with dill: it holds no client and no
secret. Its calls reach the host through components/ssh.py: the steps on one host share one
verified connection for the life of the provider's process (one `pulumi up`), so a deploy
pays one SSH handshake and one login per host instead of one per step.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import uuid
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult

from components.errors import Error, readable_failures, warn
from components.ssh import PROGRESS_PREFIX, SshTarget, Unreachable, run, shared_session
from components.upload import put_dir, put_files

OUTPUT_TAIL = 4000
"""Bytes of stdout kept in state; scripts never print secrets, and stderr is only shown on failure."""
MARKER_DIR = "/var/lib/fimfleet/steps"
"""Each applied step leaves its digest here; a wiped host has none, so refresh finds it."""
PENDING = "pending"
"""A marker while an update is under way: no digest matches it."""
UNDO_DIR = f"{MARKER_DIR}/undo"
"""A create's destroy script waits here until that create succeeds. A first apply that failed or
was cut short is not in the state, so no destroy would ever run for what it did: the host's
identity runs what is left here when the host leaves the stack (components/identity.py)."""



STEP_KEYS = ("apply", "destroy", "files", "uploads", "env", "triggers")


def reason(out: str, err: str) -> str:
    """Why a script failed: its stderr without the progress lines, else its stdout."""
    said = [l for l in err.splitlines() if not l.startswith(PROGRESS_PREFIX)]
    return "\n".join(said if any(l.strip() for l in said) else out.splitlines())


def _connection(props: dict) -> dict:
    """The step's connection; {} while a preview does not know it yet (a host whose connection
    changed is read again by HostIdentity first, so its outputs are unknown until `up`)."""
    conn = props.get("connection")
    return conn if isinstance(conn, dict) else {}


def _identity(props: dict) -> str | None:
    """The host identity (components/identity.py) that the connection carries, if any."""
    return _connection(props).get("identity")


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


def _mark_command(id_: str, digest: str) -> str:
    return f"mkdir -p {MARKER_DIR} && printf %s {digest} > {shlex.quote(_marker(id_))}"


UNDO_NAME = re.compile(r"[0-9a-f]{24}")
"""An undo file's name; anything else in UNDO_DIR (an upload's temp file) is not one."""


def _undo(props: dict) -> dict | None:
    """The undo file of a create (UNDO_DIR), keyed by the step's resource name: a rerun's create
    replaces the one its failed run left. Its header names the step and the time it may take."""
    name = props.get("undoKey")
    if not name:
        return None
    key = hashlib.sha256(str(name).encode()).hexdigest()[:24]
    header = (f"# undo of {props.get('label', name)} ({name}), whose first apply did not finish\n"
              f"# timeout: {int(float(props.get('timeoutS', 1800)))}\n")
    return {"path": f"{UNDO_DIR}/{key}", "mode": "0600", "content": f"{header}{props.get('destroy') or ''}\n"}


def _then_mark(script: str, id_: str, digest: str, pending: bool = False, undo: dict | None = None,
               write_undo: bool = False) -> str:
    """The apply in a subshell, then its marker, in one shell on the host (a second one costs
    about 0.3 s emulated): an `exit 0` in the script ends only the subshell, and a failure ends
    both (set -e) before the marker is written. `pending`: the marker says so first. `undo`: a
    create's undo file, written first (`write_undo`; else the upload did) and removed at the end,
    also when the step has no destroy (an earlier program's step of that name may have had one)."""
    first = f"{_mark_command(id_, PENDING)}\n" if pending else ""
    if undo and write_undo:
        b64 = base64.b64encode(undo["content"].encode()).decode()
        first += f"(umask 077 && mkdir -p {UNDO_DIR} && printf %s {b64} | base64 -d > {shlex.quote(undo['path'])})\n"
    last = f"rm -f {shlex.quote(undo['path'])}\n" if undo else ""
    return f"{first}(\n:\n{script}\n)\n{_mark_command(id_, digest)}\n{last}"


def _target(props: dict) -> SshTarget:
    return SshTarget.from_props(props["connection"])


def _gone(props: dict) -> bool:
    return bool(_connection(props).get("gone"))


class RemoteStepProvider(ResourceProvider):
    """Dynamic provider behind RemoteStep; see the module docstring."""

    def _exec(self, id_: str, props: dict, script_key: str, update: bool = False) -> str:
        """`update`: the step is in the state already. Its marker says "pending" from before the
        first byte changes until the apply succeeds, so a failed update is drift for `refresh`:
        otherwise a config rolled back to what the state holds finds no diff, and the host keeps
        the failed update's half."""
        label = props.get("label", "remote step")
        script = props.get(script_key) or ""
        t = _target(props)
        with shared_session(t) as client:
            if script_key == "apply":
                # with an upload, the marker (an update's) or the undo file (a create's) goes first
                # in it; without one, first in the script
                uploads = bool(props.get("files") or props.get("uploads"))
                undo = None if update else _undo(props)
                if uploads:
                    first = [{"path": _marker(id_), "mode": "0644", "content": PENDING}] if update else []
                    if undo and props.get("destroy"):
                        first.append(undo)
                    put_files(client, first + list(props.get("files") or ()))
                for up in props.get("uploads") or ():
                    put_dir(client, up["local"], up["remote"])
                script = _then_mark(script, id_, _digest(props), pending=update and not uploads, undo=undo,
                                    write_undo=not uploads and bool(props.get("destroy")))
            code, out, err = (run(client, script, timeout_s=float(props.get("timeoutS", 1800)), env=props.get("env"),
                                  label=label) if script else (0, "", ""))
            if code == 0 and script_key == "destroy":
                run(client, f"rm -f {shlex.quote(_marker(id_))}")
        if code != 0:
            raise Error(f"{label}: {script_key} failed with exit {code} on {t.where}:\n{reason(out, err)[-OUTPUT_TAIL:]}")
        return out[-OUTPUT_TAIL:]

    def _outs(self, props: dict, stdout: str) -> dict:
        return {**props, "stdout": stdout, "appliedDigest": _digest(props)}

    @readable_failures
    def create(self, props: dict[str, Any]) -> CreateResult:
        id_ = uuid.uuid4().hex
        return CreateResult(id_=id_, outs=self._outs(props, self._exec(id_, props, "apply")))

    @readable_failures
    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        # A new destroy script changes nothing that the apply did: it is recorded, not applied
        # (an apply again could mean a model's whole upload).
        if olds.get("appliedDigest") == _wanted(olds, {**news, "destroy": olds.get("destroy")}):
            # Same host, same content: only the connection or the destroy changed (a rotated SSH
            # key, a moved host) or the step is being adopted into host identities. Record it, apply nothing.
            # A marker still "pending" is a failed update's half on the host: that is applied again.
            if _gone(news) or self._remark(id_, news):
                return UpdateResult(outs={**news, "stdout": olds.get("stdout", ""), "appliedDigest": _digest(news)})
        return UpdateResult(outs=self._outs(news, self._exec(id_, news, "apply", update=True)))

    def _remark(self, id_: str, news: dict) -> bool:
        """Record the step's new digest as applied, unless its marker says a failed update is pending."""
        m = shlex.quote(_marker(id_))
        with shared_session(_target(news)) as client:
            code, out, err = run(client, f'if [ "$(cat {m} 2>/dev/null)" = {PENDING} ]; then echo {PENDING}; '
                                         f"else {_mark_command(id_, _digest(news))}; fi")
        if code:
            raise Error(f"cannot record the step marker {_marker(id_)}: {err.strip()}")
        return out.strip() != PENDING

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
        with shared_session(_target(props)) as client:
            if _identity(props) is not None:
                code, out, _ = run(client, f"cat {shlex.quote(_marker(id_))} 2>/dev/null || true")
                if out.strip() != props.get("appliedDigest"):
                    problems.append("the step's marker is missing or stale (host wiped or rebuilt?)")
            if props.get("check"):
                code, out, err = run(client, props["check"], timeout_s=120, env=props.get("env"))
                if code != 0:
                    problems.append(reason(out, err).strip()[-1000:])
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
            "files": files, "uploads": uploads, "env": env, "triggers": triggers, "timeoutS": timeout_s, "label": label or name,
            "undoKey": name, "stdout": None, "appliedDigest": None,
        }, opts)
