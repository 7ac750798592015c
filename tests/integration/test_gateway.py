"""The fleet gateway on real nginx: two node ingresses (each its own nginx, certificate and SSE
upstream) behind a gateway rendered by components/ingress_render.py with a FleetUpstream, its
servers file written by the generator and its rotation changed by the real drain and enable
scripts (components/gateway_render.py). Which node served a request is read from the nodes'
own access logs, which log the key name.
"""

from __future__ import annotations

import os
import secrets
import signal
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from components import gateway_render
from components.gateway_render import FLEET_TLS_NAME, FleetUpstream, GatewayPaths, Member
from components.nginx_base import NginxBase
from components.tls import issue
from tests.helpers import free_port
from tests.integration.nginx_harness import (CHUNK_DELAY_MS, SERVER_NAME, Nginx, Upstream, bearer, children_of, wait_for,
                                            write_tls)
from tests.integration.test_nginx_ingress import assert_streamed_unbuffered, stream_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

USERS = [f"dev{i}" for i in range(32)]
"""nginx places the nodes on its hash ring by their member servers' addresses and port, and the
test's member port is the kernel's choice, so which node a key lands on changes from run to run: with 32 keys both nodes get
some in all but about one run in 2^31 (with 8, about one run in 128 put every key on one)."""
PROBE = gateway_render.FLEET_PROBE_KEY_NAME
GATEWAY_RATE = 5
"""Requests a second per key at the gateway, and its burst (the nodes allow 100)."""


class Fleet:
    """Nodes a and b, and the gateway in front of them, all on 127.0.0.1."""

    def __init__(self, root: Path):
        self.root, self.keys = root, {u: secrets.token_urlsafe(24) for u in [*USERS, PROBE]}
        self.upstreams, self.nodes, self.cas = {}, {}, []
        for name in ("a", "b"):
            (root / name).mkdir()
            tls = write_tls(root / name, issue(SERVER_NAME, [SERVER_NAME, FLEET_TLS_NAME], ["127.0.0.1"], days=1))
            self.cas.append(tls.ca.read_text())
            self.upstreams[name] = Upstream(root / name)
            self.nodes[name] = Nginx(root / name / "nginx", tls, self.upstreams[name].port, node=name,
                                     api_keys=self.keys, rate_per_second=100, burst=100).start()
        gw_dir = root / "gateway"
        gw_dir.mkdir()
        (gw_dir / "nodes-ca.pem").write_text("".join(self.cas))
        self.paths = GatewayPaths(servers=str(gw_dir / "gateway.servers"), state_dir=str(gw_dir / "state"),
                                  lock=str(gw_dir / "nginx.lock"))
        self.upstream = FleetUpstream(
            members=tuple(Member(n, "127.0.0.1", ngx.https_port) for n, ngx in self.nodes.items()),
            paths=self.paths, ca_path=str(gw_dir / "nodes-ca.pem"), max_fails=1, fail_timeout_s=30,
            member_port=free_port())
        # Nodes pass their SLA checks before the gateway's own step has run: markers only.
        for name in self.nodes:
            assert "gateway not installed yet" in self.member(name, enabled=True, installed=False)
        # The gateway's step: install the generator and write the servers file from the markers.
        generator = Path(self.paths.generator)
        generator.write_text(gateway_render.servers_script(self.upstream))
        generator.chmod(0o755)
        subprocess.run([str(generator)], check=True, timeout=30)
        gw_tls = write_tls(gw_dir, issue(SERVER_NAME, [SERVER_NAME], ["127.0.0.1"], days=1))
        self.gateway_ca = gw_tls.ca
        self.gateway = Nginx(gw_dir / "nginx", gw_tls, 1, node="gateway", api_keys=self.keys,
                             rate_per_second=GATEWAY_RATE, burst=GATEWAY_RATE, fleet=self.upstream).start()

    def member(self, node: str, enabled: bool, installed: bool = True, drain_timeout_s: int = 30) -> str:
        """Run the real drain or enable step against the gateway; it must not reload nginx (a
        reload closes idle keep-alive connections under clients that are sending on them)."""
        base = self.gateway.spec.base if installed else NginxBase(conf_dir="/nonexistent")
        script = gateway_render.member_script(node, enabled, base, self.paths, drain_timeout_s)
        workers = children_of(self.gateway.proc.pid) if installed else set()
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if installed:
            assert children_of(self.gateway.proc.pid) == workers, "the step reloaded the gateway"
        return proc.stdout

    def rotation(self) -> set[str]:
        """The nodes the real rotation read (the roll's first step) finds in rotation."""
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", gateway_render.rotation_script(self.paths, list(self.nodes))],
                              capture_output=True, text=True, timeout=30, check=True)
        return set(self.nodes) - gateway_render.out_of_rotation(proc.stdout)

    def served_by(self) -> dict[str, list[str]]:
        """Node -> key names it served, from the nodes' own access logs, once every request the
        gateway has answered is there (a node logs a request after its last byte has left)."""
        want = sum(1 for e in self.gateway.access_log() if e["uri"] == "/v1/completions" and e["status"] == 200)

        def logged():
            got = {n: [e["key"] for e in ngx.access_log() if e["uri"] == "/v1/completions"]
                   for n, ngx in self.nodes.items()}
            return got if sum(len(v) for v in got.values()) >= want else None

        try:
            return wait_for(logged, 5, "the nodes' access logs")
        except TimeoutError:
            return {n: [e["key"] for e in ngx.access_log() if e["uri"] == "/v1/completions"]
                    for n, ngx in self.nodes.items()}

    def complete(self, client: httpx.Client, user: str, **extra) -> httpx.Response:
        body = {"model": "sse-test", "prompt": "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>", "max_tokens": 2, **extra}
        return client.post(self.gateway.url("/v1/completions"), json=body, headers=bearer(self.keys[user]))

    def stop(self) -> None:
        for ngx in [getattr(self, "gateway", None), *self.nodes.values()]:
            if ngx is not None:
                ngx.stop()
        for up in self.upstreams.values():
            up.stop()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.stop()


