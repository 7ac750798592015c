"""A fleet behind a gateway under Pulumi mocks: waves, drain and enable gates, the gateway's
files, and what a change drains."""

import pulumi
import pytest

from components import config, fleet as fleet_shape, gateway
from components.fleet import Fleet
from components.gateway_render import FLEET_TLS_NAME
from tests.helpers import raw_config

NODES = {"n1": {"address": "203.0.113.10"}, "n2": {"address": "203.0.113.11"}, "n3": {"address": "203.0.113.12"}}


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


def test_waves_put_the_canary_alone_then_max_unavailable_at_a_time():
    assert gateway.waves(["a", "b", "c", "d", "e"], 2) == [["a"], ["b", "c"], ["d", "e"]]
    assert gateway.waves(["a", "b", "c"], 1) == [["a"], ["b"], ["c"]]
    assert gateway.waves(["a"], 3) == [["a"]]


@pulumi.runtime.test
def test_a_roll_drains_checks_and_enables_each_node_wave_after_wave(recorder):
    f = Fleet("fleet", fleet_shape.args_for(fleet_cfg()))

    def check(_):
        t = deps_by_name(recorder)
        # the canary's engine waits for its drain; its enable for its own SLA check
        assert "n1-drain" in deps(t, "n1-runtime", "fimfleet:runtime:VllmRuntime")
        assert "n1-sla" in deps(t, "n1-enable")
        # the second wave (n2, n3 together) waits for the canary's enable, not for each other
        for n in ("n2", "n3"):
            assert "n1-enable" in deps(t, f"{n}-drain")
            assert "n1-enable" in deps(t, n, "fimfleet:host:HostBase")
        assert "n2-enable" not in deps(t, "n3-drain")
        # the gateway's host is set up first, ungated: every drain runs there
        assert not deps(t, "n1", "fimfleet:host:HostBase")
        # the fleet's check runs through the gateway after every node is back
        assert {"n2-enable", "n3-enable", "gateway-ingress-nginx"} <= deps(t, "fleet-sla")
        sla = [r for r in recorder.registrations if r["name"] == "fleet-sla"][0]["inputs"]
        n1 = [r for r in recorder.registrations if r["name"] == "n1-sla"][0]["inputs"]
        assert sla["concurrency"] == 3 * n1["concurrency"]

    return pulumi.Output.all(f.fleet_sla.id, *[e.id for e in f.enables.values()]).apply(check)


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
        for n, addr in (("n2", "203.0.113.11"), ("n3", "203.0.113.12")):
            assert f"{addr}:8443" in files["servers.sh"]["content"]
        assert "127.0.0.1:8443" in files["servers.sh"]["content"]  # the co-located node, on loopback
        assert "hash $fimfleet_gateway_key_name consistent" in files["gateway.conf"]["content"]
        assert f"proxy_ssl_name {FLEET_TLS_NAME}" in files["gateway.conf"]["content"]

    return pulumi.Output.all(f.gateway.step.id, f.gateway.endpoint).apply(check)


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
])
def test_bad_gateways_name_key_value_and_fix(gw, ingress, key, word):
    raw, secret = raw_config(nodes=NODES, gateway=gw, ingress=ingress)
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    found = {p.key: p.fix for p in err.value.problems}
    assert key in found and word in found[key], found


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
