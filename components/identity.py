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

import shlex
import uuid
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider, UpdateResult

from components.errors import Error, readable_failures, warn
from components.remote import MARKER_DIR, UNDO_DIR, UNDO_NAME
from components.ssh import SshTarget, Unreachable, run, session, shared_session

STATE_DIR = "/var/lib/fimfleet"
ID_FILE = f"{STATE_DIR}/host-id"
OWNER_FILE = f"{STATE_DIR}/owner"
"""The stack that deploys to the host (org/project/stack): one host serves one stack, as two
stacks' kernel tuning, engine units and sites would overwrite each other's."""
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
PROBE = (f"echo \"machine=$(cat /etc/machine-id 2>/dev/null)\"; echo \"id=$(cat {ID_FILE} 2>/dev/null)\"; "
         f"echo \"owner=$(cat {OWNER_FILE} 2>/dev/null)\"")


def this_stack() -> str:
    """The running program's stack, as a StackReference and OWNER_FILE name it."""
    return f"{pulumi.get_organization()}/{pulumi.get_project()}/{pulumi.get_stack()}"


def _fields(out: str) -> dict:
    return {k: v.strip() for k, v in (line.split("=", 1) for line in out.splitlines() if "=" in line)}


def _probe(client) -> dict:
    """The host's machine id ("unknown" if it has none), fimfleet's host id and owner ("" if none)."""
    _, out, _ = run(client, PROBE)
    found = _fields(out)
    return {"machine": found.get("machine") or "unknown", "id": found.get("id", ""), "owner": found.get("owner", "")}


def _refuse_other_owner(where: str, owner: str, wanted: str) -> None:
    if not owner or not wanted or owner == wanted:
        return
    why = (f"{where} is deployed by another stack, {owner} ({OWNER_FILE} there): one host serves one stack, as "
           "their kernel tuning, engine units and sites would overwrite each other's. ")
    if owner.split("/")[1:] == wanted.split("/")[1:]:  # the same project and stack under another org or backend
        raise Error(why + f"If {owner} is this stack before a move to another org or backend, write {wanted} into "
                    f"{OWNER_FILE} on the host and rerun `pulumi up`; else deploy {wanted} to another host")
    raise Error(why + f"Deploy {wanted} to another host, or run `pulumi destroy -s {owner}` first; if that stack is "
                f"gone for good (or was this one under another name), remove {OWNER_FILE} on the host and rerun `pulumi up`")


def _sweep(owner: str) -> str:
    """SWEEP, on a host this stack owns (or one owned by none): one that another stack adopted
    keeps its id, owner and undo files, and the output names that stack."""
    return (f'owner_now=$(cat {OWNER_FILE} 2>/dev/null || true)\n'
            f'if [ -n "$owner_now" ] && [ "$owner_now" != {shlex.quote(owner)} ]; then echo "owner=$owner_now"; exit 0; fi\n'
            f"rm -f {OWNER_FILE}\n" + SWEEP)


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
            host = _probe(client)
            owner = props.get("owner") or ""
            _refuse_other_owner(t.where, host["owner"], owner)
            found = host["id"]
            identity = found if found and (not keep or found == keep) else uuid.uuid4().hex
            record = []
            if owner and not host["owner"]:
                # created only if absent (noclobber): of two stacks' first contacts at once, one wins
                record.append(f"if ! (set -C; echo {shlex.quote(owner)} > {OWNER_FILE}) 2>/dev/null; then "
                              f'echo "owner=$(cat {OWNER_FILE})"; exit 0; fi')
            if identity != found:
                record.append(f"echo {identity} > {ID_FILE}")
            if record:
                code, out, err = run(client, "\n".join([f"mkdir -p {STATE_DIR}", *record]))
                if code:
                    raise Error(f"cannot record fimfleet's host id and owner in {STATE_DIR} on {t.where} "
                                f"({err.strip()[-300:]}): is its disk full or /var/lib read-only? Fix that, then "
                                "rerun `pulumi up`")
                _refuse_other_owner(t.where, _fields(out).get("owner", ""), owner)
        host_key = pinned or seen[-1]
        bastion_key = pinned_bastion or (seen[0] if t.bastion_host and len(seen) > 1 else "")
        return {**props, "hostKeySeen": host_key, "bastionHostKeySeen": bastion_key, "machineId": host["machine"],
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
        # A host deployed before the owner file: one contact writes it (or finds another stack's),
        # with the same identity, so no step runs again. A later owner change alone is not contact.
        claim = news.get("owner") and "owner" not in olds
        return DiffResult(changes=bool(changed or claim), replaces=[], delete_before_replace=False,
                          stables=[] if changed else ["identity", "hostKeySeen", "machineId"])

    @readable_failures
    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        conn = {**props["connection"], "hostKey": props.get("hostKeySeen", ""),
                "bastionHostKey": props.get("bastionHostKeySeen", "")}
        if conn.get("gone"):
            return ReadResult(id_=id_, outs=props)
        with shared_session(SshTarget.from_props(conn)) as client:
            found = _probe(client)["id"]
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
                _, failed, _ = run(client, _sweep(props.get("owner") or ""), timeout_s=7200,
                                   label="undo of unfinished steps")
            if failed.startswith("owner="):
                other = failed.split("=", 1)[1].strip()
                warn(f"{conn.get('host')} is deployed by another stack now, {other}: its host id, {OWNER_FILE} and "
                     "the undo of unfinished steps stay for that stack")
                return
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
                 owner: str = "", opts: pulumi.ResourceOptions | None = None):
        """`owner`: this_stack(), refused on a host that another stack deploys to. A state from before
        owners claims its host once (diff); a later owner change alone opens no SSH session."""
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(additional_secret_outputs=["connection"]))
        super().__init__(HostIdentityProvider(), name, {
            "connection": connection, "hostKey": host_key, "bastionHostKey": bastion_host_key, "owner": owner,
            "hostKeySeen": None, "bastionHostKeySeen": None, "identity": None, "machineId": None,
        }, opts)