@pytest.fixture
def client(fleet):
    with httpx.Client(verify=ssl.create_default_context(cafile=str(fleet.gateway_ca)), timeout=httpx.Timeout(10.0)) as c:
        yield c


def test_each_key_stays_on_one_node_and_the_keys_spread_over_both(fleet, client):
    for _ in range(3):
        for user in USERS:
            assert fleet.complete(client, user).status_code == 200
    served = fleet.served_by()
    homes = {u: {n for n, names in served.items() if u in names} for u in USERS}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert all(served[n] for n in fleet.nodes), f"one node got every key: {served}"
    assert sum(len(v) for v in served.values()) == 3 * len(USERS)  # nothing was sent twice


def test_the_fleets_sla_probe_goes_to_the_node_with_the_fewest_open_streams(fleet, client):
    """The fleet's SLA check through the gateway measures the fleet: at twice a node check's
    concurrency each node carries one stream, as in its own check. Its one key kept on one node,
    a random spread or a plain round robin would send a request to the node already streaming."""
    body = {"model": "sse-test", "prompt": "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>", "max_tokens": 20,
            "stream": True}

    def probes() -> dict[str, int]:
        return {n: names.count(PROBE) for n, names in fleet.served_by().items()}

    for _ in range(2):
        before = probes()
        with client.stream("POST", fleet.gateway.url("/v1/completions"), json=body,
                           headers=bearer(fleet.keys[PROBE])) as streaming:
            assert streaming.status_code == 200
            for _ in range(2):  # while it streams (a node logs a request once it is done)
                assert fleet.complete(client, PROBE).status_code == 200
            during = {n: c - before[n] for n, c in probes().items()}
            streaming.read()
        busy = [n for n, c in during.items() if c == 0]
        assert sorted(during.values()) == [0, 2] and len(busy) == 1, during
        assert probes()[busy[0]] - before[busy[0]] == 1, "the stream was not where nothing else went"
        time.sleep(4 / GATEWAY_RATE)


