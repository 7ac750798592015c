"""HostIdentity: who a host is, so every step knows when it must run again.

The first SSH contact records the host key (trust on first use) unless the stack pins it
(`host.hostKey`; the test VM's key is known and always pinned). Later sessions, from every
RemoteStep, verify that key: a changed key is refused with the command that accepts it.

The identity itself is a random id that fimfleet writes to the host
(/var/lib/fimfleet/host-id) on first contact. A host that moved to a new address keeps
it, so nothing is re-applied; a host that was wiped, rebuilt or replaced has none (or
another), so it gets a new identity, and every step on it (the connection carries it) and
the SLA check run again. `pulumi refresh` notices a missing id and the next `up` repairs it.
A host declared gone (`host.gone`) is never contacted.
No SSH session is opened in `diff`, so a no-op `up` stays offline.
"""

from __future__ import annotations

import uuid
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult

from components.errors import Error, readable_failures, warn
from components.remote import MARKER_DIR, UNDO_DIR, UNDO_NAME
from components.ssh import SshTarget, Unreachable, run, session, shared_session

STATE_DIR = "/var/lib/fimfleet"
ID_FILE = f"{STATE_DIR}/host-id"
SWEEP = f"""# What the creates that never finished left (components/remote.py, UNDO_DIR), newest first;
# the host leaves the stack, so no later run would undo them. Each within its step's time; one
# that fails is named and the rest go on. Anything else there (an upload's temp file) just goes.
if cd {UNDO_DIR} 2>/dev/null; then
  for f in $(ls -t); do
    [[ $f =~ ^{UNDO_NAME.pattern}$ ]] || {{ rm -f "$f"; continue; }}
    what=$(head -n 1 "$f" | cut -c3-)
    limit=$(sed -n 's/^# timeout: \\([0-9][0-9]*\\)$/\\1/p' "$f" | head -n 1)
    echo "progress: $what" >&2
    if ! out=$(timeout -k 10 "${{limit:-1800}}" bash -euo pipefail "$f" </dev/null 2>&1); then
      printf '%s: %s\\n' "$what" "$(tail -n 3 <<<"$out")"
    fi
    rm -f "$f"
  done
  cd / && rmdir {UNDO_DIR} 2>/dev/null || true
fi
rm -f {ID_FILE}
rmdir {MARKER_DIR} {STATE_DIR} 2>/dev/null || true  # emptied by the steps' destroys; a step left keeps its record"""
PROBE = f"cat /etc/machine-id 2>/dev/null || echo unknown; cat {ID_FILE} 2>/dev/null || true"


def _address(conn: dict) -> tuple:
    return conn.get("host"), int(conn.get("port", 22)), conn.get("bastionHost") or "", int(conn.get("bastionPort") or 22)


