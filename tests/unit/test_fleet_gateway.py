"""A fleet behind a gateway under Pulumi mocks: waves, drain and enable gates, the gateway's
files, and what a change drains."""

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pulumi
import pytest
import yaml

from components import config, fleet as fleet_shape, gateway, gateway_render, ingress
from components.fleet import Fleet
from components.gateway_render import FLEET_PROBE_KEY_NAME, FLEET_TLS_NAME, _loopback, member_listens
from tests.helpers import TINY_CONFIG, raw_config

NODES = {"n1": {"address": "203.0.113.10"}, "n2": {"address": "203.0.113.11"}, "n3": {"address": "203.0.113.12"}}
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
OWN = {"host": "198.51.100.20", "hostKey": HOST_KEY}
"""A gateway on its own machine."""


def rotation(*nodes: str, of=NODES) -> dict:
    """The gateway's rotation read of the stack's nodes `of` as rotation.sh prints it on a host
    with `nodes` in rotation."""
    return {"stdout": "".join(f"out of rotation: {n}\n" for n in of if n not in nodes)}


@pytest.fixture(autouse=True)
def all_in_rotation(recorder):
    """Unless a test says otherwise, the gateway has every node in rotation."""
    recorder.mocks.outputs[f"{gateway.GATEWAY}-rotation"] = rotation(*NODES)


def fleet_cfg(**sections):
    fleet = dict(nodes=NODES, gateway={"host": "n1"}, ingress={"httpsPort": 8443, "httpPort": 8080},
                 rollout={"maxUnavailable": 2})
    return config.parse(*raw_config(**{**fleet, **sections}))


def deps_by_name(recorder):
    name_of = {r["urn"]: r["name"] for r in recorder.registrations}
    return {(r["name"], r["type"]): {name_of.get(u, u) for u in r["deps"]} for r in recorder.registrations}


def deps(table, name, type_=None):
    hits = [d for (n, t), d in table.items() if n == name and (type_ is None or t == type_)]
    assert len(hits) == 1, (name, [k for k in table if k[0] == name])
    return hits[0]


def with_gates(f, *outputs):
    """The fleet's rollout gates, resolved ((name, kind) -> the names each waits for), once
    `outputs` are: the gates are held by the program, never recorded as dependencies."""
    keys = list(f.gates)
    return pulumi.Output.all(*outputs, *f.gates.values()).apply(lambda v: dict(zip(keys, v[len(outputs):])))


def registered_before(recorder, first, then):
    order = [r["name"] for r in recorder.registrations]
    return order.index(first) < order.index(then)


def test_waves_put_the_canary_alone_then_max_unavailable_at_a_time():
    assert gateway.waves(["a", "b", "c", "d", "e"], 2) == [["a"], ["b", "c"], ["d", "e"]]
    assert gateway.waves(["a", "b", "c"], 1) == [["a"], ["b"], ["c"]]
    assert gateway.waves(["a"], 3) == [["a"]]