def test_a_drained_node_gets_nothing_and_its_keys_come_back_when_enabled(fleet, client):
    for user in USERS:
        fleet.complete(client, user)
    home = {u: n for n, names in fleet.served_by().items() for u in names}
    assert fleet.rotation() == {"a", "b"}
    out = fleet.member("a", enabled=False)
    assert "node a is drained" in out, out
    assert fleet.rotation() == {"b"}  # what the next roll reads: a goes first
    before = len(fleet.served_by()["a"])
    for user in USERS:
        assert fleet.complete(client, user).status_code == 200
    assert len(fleet.served_by()["a"]) == before, "a drained node was sent requests"
    fleet.member("a", enabled=True)
    assert fleet.rotation() == {"a", "b"}
    start = {n: len(v) for n, v in fleet.served_by().items()}
    for user in USERS:
        fleet.complete(client, user)
    after = {n: v[start[n]:] for n, v in fleet.served_by().items()}
    assert {u: n for n, names in after.items() for u in names} == home  # consistent hashing: the same homes


def test_a_node_drained_while_nginx_reloaded_is_back_in_rotation_after_its_enable(fleet, client):
    """A fresh fleet: the gateway's own step reloads nginx before the second node's first enable
    (the node waits for the canary); any later nginx change may reload during a roll. The
    enable reloads nothing, so the running nginx must already hold the drained node."""
    fleet.member("b", enabled=False)
    fleet.gateway.reload()
    fleet.member("b", enabled=True)
    for user in USERS:
        assert fleet.complete(client, user).status_code == 200
    assert fleet.served_by()["b"], "node b got no request after its enable"


def test_with_every_node_drained_a_client_reads_why_and_when_to_retry(fleet, client):
    for name in fleet.nodes:
        fleet.member(name, enabled=False)
    r = fleet.complete(client, USERS[0])
    assert r.status_code == 404 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["code"] == "no_node_in_rotation" and r.headers["retry-after"].isdigit()
    fleet.member("b", enabled=True)
    for _ in range(3):  # nginx counted no failure against either node: b answers at once
        assert fleet.complete(client, USERS[0]).status_code == 200
    assert "retry-after" not in fleet.complete(client, USERS[1]).headers


def test_a_drain_lets_the_nodes_open_streams_finish_before_it_returns(fleet, client):
    for user in USERS:
        fleet.complete(client, user)
    user = fleet.served_by()["a"][0]
    body = {"model": "sse-test", "prompt": "p", "max_tokens": 10, "stream": True, "x_delay_ms": 300}
    events, drained = [], {}

    def drain():
        t0 = time.monotonic()
        drained["out"] = fleet.member("a", enabled=False)
        drained["s"] = time.monotonic() - t0

    with client.stream("POST", fleet.gateway.url("/v1/completions"), json=body, headers=bearer(fleet.keys[user])) as resp:
        worker = None
        for raw in resp.iter_raw():
            events.append(raw)
            if worker is None:  # the stream runs: drain its node now
                worker = threading.Thread(target=drain)
                worker.start()
    t_done = time.monotonic()
    worker.join(timeout=60)
    assert b"[DONE]" in b"".join(events), "the drain cut an open stream"
    assert "node a is drained" in drained["out"], drained
    assert drained["s"] >= 1.5, f"the drain returned after {drained['s']:.1f} s, before the 3 s stream ended"
    assert time.monotonic() - t_done < 5


