"""End to end: the real Pulumi CLI deploys the `local-fleet` stack, two test VMs behind a gateway
beside the first (scripts/local_fleet.py), and rolls changes over it.

One stack for the module, steps in order: fleet `up` (both engines adopted from serving
snapshots; no Prometheus, which the `local` e2e covers) → a no-op `up` changes nothing → each
key stays on one node → a rolling change while a client streams through the gateway, with
node2 left out of rotation as a failed `up` leaves it: node2 drained, checked and enabled before
the canary, no failed request → a change that fails the
canary's SLA: `up` fails, node2 untouched and serving, the gateway sends the canary nothing →
`destroy` removes both nodes and the gateway.

The rolling change is a kernel value: it drains, retunes and checks each node in turn as an
engine change does, without the engine's restart (3-4 minutes per node under emulation, which
`.ci/run` cannot afford twice more). A roll with real engine restarts is measured natively by
benchmarks/roll_capacity.py; the local-docker e2e rolls a real engine restart on one VM.

In `./fimfleet test`'s default run: about 9 minutes warm (alone on 2026-12-07: 523 s, against 650 s
the same hour with Prometheus on both nodes). Alone:
`./fimfleet test -m fleet tests/e2e/test_local_fleet.py`.
"""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from components import runtime
from components.gateway import SERVERS_FILE
from components.gateway_render import FLEET_PROBE_KEY_NAME, GATEWAY, GatewayPaths
from components.nginx_base import NginxBase
from scripts import local_deploy as ld
from scripts import local_fleet
from tests.e2e.local_stack import (Node, assert_sla_missed, client, journal_cursor, keys, live, set_impossible_sla,
                                   shown, unit_journal, vm_ssh)

pytestmark = [pytest.mark.e2e, pytest.mark.fleet, pytest.mark.timeout(5400)]

NODES = local_fleet.NODES
CANARY, OTHER = NODES
SYSCTL = "vm.dirty_ratio"
"""The rolling changes: a kernel value (components/kernel.py tunes it to 10)."""
ROLLED, FAILING = "11", "12"


class Fleet(Node):
    def __init__(self, tmp):
        super().__init__(tmp, stack=local_fleet.STACK)
        self.vms = local_fleet.states(tmp)

    def on(self, name: str, script: str, timeout=120) -> str:
        code, out, err = vm_ssh(self.vms[name], script, timeout)
        assert code == 0, f"{name}: {script}\n{out}\n{err}"
        return out

    def served_by(self) -> dict[str, list[str]]:
        """Node -> the key names of the completions its own ingress logged (the gateway's
        requests land there; a node logs a request once its last byte has left)."""
        return {n: [json.loads(line)["key"] for line in self.on(
            n, f"cat /var/log/nginx/fimfleet-{n}-access.log 2>/dev/null || true").splitlines()
            if '"/v1/completions"' in line] for n in NODES}

    def journal_cursor(self, name: str) -> str:
        return journal_cursor(self.vms[name])

    def engine_starts(self, name: str, cursor: str) -> int:
        """How often systemd started node `name`'s engine since `cursor`."""
        out = unit_journal(self.vms[name], runtime.unit_name(name), cursor)
        return sum(1 for line in out.splitlines() if line.startswith("Started "))


BODY = {"prompt": "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>", "max_tokens": 4,
        "temperature": 0, "stream": True}


def stream_once(c: httpx.Client, key: str, model: str) -> str | None:
    """One streamed FIM completion; None when it ended with [DONE], else what went wrong."""
    try:
        with c.stream("POST", "/v1/completions", json={**BODY, "model": model},
                      headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.read()[:300]!r}"
            lines = list(r.iter_lines())
        return None if "data: [DONE]" in lines else f"stream ended without [DONE]: {lines[-3:]}"
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    # Its own Pulumi state, so the demo fleet on this machine is never touched.
    mp = pytest.MonkeyPatch()
    mp.setenv("FIMFLEET_BACKEND_URL", f"file://{f.tmp / 'state'}")
    try:
        with live(request):
            paths = ld.prepare()
            # Both VMs from serving snapshots (node2's built in the local e2e's setup, or here the first
            # time): `up` adopts both engines.
            local_fleet.start(f.tmp, f.config_file, paths, serving=True)
        # Prometheus and node_exporter on a test VM are the `local` e2e's (test_04b scrapes them);
        # here they were about 100 s of the first `up` (each node's, before its SLA gate, the canary
        # and then node2) and two more steps per node in `destroy`, for nothing this module asserts.
        f.pulumi("config", "set", "--path", "fimfleet:monitoring.enabled", "false", "--type", "bool", check=True)
        f.first_up = f.pulumi("up", "--yes", "--skip-preview")
        f.destroyed = False
        yield f
        if not f.destroyed:
            f.pulumi("destroy", "--yes")
    finally:
        local_fleet.stop(f.tmp)
        mp.undo()


def test_01_up_deploys_both_nodes_behind_the_gateway(fleet):
    assert fleet.first_up.returncode == 0, shown(fleet.first_up)
    out = fleet.outputs()
    assert {n: v["state"] for n, v in out["nodes"].items()} == {n: "in rotation" for n in NODES}, out["nodes"]
    forwards = json.loads((fleet.vms[CANARY] / "info.json").read_text())["ports"]
    assert out["endpoint"] == f"https://127.0.0.1:{forwards[str(local_fleet.GATEWAY_PORT)]}", out["endpoint"]
    assert "passed" in out["fleetSlaReport"].lower(), out["fleetSlaReport"]
    # The fleet's check went through the gateway to both nodes (its requests are spread over them).
    served = fleet.served_by()
    assert all(FLEET_PROBE_KEY_NAME in served[n] for n in NODES), {n: set(v) for n, v in served.items()}
    with client(fleet) as c:
        assert stream_once(c, next(iter(keys(fleet).values())), out["model"]) is None
        assert c.post("/v1/completions", json={**BODY, "model": out["model"]}).status_code == 401