@pulumi.runtime.test
def test_a_roll_drains_checks_and_enables_each_node_wave_after_wave(recorder):
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg()))

    def check(gates):
        t = deps_by_name(recorder)
        # the canary's engine waits for its drain; its enable for its own SLA check
        assert "n1-drain" in deps(t, "n1-runtime", "fimfleet:runtime:VllmRuntime")
        assert "n1-sla" in deps(t, "n1-enable")
        # and every run of its drain (the drain's output is in its trigger): a drain whose script
        # alone changed, or a config rolled back after a failed check, left the node drained
        assert all(f"{n}-drain" in deps(t, f"{n}-enable") for n in NODES)
        # and, for destroy, after the gateway host's nginx step (whose lock its drain takes)
        assert all("n1-nginx" in deps(t, f"{n}-enable") for n in NODES)
        # the second wave (n2, n3 together) waits for the canary's enable, not for each other
        for n in ("n2", "n3"):
            assert gates[(n, "drain")] == gates[(n, "node")] == {"n1-enable"}, gates
            assert gates[(n, "host")] == {f"{n}-drain"}  # its host retunes once it is out of rotation
            assert registered_before(recorder, "n1-enable", f"{n}-drain")
            # ... an order held by the program only: no node depends on another in the state, so
            # `destroy` takes them down side by side (and `destroy --target` takes one)
            for name, type_ in ((f"{n}-drain", None), (n, "fimfleet:node:NodeService"), (n, "fimfleet:host:HostBase")):
                assert not {"n1-enable", "n1-sla", "n1"} & deps(t, name, type_), (name, deps(t, name, type_))
        # the gateway's host is set up first, ungated: every drain runs there
        assert not deps(t, "n1", "fimfleet:host:HostBase") and gates[("n1", "host")] == set()
        # the fleet's check runs through the gateway after every node is back
        assert {"n2-enable", "n3-enable", "gateway-ingress-nginx"} <= deps(t, "fleet-sla")
        # and after every node's Prometheus and node_exporter steps, which would load the node it measures
        monitoring = {r["name"] for r in recorder.registrations
                      if r["type"] == "pulumi-python:dynamic:Resource" and "-monitoring-" in r["name"]}
        assert {f"{n}-monitoring-exporter" for n in NODES} <= monitoring <= deps(t, "fleet-sla"), monitoring
        sla = [r for r in recorder.registrations if r["name"] == "fleet-sla"][0]["inputs"]
        n1 = [r for r in recorder.registrations if r["name"] == "n1-sla"][0]["inputs"]
        assert sla["concurrency"] == 3 * n1["concurrency"]

    return with_gates(f, f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


@pulumi.runtime.test
def test_the_gateway_trusts_the_nodes_cas_and_each_node_certificate_names_the_fleet(recorder):
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg()))

    def check(_):
        regs = {r["name"]: r["inputs"] for r in recorder.registrations}
        for n in NODES:
            assert FLEET_TLS_NAME in regs[f"{n}-ingress-cert"]["dnsNames"]
        staged = regs["gateway-ingress-nginx"]["files"]
        staged = staged["value"] if isinstance(staged, dict) else staged  # a secret input arrives wrapped
        files = {x["path"].rsplit("/", 1)[-1]: x for x in staged}
        assert files["nodes-ca.pem"]["content"] == "CA\nCA\nCA\n"
        assert files["servers.sh"]["mode"] == "0755"
        site = files["gateway.conf"]["content"]
        for n, addr in (("n2", "203.0.113.11"), ("n3", "203.0.113.12")):
            assert f"server {addr}:8443;" in site  # behind the node's member server
        assert "server 127.0.0.1:8443;" in site  # the co-located node, on loopback
        # the upstream's servers are the member servers, one per node, each named for the drain
        for n, listen in member_listens(NODES).items():
            assert f"listen {listen};" in site and f"enabled/{n})" in site
            assert f"{n} {listen}" in files["servers.sh"]["content"]
        assert "hash $fimfleet_gateway_key_name consistent" in site  # each key on its node
        # the fleet probe's requests: the node with the fewest open streams, over the same members
        assert re.search(r"map \$fimfleet_gateway_key_name \$fimfleet_gateway_pool \{\s+"
                         rf"{FLEET_PROBE_KEY_NAME} fimfleet_gateway_vllm_spread;\s+default fimfleet_gateway_vllm;", site), site
        # ... counted across the gateway's workers (each has its own count without a zone)
        assert re.search(r"upstream fimfleet_gateway_vllm_spread \{\s+least_conn;\s+#[^\n]*\n\s+"
                         r"zone fimfleet_gateway_vllm_spread \d+k;\s+include \S+servers;", site), site
        assert "proxy_pass http://$fimfleet_gateway_pool;" in site
        assert f"proxy_ssl_name {FLEET_TLS_NAME}" in files["gateway.conf"]["content"]

    return pulumi.Output.all(f.gateway.step.id, f.gateway.endpoint).apply(check)


@pulumi.runtime.test
def test_without_a_gateway_each_node_waits_for_the_ones_sla_before_it_and_depends_on_none(recorder):
    f = Fleet("fleet", fleet_shape.args_for(config.parse(*raw_config(nodes=NODES))))

    def check(gates):
        t = deps_by_name(recorder)
        assert gates[("n1", "host")] == gates[("n1", "node")] == set()
        for n, before in (("n2", "n1-sla"), ("n3", "n2-sla")):
            assert gates[(n, "host")] == gates[(n, "node")] == {before}, gates
            assert registered_before(recorder, before, f"{n}-host-preflight")
            for type_ in ("fimfleet:node:NodeService", "fimfleet:host:HostBase"):
                assert not {"n1-sla", "n2-sla", "n1", "n2"} & deps(t, n, type_), (n, deps(t, n, type_))

    return with_gates(f, *[svc.sla.id for svc in f.nodes.values()]).apply(check)