def test_a_node_that_refuses_before_the_first_byte_is_retried_on_the_other(fleet, client):
    for user in USERS:
        fleet.complete(client, user)
    a_users = set(fleet.served_by()["a"])
    fleet.nodes["a"].stop()
    for user in USERS:
        r = fleet.complete(client, user)
        assert r.status_code == 200, (user, r.status_code, r.text)
    log = fleet.gateway.access_log()
    retried = [e for e in log if e["key"] in a_users and "," in e["upstream_status"]]
    assert retried, f"no request went to a second node: {[e['upstream_status'] for e in log]}"
    assert set(fleet.served_by()["b"]) >= a_users


def test_a_started_stream_is_never_replayed_on_another_node(fleet, client):
    for user in USERS:
        fleet.complete(client, user)
    user = fleet.served_by()["a"][0]
    b_before = len(fleet.served_by()["b"])
    body = {"model": "sse-test", "prompt": "p", "max_tokens": 20, "stream": True, "x_delay_ms": 200}
    got = []
    with pytest.raises(httpx.HTTPError):
        with client.stream("POST", fleet.gateway.url("/v1/completions"), json=body,
                           headers=bearer(fleet.keys[user])) as resp:
            assert resp.status_code == 200
            for raw in resp.iter_raw():
                got.append(raw)
                if len(got) == 2:  # the stream has started: kill node a's nginx outright
                    ngx = fleet.nodes["a"]
                    for pid in children_of(ngx.proc.pid) | {ngx.proc.pid}:
                        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    assert len(fleet.served_by()["b"]) == b_before, "a started stream was sent to node b"


def test_streams_through_the_gateway_are_unbuffered(fleet, client):
    url, user = fleet.gateway.url("/v1/completions"), USERS[0]
    stream_completion(client, url, bearer(fleet.keys[user]), chunks=1)  # warm the TLS connections
    runs = [stream_completion(client, url, bearer(fleet.keys[user])) for _ in range(3)]
    print(f"\nper-chunk lag through gateway and node (ms): {[[round(x * 1000, 1) for x in r.lags] for r in runs]}")
    assert runs[0].headers["x-accel-buffering"] == "no"
    # Two TLS proxies on a loaded 2-core machine: one chunk may wait for a CPU, but none is held
    # for a whole gap, and the median stays that of one proxy (buffering holds every chunk ~500 ms).
    assert_streamed_unbuffered(runs, hard_lag_s=CHUNK_DELAY_MS / 1000)


def test_the_gateway_answers_keys_and_limits_as_a_node_does(fleet, client):
    r = client.post(fleet.gateway.url("/v1/completions"), json={}, headers=bearer("not-a-key-" + "x" * 30))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"]
    assert client.get(fleet.gateway.url("/metrics")).status_code == 403
    codes = [fleet.complete(client, USERS[1]).status_code for _ in range(4 * GATEWAY_RATE)]
    limited = client.post(fleet.gateway.url("/v1/completions"), json={}, headers=bearer(fleet.keys[USERS[1]]))
    assert 429 in codes and limited.status_code == 429 and limited.json()["error"]["type"], codes
    assert codes.count(200) <= 2 * GATEWAY_RATE + 1, codes  # the burst plus what the rate refilled
    assert fleet.complete(client, USERS[2]).status_code == 200  # per key: the others are not limited
    served = fleet.served_by()
    assert "" not in served["a"] + served["b"]  # nothing unauthenticated reached a node


def test_a_gateway_that_cannot_verify_a_node_sends_it_nothing(tmp_path, fleet, client):
    """Negative control for upstream TLS: a bundle without node a's CA makes a unusable."""
    Path(fleet.upstream.ca_path).write_text(fleet.cas[1])
    old = children_of(fleet.gateway.proc.pid)
    os.kill(fleet.gateway.proc.pid, signal.SIGHUP)
    wait_for(lambda: (kids := children_of(fleet.gateway.proc.pid)) and not (kids & old), 15, "gateway reload")
    for user in USERS:
        assert fleet.complete(client, user).status_code == 200  # retried on b, which verifies
    assert fleet.served_by()["a"] == [], "node a was used without a verified certificate"