class HostIdentityProvider(ResourceProvider):
    """See the module docstring. Inputs: connection, hostKey / bastionHostKey as configured (may be empty)."""

    @staticmethod
    def _contact(props: dict, pinned: str, pinned_bastion: str, keep: str) -> dict:
        """Connect (pinned key, or first contact), read the host's id; write a new one unless it is `keep`."""
        conn = {**props["connection"], "hostKey": pinned, "bastionHostKey": pinned_bastion}
        t = SshTarget.from_props(conn)
        with shared_session(t) if pinned else session(t, first_contact=True) as client:
            seen = client.fimfleet_seen
            _, out, _ = run(client, PROBE)
            lines = out.split()
            machine_id, found = (lines + ["unknown"])[0], (lines[1] if len(lines) > 1 else "")
            identity = found if found and (not keep or found == keep) else uuid.uuid4().hex
            if identity != found:
                code, _, err = run(client, f"mkdir -p {STATE_DIR} && echo {identity} > {ID_FILE}")
                if code:
                    raise Error(f"cannot record fimfleet's host id in {ID_FILE} on {t.where} ({err.strip()[-300:]}): "
                                "is its disk full or /var/lib read-only? Fix that, then rerun `pulumi up`")
        host_key = pinned or seen[-1]
        bastion_key = pinned_bastion or (seen[0] if t.bastion_host and len(seen) > 1 else "")
        return {**props, "hostKeySeen": host_key, "bastionHostKeySeen": bastion_key, "machineId": machine_id,
                "identity": identity}

    @readable_failures
    def create(self, props: dict[str, Any]) -> CreateResult:
        outs = self._contact(props, props.get("hostKey") or "", props.get("bastionHostKey") or "", keep="")
        return CreateResult(id_=uuid.uuid4().hex, outs=outs)

    @readable_failures
    def update(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        if news["connection"].get("gone"):
            # Declared gone: record it without contact, so destroy and refresh skip the host at once.
            return UpdateResult(outs={**olds, **{k: news[k] for k in ("connection", "hostKey", "bastionHostKey")}})
        moved = _address(olds["connection"]) != _address(news["connection"])
        # The same address keeps the key trusted on first use; a new address is a new first contact.
        pinned = news.get("hostKey") or ("" if moved else olds.get("hostKeySeen", ""))
        pinned_bastion = news.get("bastionHostKey") or ("" if moved else olds.get("bastionHostKeySeen", ""))
        return UpdateResult(outs=self._contact(news, pinned, pinned_bastion, keep=olds.get("identity") or "-"))

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        changed = [k for k in ("connection", "hostKey", "bastionHostKey") if olds.get(k) != news.get(k)]
        if not olds.get("identity"):
            changed.append("identity")  # refresh found the host wiped
        return DiffResult(changes=bool(changed), replaces=[], delete_before_replace=False,
                          stables=[] if changed else ["identity", "hostKeySeen", "machineId"])

    @readable_failures
    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        conn = {**props["connection"], "hostKey": props.get("hostKeySeen", ""),
                "bastionHostKey": props.get("bastionHostKeySeen", "")}
        if conn.get("gone"):
            return ReadResult(id_=id_, outs=props)
        with shared_session(SshTarget.from_props(conn)) as client:
            _, out, _ = run(client, PROBE)
        found = (out.split() + ["", ""])[1]
        outs = dict(props)
        if found != props.get("identity"):
            warn(f"host {conn['host']}:{conn.get('port', 22)} has lost fimfleet's host id ({ID_FILE}): it was wiped or "
                 "replaced; the next `pulumi up` applies every step again")
            outs["identity"] = ""
        return ReadResult(id_=id_, outs=outs)

    @readable_failures
    def delete(self, _id: str, props: dict[str, Any]) -> None:
        conn = {**props["connection"], "hostKey": props.get("hostKeySeen", ""),
                "bastionHostKey": props.get("bastionHostKeySeen", "")}
        if conn.get("gone"):
            return
        try:
            with session(SshTarget.from_props(conn)) as client:
                _, failed, _ = run(client, SWEEP, timeout_s=7200, label="undo of unfinished steps")
        except Unreachable as e:
            warn(f"{e}; fimfleet's host id stays on it")
            return
        if failed.strip():
            warn(f"undoing steps whose first apply did not finish failed on {conn.get('host')}; what they did stays:\n{failed.strip()}")


class HostIdentity(Resource):
    """The pinned host key(s) and identity of one host; see the module docstring."""

    hostKeySeen: pulumi.Output[str]  # noqa: N815 - dynamic outputs keep their state names
    bastionHostKeySeen: pulumi.Output[str]  # noqa: N815
    identity: pulumi.Output[str]
    machineId: pulumi.Output[str]  # noqa: N815

    def __init__(self, name: str, *, connection: pulumi.Input[dict], host_key: str = "", bastion_host_key: str = "",
                 opts: pulumi.ResourceOptions | None = None):
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(additional_secret_outputs=["connection"]))
        super().__init__(HostIdentityProvider(), name, {
            "connection": connection, "hostKey": host_key, "bastionHostKey": bastion_host_key,
            "hostKeySeen": None, "bastionHostKeySeen": None, "identity": None, "machineId": None,
        }, opts)