@pulumi.runtime.test
def test_a_single_node_stack_has_no_gateway_parts(recorder):
    raw, secret = raw_config()
    f = Fleet("fleet", fleet_shape.args_for(config.parse(raw, secret)))

    def check(_):
        names = {r["name"] for r in recorder.registrations}
        assert not {n for n in names if n.endswith(("-drain", "-enable")) or n.startswith(("gateway", "fleet-"))}
        cert = [r for r in recorder.registrations if r["name"] == "node-ingress-cert"][0]["inputs"]
        assert FLEET_TLS_NAME not in cert["dnsNames"]  # an existing node's certificate is not reissued

    return f.nodes["node"].sla.id.apply(check)


@pytest.mark.parametrize("change, drains", [
    ({"engine": {"maxNumSeqs": 4}}, True),
    ({"kernel": {"sysctl": {"vm.swappiness": "7"}}}, True),
    ({"ingress": {"httpsPort": 8443, "httpPort": 8080, "ratePerSecond": 20}}, False),
    ({"monitor": {"intervalS": 30}}, False),
])
def test_only_what_restarts_the_engine_or_retunes_the_host_drains_a_node(change, drains):
    def digest(cfg):
        shape = fleet_shape.args_for(cfg)
        n, h = shape.nodes["n2"], shape.hosts["n2"]
        return gateway.rollout_digest(n.runtime, h.kernel, h.host.packages)

    assert (digest(fleet_cfg(**change)) != digest(fleet_cfg())) is drains