def test_02_a_second_up_changes_nothing(fleet):
    proc = fleet.pulumi("up", "--yes", "--skip-preview")
    assert proc.returncode == 0 and "unchanged" in proc.stdout, shown(proc)
    assert not re.search(r"\bupdated\b|\bcreated\b|\breplaced\b", proc.stdout), shown(proc)


def test_03_each_key_stays_on_one_node(fleet):
    before = fleet.served_by()
    model = fleet.outputs()["model"]
    with client(fleet) as c:
        for _ in range(3):
            for name, key in keys(fleet).items():
                assert stream_once(c, key, model) is None, name
    after = fleet.served_by()
    new = {n: after[n][len(before[n]):] for n in NODES}
    for name in keys(fleet):
        where = [n for n in NODES if name in new[n]]
        assert len(where) == 1 and sum(new[n].count(name) for n in NODES) == 3, f"key {name} went to {new}"


def test_04_a_rolling_change_drains_one_node_at_a_time_and_fails_no_request(fleet):
    """node2 starts out of rotation, as an `up` that failed after its drain leaves it (its check
    failed, its enable never ran). The roll reads the rotation first and rolls node2 before the
    canary: draining the canary first would leave no node in rotation for its restart."""
    paths = GatewayPaths(servers=f"{NginxBase().sites_dir}/{SERVERS_FILE}")  # as gateway.args_for has them
    fleet.on(CANARY, f"rm {paths.enabled_dir}/{OTHER}")  # the gateway is beside the canary
    cursors = {n: fleet.journal_cursor(n) for n in NODES}
    model, key = fleet.outputs()["model"], next(iter(keys(fleet).values()))
    results: list[str | None] = []
    done = threading.Event()

    def stream_all_along():
        with client(fleet) as c:
            while not done.is_set():
                results.append(stream_once(c, key, model))

    worker = threading.Thread(target=stream_all_along, daemon=True)
    worker.start()
    fleet.pulumi("config", "set", "--path", f'fimfleet:kernel.sysctl["{SYSCTL}"]', ROLLED, check=True)
    try:
        proc = fleet.pulumi("up", "--yes", "--skip-preview")
    finally:
        done.set()
        worker.join(timeout=300)
    assert proc.returncode == 0, shown(proc)
    failed = [r for r in results if r is not None]
    assert len(results) >= 5 and not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    # The rotation read, node2's drain, check and enable, then the canary's: one node out at a time.
    steps = [m.group(1) for m in re.finditer(r"(\S+-(?:drain|enable|sla|rotation)) (?:updated|replaced)", proc.stdout)]
    assert steps == [f"{GATEWAY}-rotation", f"{OTHER}-drain", f"{OTHER}-sla", f"{OTHER}-enable",
                     f"{CANARY}-drain", f"{CANARY}-sla", f"{CANARY}-enable", "fleet-sla"], shown(proc)
    for n in NODES:
        assert fleet.on(n, f"sysctl -n {SYSCTL}").strip() == ROLLED, n
        assert fleet.engine_starts(n, cursors[n]) == 0, f"{n}'s engine was restarted by a kernel change"
    out = fleet.outputs()
    assert {n: v["state"] for n, v in out["nodes"].items()} == {n: "in rotation" for n in NODES}, out["nodes"]


def test_05_a_change_that_fails_the_canarys_sla_stops_there(fleet):
    cursor = fleet.journal_cursor(OTHER)
    fleet.pulumi("config", "set", "--path", f'fimfleet:kernel.sysctl["{SYSCTL}"]', FAILING, check=True)
    set_impossible_sla(fleet)
    proc = fleet.pulumi("up", "--yes", "--skip-preview")
    assert_sla_missed(proc)
    # The canary was drained and stays so; node2 was not touched and serves every request.
    assert re.search(rf"{CANARY}-drain +updated", proc.stdout), shown(proc)
    assert not re.search(rf"{OTHER}-\S+ +updated", proc.stdout), shown(proc)
    assert fleet.on(OTHER, f"sysctl -n {SYSCTL}").strip() == ROLLED
    assert fleet.engine_starts(OTHER, cursor) == 0
    before = fleet.served_by()
    model = fleet.outputs()["model"]
    with client(fleet) as c:
        for name, key in keys(fleet).items():
            assert stream_once(c, key, model) is None, name
    after = fleet.served_by()
    users = set(keys(fleet))  # the nodes' own monitors probe them with their own key meanwhile
    sent = {n: [k for k in after[n][len(before[n]):] if k in users] for n in NODES}
    assert not sent[CANARY], f"the drained canary was sent {sent[CANARY]}"
    assert sorted(sent[OTHER]) == sorted(users), sent


def test_06_destroy_removes_both_nodes_and_the_gateway(fleet):
    proc = fleet.pulumi("destroy", "--yes")
    fleet.destroyed = proc.returncode == 0
    assert proc.returncode == 0, shown(proc)
    for n in NODES:
        out = fleet.on(n, f"systemctl show -p LoadState --value {runtime.unit_name(n)}; "
                          "{ ls /etc/nginx/fimfleet.d 2>/dev/null || true; } | wc -l; "
                          "dpkg-query -W -f='${Status}\\n' nginx 2>/dev/null | grep -c 'ok installed' || true")
        assert out.split() == ["not-found", "0", "0"], f"{n} keeps: {out}"