@pytest.mark.parametrize("gw, ingress, key, word", [
    ({"host": "n9"}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.host", "must name a node"),
    ({"host": "n1"}, {}, "ingress.httpsPort", "ingress.httpsPort: 8443"),
    ({"host": "n1", "httpPort": 443}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.httpPort", "differ"),
    # on its own machine: an address (a dotted name or an IP), reached over SSH like a node
    ({"host": "gw"}, {}, "gateway.host", "own machine's address"),
    ({"host": "203.0.113.11"}, {}, "gateway.host", "gateway.host: n2"),
    ({"host": "gw.example.com;reboot"}, {}, "gateway.host", "DNS name"),
    ({"host": "198.51.100.20", "hostKey": "ssh-ed25519"}, {}, "gateway.hostKey", "ssh-"),
    ({"host": "n1", "hostKey": HOST_KEY}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.hostKey", "remove it"),
    # the member servers' port: free on the gateway's host (its nginx listens, its sshd too)
    ({"host": "n1", "memberPort": 8443}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.memberPort", "ingress.httpsPort"),
    ({"host": "n1", "memberPort": 443}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.memberPort", "e.g. 17443"),
    ({"host": "n1", "memberPort": 22}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.memberPort", "SSH"),
    ({**OWN, "httpsPort": 17443, "memberPort": 17443}, {}, "gateway.memberPort", "e.g. 17444"),
    ({"host": "n1", "memberPort": 0}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.memberPort", "between 1 and"),
    ({"host": "n1", "memberPort": "17443;id"}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.memberPort", "whole number"),
    # the gateway verifies each node by fimfleet's own CA: nothing to trust with ACME or a provided certificate
    ({"host": "n1"}, {"httpsPort": 8443, "httpPort": 8080, "tls": "acme", "domain": "code.example.com",
                      "acmeEmail": "ops@example.com"}, "ingress.tls", "self-signed"),
    (OWN, {"tls": "provided"}, "ingress.tls", "self-signed"),
    # its nginx beside the node's sshd, engine and Prometheus, or its own machine's sshd
    ({"host": "n1", "httpsPort": 8000}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.httpsPort", "the engine"),
    ({"host": "n1", "httpsPort": 22}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.httpsPort", "sshd"),
    ({"host": "n1", "httpPort": 9090}, {"httpsPort": 8443, "httpPort": 8080}, "gateway.httpPort", "Prometheus"),
    ({**OWN, "httpsPort": 22}, {}, "gateway.httpsPort", "gateway.host's sshd"),
])
def test_bad_gateways_name_key_value_and_fix(gw, ingress, key, word):
    raw, secret = raw_config(nodes=NODES, gateway=gw, ingress=ingress)
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    found = {p.key: p.fix for p in err.value.problems}
    assert key in found and word in found[key], found


def test_the_fleets_check_through_the_gateway_must_fit_its_connection_limit():
    """The fleet's SLA check runs sla.concurrency streams per node from one address through the
    gateway, whose site has ingress.maxConnsPerAddress: 3 x 4 streams against 8 got 429s."""
    sections = dict(nodes=NODES, sla={"concurrency": 4}, ingress={"maxConnsPerAddress": 8})
    raw, secret = raw_config(gateway=OWN, **sections)
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    found = {p.key: p.fix for p in err.value.problems}
    assert "3 nodes behind the gateway (12 streams" in found["sla.concurrency"], found
    config.parse(*raw_config(**sections))  # without a gateway each node's check runs 4 streams: they fit
    config.parse(*raw_config(gateway=OWN, **{**sections, "ingress": {"maxConnsPerAddress": 12}}))


def test_every_step_that_changes_a_hosts_nginx_holds_the_same_lock():
    """The node's site, the host's main config and the gateway's rotation share one nginx: each
    `nginx -t` must see the others' files whole, so each step holds nginx_base.LOCK."""
    import shlex

    from components import ingress as ingress_mod
    from components import nginx_base
    from components.gateway_render import member_script

    shape = fleet_shape.args_for(fleet_cfg())
    gw = shape.gateway
    base = nginx_base.render(nginx_base.NginxBase())
    scripts = {"host nginx apply": base.apply, "host nginx destroy": base.destroy}
    for name, a in (("node", shape.nodes["n1"].ingress), ("gateway", gw.ingress)):
        _, installs = ingress_mod.render_files(a, "203.0.113.10", "<cert>", "<key>", nginx=nginx_base.NginxBase(),
                                               upstream_ca_pem="CA")
        sh = ingress_mod.step_scripts(a, installs, "203.0.113.10", nginx_base.NginxBase())
        scripts.update({f"{name} apply": sh["apply"], f"{name} destroy": sh["destroy"]})
    for enabled in (True, False):
        scripts[f"member {enabled}"] = member_script("n2", enabled, nginx_base.NginxBase(), gw.ingress.fleet.paths)
    lock = shlex.quote(nginx_base.LOCK)
    for what, text in scripts.items():
        assert f"exec 8>{lock}" in text or f"lock={lock}" in text, f"{what} does not take {nginx_base.LOCK}"
        assert "flock" in text, what


def test_a_gateway_on_its_own_machine_is_a_host_without_an_engine():
    cfg = fleet_cfg(gateway=OWN, ingress={})  # its own host: the nodes keep the default ports
    assert cfg.gateway_host.address == "198.51.100.20" and cfg.gateway_host.host_key == HOST_KEY
    shape = fleet_shape.args_for(cfg)
    gw_host = shape.hosts[gateway.GATEWAY].host
    assert shape.gateway.host == gateway.GATEWAY and list(shape.nodes) == list(NODES)
    assert (gw_host.configured_address, gw_host.host_key) == ("198.51.100.20", HOST_KEY)
    assert gw_host.connection["user"] == shape.hosts["n1"].host.connection["user"]  # host.* is shared
    # nginx and the tools its scripts use; no engine, so no tier hardware in its preflight
    assert "nginx" in gw_host.packages and not {"python3-venv", "numactl", "libjemalloc2"} & set(gw_host.packages)
    assert "min_memory_gib=1\n" in gw_host.preflight and "want_numa=0\n" in gw_host.preflight
    assert "required_flags=()" in gw_host.preflight
    assert "want_numa=1\n" in shape.hosts["n1"].host.preflight
    # every node is reached at its address, none on the gateway's loopback
    members = {m.name: m.address for m in shape.gateway.ingress.fleet.members}
    assert members == {n: e["address"] for n, e in NODES.items()}


def test_a_hosts_preflight_without_an_engine_accepts_any_numa_layout(tmp_path):
    """The rendered check on a fake two-NUMA-node host: a node's preflight wants the tier's
    layout, the gateway's takes what it finds."""
    import os
    import subprocess

    shape = fleet_shape.args_for(fleet_cfg(gateway=OWN, ingress={}))
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc).mkdir()
    (proc / "cpuinfo").write_text("processor : 0\nflags : fpu sse2\nprocessor : 1\n")
    (proc / "meminfo").write_text("MemTotal: 2097152 kB\n")
    (proc / "stat").write_text("cpu 1 0 1 100 0 0 0 0 0 0\n")
    for n in (0, 1):
        (sys_ / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    env = {**os.environ, "FIMFLEET_PREFLIGHT_PROC": str(proc), "FIMFLEET_PREFLIGHT_SYS": str(sys_),
           "FIMFLEET_PREFLIGHT_STEAL_S": "0"}

    def run(preflight):
        return subprocess.run(["bash", "-c", preflight], env=env, capture_output=True, text=True, timeout=30)

    ok = run(shape.hosts[gateway.GATEWAY].host.preflight)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = run(shape.hosts["n1"].host.preflight)
    assert refused.returncode != 0 and "NUMA" in refused.stdout + refused.stderr


@pytest.mark.parametrize("own", [True, False])
@pulumi.runtime.test
def test_drains_run_on_the_gateways_host_which_is_set_up_first_and_ungated(recorder, own):
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg(gateway=OWN if own else {"host": "n1"},
                                                      **({"ingress": {}} if own else {}))))
    gw_host = gateway.GATEWAY if own else "n1"

    def check(gates):
        t = deps_by_name(recorder)
        assert not deps(t, gw_host, "fimfleet:host:HostBase") and gates[(gw_host, "host")] == set()
        assert bool([k for k in t if k == (gateway.GATEWAY, "fimfleet:host:HostBase")]) is own
        regs = {r["name"]: r for r in recorder.registrations}
        for n in NODES:
            conn = regs[f"{n}-drain"]["inputs"]["connection"]
            conn = conn["value"] if isinstance(conn, dict) and "value" in conn else conn
            assert conn["host"] == ("198.51.100.20" if own else "203.0.113.10"), (n, conn["host"])
        assert gates[("n2", "drain")] == {"n1-enable"}

    return with_gates(f, f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


@pytest.mark.parametrize("deployed, live, n3_waits_for", [
    (["n1", "n2", "n3"], NODES, "n2-enable"),  # a roll: n3 serves, so it waits for the wave before it
    ([], [], "n1-enable"),                     # a fresh fleet: the canary, then all the others at once
    (["n1", "n2"], ["n1", "n2"], "n1-enable"),  # n3 is new: it serves nobody yet, so only the canary gates it
    # n3 was enabled by an `up` that failed later, so never exported: in rotation, it serves
    (["n1", "n2"], NODES, "n2-enable"),
    (None, NODES, "n2-enable"),                # unknown: every node waits for its wave
])
@pulumi.runtime.test
def test_a_node_the_last_up_did_not_deploy_waits_only_for_the_canary(recorder, deployed, live, n3_waits_for):
    """n3 is in the third wave (maxUnavailable 1)."""
    recorder.mocks.outputs[f"{gateway.GATEWAY}-rotation"] = rotation(*live)
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg(rollout={"maxUnavailable": 1})), deployed=deployed)

    def check(gates):
        t = deps_by_name(recorder)
        assert gates[("n2", "drain")] == {"n1-enable"}  # the second wave always follows the canary
        for kind in ("drain", "node"):
            assert gates[("n3", kind)] == {n3_waits_for}, (kind, gates[("n3", kind)])
        assert registered_before(recorder, n3_waits_for, "n3-drain")
        # a new node's host is set up beside the canary; a serving node's host once it is drained
        new = n3_waits_for == "n1-enable"
        assert gates[("n3", "host")] == (set() if new else {"n3-drain"}), gates[("n3", "host")]
        if deployed == []:  # the second wave too
            assert gates[("n2", "host")] == set()
        assert {"n1-enable", "n2-enable", "n3-enable"} <= deps(t, "fleet-sla")
        assert (f"{gateway.GATEWAY}-rotation" in {r["name"] for r in recorder.registrations}) is (deployed is not None)

    return with_gates(f, f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


@pytest.mark.parametrize("stranded", [["n3"], ["n2", "n3"], ["n1"]])
@pulumi.runtime.test
def test_nodes_a_failed_up_left_drained_roll_first_and_the_serving_ones_wait_for_them(recorder, stranded):
    """n3 failed its check in an `up` that failed: drained, and not enabled again. The next roll
    drained the canary too, and nothing was in rotation for its restart. The nodes out of
    rotation roll first, without a gate; every serving node waits for their enables."""
    recorder.mocks.outputs[f"{gateway.GATEWAY}-rotation"] = rotation(*[n for n in NODES if n not in stranded])
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg(rollout={"maxUnavailable": 1})), deployed=list(NODES))
    enables = {f"{n}-enable" for n in stranded}
    normal = {"n1": set(), "n2": {"n1-enable"}, "n3": {"n2-enable"}}

    def check(gates):
        for n in NODES:
            for kind in ("drain", "node"):
                want = set() if n in stranded else normal[n] | enables
                assert gates[(n, kind)] == want, (n, kind, gates[(n, kind)])
            # a serving host retunes once its node is drained; n1's is the gateway's, set up first
            want = set() if n in stranded or n == "n1" else {f"{n}-drain"}
            assert gates[(n, "host")] == want, (n, gates[(n, "host")])
        regs = {r["name"]: r for r in recorder.registrations}
        read = regs[f"{gateway.GATEWAY}-rotation"]["inputs"]
        assert read["connection"] == regs["n1-drain"]["inputs"]["connection"]  # the gateway's host
        assert [t.split()[0] for t in read["triggers"]] == list(NODES)

    return with_gates(f, f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


def test_the_rotation_read_names_each_node_out_of_rotation_and_nothing_else(tmp_path):
    paths = gateway_render.GatewayPaths(servers=str(tmp_path / "servers"), state_dir=str(tmp_path / "gw"))
    script = gateway_render.rotation_script(paths, ["n1", "n-3", "n4"])

    def read() -> set[str]:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, check=True,
                             timeout=30).stdout
        return gateway_render.out_of_rotation(out)

    assert read() == {"n1", "n-3", "n4"}  # no rotation yet: a fleet never deployed
    Path(paths.enabled_dir).mkdir(parents=True)
    for n in ("n1", "n-3", "removed"):
        (Path(paths.enabled_dir) / n).touch()
    (Path(paths.enabled_dir) / "n4").mkdir()  # not a marker: the member servers test for a file
    assert read() == {"n4"}
    assert gateway_render.out_of_rotation(None) == set()
    assert gateway_render.out_of_rotation("x\nout of rotation: a\n") == {"a"}
    with pytest.raises(ValueError, match="rotation_script.nodes"):
        gateway_render.rotation_script(paths, ["n1; reboot"])


@pytest.mark.parametrize("deployed, live, stranded", [
    (["n1", "n2", "n3", "n4"], ["n1", "n2"], ["n3"]),  # n4 left the stack after its failed check
    (["n1", "n2", "n3"], [], []),  # none in rotation (the gateway's host wiped): the canary goes first
])
@pulumi.runtime.test
def test_the_order_reads_only_the_stacks_own_nodes_and_keeps_the_canary_when_none_serves(recorder, deployed, live,
                                                                                      stranded):
    """A node removed from the stack after a failed `up` was still in the last export: waiting for
    its enable failed every gate (KeyError). With no node in rotation, every deployed node rolled
    at once: availability no worse, but a bad change reached them all."""
    recorder.mocks.outputs[f"{gateway.GATEWAY}-rotation"] = rotation(*live)
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg(rollout={"maxUnavailable": 1})), deployed=deployed)

    def check(gates):
        if stranded:
            assert gates[("n3", "drain")] == set() and gates[("n1", "drain")] == {"n3-enable"}
        else:
            assert gates[("n2", "drain")] == gates[("n3", "drain")] == {"n1-enable"}
        regs = {r["name"]: r["inputs"] for r in recorder.registrations}
        for n in NODES:  # a stranded node's enable runs even if nothing else of it changed
            assert ("stranded" in regs[f"{n}-enable"]["triggers"]) is (n in stranded), (n, regs[f"{n}-enable"]["triggers"])

    return with_gates(f, f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


@pulumi.runtime.test
def test_the_rotation_is_read_again_whenever_a_drain_or_enable_may_run(recorder):
    """A new drain timeout runs every drain and enable with the same rollout trigger. Read
    before the roll before it, the rotation could call a node stranded that serves, or the reverse."""
    args = fleet_shape.args_for(fleet_cfg())
    f = Fleet("fleet", args, deployed=list(NODES))
    gw, nginx = args.gateway, f.hosts["n1"].nginx_settings
    longer = dataclasses.replace(gw, drain_timeout_s=gw.drain_timeout_s + 30)
    trigger = "a rollout trigger"
    assert gateway.member_key("n2", gw, nginx, trigger) != gateway.member_key("n2", longer, nginx, trigger)
    assert gateway.member_key("n2", gw, nginx, trigger) != gateway.member_key("n2", gw, nginx, "another")

    def check(_):
        read = next(r["inputs"] for r in recorder.registrations if r["name"] == f"{gateway.GATEWAY}-rotation")
        drains = {r["name"]: r["inputs"] for r in recorder.registrations if r["name"].endswith("-drain")}
        assert read["triggers"] == [f"{n} {gateway.member_key(n, gw, nginx, drains[f'{n}-drain']['triggers'][0])}"
                                    for n in NODES]

    return pulumi.Output.all(*[e.id for e in f.enables.values()]).apply(check)


def test_member_addresses_follow_the_node_names_so_a_removed_node_moves_no_other_key():
    names = [f"node-{i}" for i in range(40)]
    full = member_listens(names)
    assert len(set(full.values())) == len(names)
    for addr in full.values():
        octets = [int(o) for o in addr.rsplit(":", 1)[0].split(".")]
        assert octets[0] == 127 and octets[1] != 0 and addr.endswith(":17443")  # off 127.0.0.x
    without = member_listens(names[:5] + names[6:])  # a middle node removed
    assert all(without[n] == full[n] for n in without)
    assert member_listens(list(reversed(names))) == full  # the stack's order does not matter


def test_two_names_on_one_address_get_two_whatever_their_order():
    seen: dict[str, str] = {}
    for i in range(200_000):  # about 4,100 names in 16.5 million addresses: a clash is near certain
        name, addr = f"n{i}", _loopback(f"n{i}", 0)
        if addr in seen:
            clash = [seen[addr], name]
            break
        seen[addr] = name
    else:
        pytest.fail("no two names shared an address")
    one, other = member_listens(clash), member_listens(list(reversed(clash)))
    assert one == other and len(set(one.values())) == 2
    assert one[min(clash)] == f"{addr}:17443"  # the first in sorted order keeps its own


def test_the_member_port_reaches_every_member_server_and_the_drain():
    """gateway.memberPort moves the member servers (a host whose 17443 is taken): the gateway's
    site listens there, and the servers file that the drain reads names the same addresses."""
    from components.gateway_render import servers_script

    gw = fleet_shape.args_for(fleet_cfg(gateway={"host": "n1", "memberPort": 27001})).gateway
    fleet = gw.ingress.fleet
    assert fleet.member_port == 27001 and all(a.endswith(":27001") for a in fleet.listens.values())
    staged, _ = ingress.render_files(gw.ingress, "203.0.113.10", "<cert>", "<key>")
    site = "".join(f["content"] for f in staged)
    assert all(f"listen {a}" in site for a in fleet.listens.values()) and "17443" not in site
    assert all(a in servers_script(fleet) for a in fleet.listens.values())


@pytest.mark.parametrize("gw, state", [({"host": "n1"}, "in rotation"), ({}, "serving")])
@pulumi.runtime.test
def test_each_node_reports_its_state_once_its_last_step_ran(recorder, gw, state):
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg(gateway=gw)))
    assert set(f.states) == set(NODES)
    return pulumi.Output.all(*f.states.values()).apply(lambda got: assert_all(got, state))


def assert_all(got, want):
    assert got == [want] * len(NODES), got


def local_fleet_cfg(tmp_path, forwards: dict[str, int]):
    """Two test-VM nodes behind a gateway beside the first (stacks/Pulumi.local-fleet.yaml's shape)."""
    vms = {}
    for name, port in (("node", 41001), ("node2", 41002)):
        state = tmp_path / name
        state.mkdir()
        (state / "info.json").write_text(json.dumps({"ports": {"22": port, **forwards}}))
        vms[name] = {"testbedState": str(state)}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    raw, secret = raw_config("local-vm", nodes=vms, host={"kind": "local-vm"}, model={"source": "local", "localPath": str(model)},
                             gateway={"host": "node", "httpsPort": 8443, "httpPort": 8080})
    return config.parse(raw, secret)


def test_the_gateway_reaches_another_test_vm_through_the_port_forwarded_to_its_ingress(tmp_path):
    members = {m.name: m for m in gateway.args_for(local_fleet_cfg(tmp_path, {"443": 40443})).ingress.fleet.members}
    assert (members["node"].address, members["node"].port) == ("127.0.0.1", 443)  # beside it: loopback
    assert (members["node2"].address, members["node2"].port) == (gateway.TESTBED_HOST, 40443)


def test_a_test_vm_without_a_forward_to_its_ingress_is_a_config_error_naming_its_state(tmp_path):
    with pytest.raises(config.ConfigError) as e:
        gateway.args_for(local_fleet_cfg(tmp_path, {"8443": 40843}))
    assert "fimfleet:nodes.node2.testbedState" in str(e.value) and "--forward 443" in str(e.value)


def test_cloud_nodes_behind_a_gateway_are_still_refused_by_name():
    raw, secret = raw_config(nodes={"n1": {"address": "203.0.113.10"}, "n2": {}}, gateway={"host": "n1"},
                             ingress={"httpsPort": 8443, "httpPort": 8080})
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, secret)
    assert "fimfleet:nodes.n2.address" in str(e.value) and "cloud nodes" in str(e.value)


def test_the_local_fleet_is_the_local_stacks_node_twice():
    """stacks/Pulumi.local-fleet.yaml repeats the local stack's settings (a stack file includes no
    other): any drift would leave the fleet's canary unable to adopt the local serving snapshot's
    engine, and the fleet no longer the tested single node twice."""
    stacks = Path(__file__).resolve().parents[2] / "stacks"
    one, fleet = (yaml.safe_load((stacks / f"Pulumi.{s}.yaml").read_text())["config"] for s in ("local", "local-fleet"))
    own = {"fimfleet:nodes", "fimfleet:gateway"}
    assert {k: v for k, v in fleet.items() if k not in own} == one
    assert list(fleet["fimfleet:nodes"]) == ["node", "node2"] and fleet["fimfleet:gateway"]["host"] == "node"


@pytest.mark.parametrize("max_unavailable, tries", [(1, 2), (2, 3), (5, 3)])
def test_a_request_may_try_one_node_more_than_a_roll_drains_at_once(max_unavailable, tries):
    fleet = gateway.args_for(fleet_cfg(rollout={"maxUnavailable": max_unavailable})).ingress.fleet
    assert fleet.tries == tries  # capped at the three nodes


def test_servers_runs_killed_before_their_rename_leave_one_file_that_the_gateways_destroy_removes(tmp_path):
    """mktemp's file per killed run stayed in /etc/nginx/fimfleet.d after destroy (and kept the
    directory from going): the generator now writes one fixed name beside the servers file."""
    import dataclasses

    from components.gateway_render import servers_script

    gw = fleet_shape.args_for(fleet_cfg(gateway={"host": "n1"})).gateway
    fleet = gw.ingress.fleet
    out = tmp_path / "gateway.servers"
    fleet = dataclasses.replace(fleet, paths=dataclasses.replace(fleet.paths, servers=str(out)))
    script = servers_script(fleet).replace('mv -f "$tmp" "$out"', 'kill -9 $$')
    for _ in range(2):
        assert subprocess.run(["bash", "-c", script], timeout=30).returncode == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gateway.servers.fimfleet-tmp"]
    subprocess.run(["bash", "-c", servers_script(fleet)], check=True, timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gateway.servers"]
    _, installs = ingress.render_files(gw.ingress, "203.0.113.10", "<cert>", "<key>")
    destroy = ingress.step_scripts(gw.ingress, installs)["destroy"]
    assert f"{gw.ingress.fleet.paths.servers}.fimfleet-tmp" in destroy
