"""The node's resource tree under Pulumi mocks: types, parents, order, secrets."""

import pulumi
import pytest

from components import config
from components import runtime as runtime_mod
from components.fleet import Fleet, args_for
from tests.helpers import API_KEY, raw_config


def build(**sections):
    raw, secret = raw_config(**sections)
    return Fleet("fleet", args_for(config.parse(raw, secret)))


def by_name(recorder):
    """Registrations by name; a HostBase shares its host's name with the node on it, so it is `<name> (host)`."""
    return {f"{r['name']} (host)" if r["type"] == "fimfleet:host:HostBase" else r["name"]: r
            for r in recorder.registrations}


def ancestors(regs, name):
    """Names (by_name's keys) from the parent of `name` up to the fleet; the stack itself is left out."""
    key_of = {r["urn"]: k for k, r in regs.items()}
    out, parent = [], regs[name]["parent"]
    while parent in key_of and regs[key_of[parent]]["type"] != "pulumi:pulumi:Stack":
        out.append(key_of[parent])
        parent = regs[key_of[parent]]["parent"]
    return out


def settle(fleet):
    """Resolves once the last resources of the node (the SLA check, its report to Prometheus)
    have been registered."""
    node = fleet.nodes["node"]
    reported = [step.id for step in node.monitoring.steps] if node.monitoring else []
    return pulumi.Output.all(node.sla.id, node.monitor.step.id, node.ingress.step.id, *reported, node.endpoint)


@pulumi.runtime.test
def test_tree_types_and_parents(recorder):
    fleet = build()

    def check(_):
        regs = by_name(recorder)
        types = {n: r["type"] for n, r in regs.items()}
        assert types["node"] == "fimfleet:node:NodeService"
        assert types["node (host)"] == "fimfleet:host:HostBase"
        assert types["node-host"] == "fimfleet:host:Host"
        assert types["node-kernel"] == "fimfleet:kernel:KernelTuning"
        assert types["node-runtime"] == "fimfleet:runtime:VllmRuntime"
        assert types["node-ingress"] == "fimfleet:ingress:NginxIngress"
        assert types["node-monitor"] == "fimfleet:monitor:Monitor"
        assert types["node-sla"] == "pulumi-python:dynamic/fimfleet:FimSlaCheck"
        for step in ("node-host-preflight", "node-host-packages", "node-kernel-apply", "node-runtime-install",
                     "node-runtime-model", "node-runtime-service", "node-nginx", "node-ingress-nginx",
                     "node-monitor-timer"):
            assert types[step] == "pulumi-python:dynamic:Resource", step
        assert ancestors(regs, "node-kernel-apply") == ["node-kernel", "node (host)", "fleet"]
        assert ancestors(regs, "node-host-packages") == ["node-host", "node (host)", "fleet"]
        # nginx's main config is the host's; the node's site is the node's
        assert ancestors(regs, "node-nginx") == ["node (host)", "fleet"]
        assert ancestors(regs, "node-ingress-nginx") == ["node-ingress", "node", "fleet"]
        assert ancestors(regs, "node-runtime-service") == ["node-runtime", "node", "fleet"]
        assert ancestors(regs, "node-sla") == ["node", "fleet"]

    return settle(fleet).apply(check)


@pulumi.runtime.test
def test_dependency_order(recorder):
    """depends_on a component reaches the engine as that component's resources: check by name."""
    fleet = build()

    def check(_):
        regs = by_name(recorder)
        name_of = {r["urn"]: n for n, r in regs.items()}

        def deps(name):
            return {name_of.get(u, u) for u in regs[name]["deps"]}

        assert "node-host-preflight" in deps("node-host-packages")
        assert "node-host-preflight" in deps("node-kernel")
        assert {"node-host-packages", "node-kernel-apply"} <= deps("node-runtime")
        assert "node-runtime-install" in deps("node-runtime-model")
        assert "node-runtime-model" in deps("node-runtime-unit")
        assert "node-runtime-unit" in deps("node-runtime-service")
        assert "node-host-packages" in deps("node-nginx")
        assert "node-nginx" in deps("node-ingress")
        assert {"node-ingress-nginx", "node-runtime-service"} <= deps("node-monitor")
        assert {"node-monitor-timer", "node-monitoring-exporter", "node-monitoring-prometheus"} <= deps("node-sla")

    return settle(fleet).apply(check)


@pulumi.runtime.test
def test_only_what_needs_the_engine_waits_for_it_and_the_rest_overlaps(recorder):
    """Nothing that needs the engine (monitor, SLA gate, its report to Prometheus) can run before
    its start has finished, and what does not need it (kernel tuning, nginx, Prometheus) does not
    wait for it."""
    fleet = build()

    def check(_):
        regs = by_name(recorder)
        name_of = {r["urn"]: n for n, r in regs.items()}
        children = {}
        for n, r in regs.items():
            children.setdefault(name_of.get(r["parent"]), set()).add(n)

        def descendants(name):
            out = set()
            for c in children.get(name, ()):
                out |= {c} | descendants(c)
            return out

        def closure(name):
            """What `name` waits for: its deps (a component's: all its descendants too), and what its
            parent waits for (a child registers only once its parent has, never before its deps)."""
            waits, todo = set(), [name]
            while todo:
                n = todo.pop()
                parent = name_of.get(regs[n]["parent"])
                direct = [name_of.get(u, u) for u in regs[n]["deps"]]
                for d in [x for x in direct if x in regs]:
                    for w in {d} | descendants(d):
                        if w not in waits:
                            waits.add(w)
                            todo.append(w)
                if parent in regs and parent not in waits:
                    waits.add(parent)
                    todo.append(parent)
            return waits

        for needs_engine in ("node-monitor-timer", "node-sla", "node-monitoring-sla-node"):
            assert "node-runtime-service" in closure(needs_engine), needs_engine
        for independent in ("node-kernel-apply", "node-nginx", "node-ingress-nginx", "node-host-packages",
                            "node-monitoring-exporter", "node-monitoring-prometheus"):
            assert "node-runtime-service" not in closure(independent), independent
        # Prometheus and node_exporter install beside the engine start, after the host's own apt
        # run and the bandwidth probe, and the gate measures only once they are done
        for setup in ("node-monitoring-exporter", "node-monitoring-prometheus"):
            assert {"node-host-packages", "node-runtime-bandwidth"} <= closure(setup), setup
            assert setup in closure("node-sla"), setup
        assert "node-host-packages" not in closure("node-kernel-apply")
        assert "node-kernel-apply" not in closure("node-ingress-nginx")  # nginx overlaps the kernel tuning

    return settle(fleet).apply(check)


@pulumi.runtime.test
def test_secrets_stay_secret(recorder):
    fleet = build()
    node = fleet.nodes["node"]

    def check(_):
        regs = by_name(recorder)
        for name, r in regs.items():
            if "connection" in r["inputs"]:
                assert "connection" in r["secret_fields"], name
        assert "files" in regs["node-ingress-nginx"]["secret_fields"]
        assert "files" in regs["node-monitor-timer"]["secret_fields"]
        assert "api_key" in regs["node-sla"]["secret_fields"] or "apiKey" in regs["node-sla"]["secret_fields"]
        for name, r in regs.items():
            plain = {k: v for k, v in r["inputs"].items() if k not in r["secret_fields"]}
            assert API_KEY not in repr(plain), f"API key in plain inputs of {name}"
            assert "PRIVATE KEY" not in repr(plain), f"SSH key in plain inputs of {name}"

    async def is_secret(out):
        return await out.is_secret()

    def check_outputs(_):
        return pulumi.Output.all(*(pulumi.Output.from_input(is_secret(o)) for o in
                                   [o for outs in node.editor_configs.values() for o in outs.values()]))

    return settle(fleet).apply(check).apply(check_outputs).apply(lambda flags: assert_all(flags))


def assert_all(flags):
    assert all(flags), flags


@pytest.mark.parametrize("stack", ["gpu-l40s", "cpu-epyc-14b-int4"])
def test_other_tiers_build(stack):
    @pulumi.runtime.test
    def run():
        fleet = build(tier=stack)
        return settle(fleet).apply(lambda a: assert_all([a[-1].startswith("https://")]))
    run()


def _inputs_for(**sections):
    """Build a tree and return the inputs of every remote step, by name."""
    from tests.unit.conftest import RECORDER

    RECORDER.registrations.clear()

    @pulumi.runtime.test
    def run():
        return settle(build(**sections))

    run()
    return {r["name"]: r["inputs"] for r in RECORDER.registrations if r["type"].startswith("pulumi-python:dynamic")}


def _changed(a, b):
    skip = {"__provider"}
    return sorted(n for n in a if {k: v for k, v in a[n].items() if k not in skip}
                  != {k: v for k, v in b[n].items() if k not in skip})


def test_changed_value_changes_only_its_resources():
    base = _inputs_for()
    assert _changed(base, _inputs_for(kernel={"sysctl": {"vm.swappiness": "5"}})) == ["node-kernel-apply", "node-sla"]
    # the probe's interval also sets the textfile export's and the stale-probe alert's
    assert _changed(base, _inputs_for(monitor={"intervalS": 30})) == [
        "node-monitor-timer", "node-monitoring-exporter", "node-monitoring-prometheus"]
    assert _changed(base, _inputs_for(monitoring={"retention": "30d"})) == ["node-monitoring-prometheus"]
    assert _changed(base, _inputs_for(engine={"maxNumSeqs": 8})) == [
        "node-runtime-kv-capacity", "node-runtime-service", "node-runtime-unit", "node-sla"]  # what vLLM allocated is read again
    assert _changed(base, _inputs_for(ingress={"ratePerSecond": 5})) == [
        "node-ingress-nginx", "node-sla"]


@pulumi.runtime.test
def test_resources_that_moved_under_hostbase_alias_their_old_urns(recorder):
    """A stack deployed before HostBase existed must upgrade without a replacement: the node's
    component keeps its old type as an alias, and the host's resources their old parent (the
    InferenceNode). Their children inherit these aliases in the engine (the e2e's upgrade test)."""
    fleet = build()

    def check(_):
        regs = by_name(recorder)
        fleet_urn = regs["fleet"]["urn"]
        old_node = fleet_urn.replace("fimfleet:fleet:Fleet::fleet",
                                     "fimfleet:fleet:Fleet$fimfleet:node:InferenceNode::node")
        for moved in ("node-host", "node-kernel"):
            specs = [a.spec for a in regs[moved]["aliases"]]
            assert [s.parentUrn for s in specs] == [old_node], (moved, specs)
        assert [a.spec.type for a in regs["node"]["aliases"]] == ["fimfleet:node:InferenceNode"]
        assert not regs["node (host)"]["aliases"]  # HostBase itself is new

    return settle(fleet).apply(check)


def test_the_watchdog_is_the_hosts_own_step_and_leaves_the_monitor_alone():
    """systemd's watchdog is host-wide: HostBase holds it, only when it is on, and the node's
    monitor step is the same either way (turning it off deletes the step, whose destroy undoes it)."""
    off, on = _inputs_for(), _inputs_for(monitor={"watchdog": True})
    assert "node-watchdog" not in off
    assert _changed(off, on) == [] and set(on) - set(off) == {"node-watchdog"}
    assert [f["path"] for f in on["node-watchdog"]["files"]] == ["/etc/systemd/system.conf.d/90-fimfleet-watchdog.conf"]
    assert "daemon-reexec" in on["node-watchdog"]["apply"] and "daemon-reexec" in on["node-watchdog"]["destroy"]


REGISTRY_TOKEN = "ghp_" + "r3g1stry" * 5


@pytest.mark.parametrize("tier", ["gpu-l40s"])
@pulumi.runtime.test
def test_a_registry_login_reaches_only_the_image_step_and_stays_secret(recorder, tier):
    raw, secret = raw_config(tier, runtime={"image": "ghcr.io/acme/vllm@sha256:" + "a" * 64, "registryUser": "acme-bot"},
                             registryPassword=REGISTRY_TOKEN)
    fleet = Fleet("fleet", args_for(config.parse(raw, secret | {"registryPassword"})))

    def check(_):
        regs = by_name(recorder)
        step = regs["node-runtime-image"]
        assert "files" in step["secret_fields"]
        (login,) = step["inputs"]["files"]["value"]  # a secret: the engine stores it encrypted
        assert login["path"] == "/etc/fimfleet/docker/config.json" and login["mode"] == "0600"
        import base64
        import json

        auth = json.loads(login["content"])["auths"]["ghcr.io"]["auth"]
        assert base64.b64decode(auth).decode() == f"acme-bot:{REGISTRY_TOKEN}"
        for name, r in regs.items():
            plain = {k: v for k, v in r["inputs"].items() if k not in r["secret_fields"]}
            assert REGISTRY_TOKEN not in repr(plain) and auth not in repr(plain), name
            if name != "node-runtime-image":
                assert auth not in repr(r["inputs"]), f"the registry login reached {name}"

    return settle(fleet).apply(check)


HF_TOKEN = "hf_" + "t0ken" * 8


@pytest.mark.parametrize("kind", ["systemd", "docker"])
@pulumi.runtime.test
def test_what_a_failed_first_engine_start_left_is_removed_by_steps_already_in_the_state(recorder, kind):
    """The service step (the engine's start) held the unit's files and the runtime's whole destroy.
    A first start that fails is not recorded, so `pulumi destroy` then left the unit enabled and
    restarting, its env file, the model and the venv or image. Each of those now belongs to a step
    that is in the state before the start is tried, and the start's own step removes nothing."""
    runtime = {"kind": kind} if kind == "systemd" else {"kind": kind, "image": "vllm/vllm-openai-cpu:v0.32.0"}
    fleet = build(runtime=runtime)

    def check(_):
        regs = by_name(recorder)
        name_of = {r["urn"]: n for n, r in regs.items()}
        service, unit = regs["node-runtime-service"], regs["node-runtime-unit"]
        install = regs["node-runtime-install" if kind == "systemd" else "node-runtime-image"]
        assert not service["inputs"].get("destroy") and not service["inputs"].get("files")
        assert "node-runtime-unit" in [name_of.get(u) for u in service["deps"]]
        assert {f["path"] for f in unit["inputs"]["files"]} >= set(runtime_mod.unit_paths("node"))
        assert "disable --now" in unit["inputs"]["destroy"] and "daemon-reload" in unit["inputs"]["destroy"]
        # a unit file removed by hand is drift of this step, which uploads it again before the start reads it
        assert all(path in unit["inputs"]["check"] for path in runtime_mod.unit_paths("node"))
        assert "node-runtime-model" in [name_of.get(u) for u in unit["deps"]]  # destroyed before the model it reads
        assert runtime_mod.STATE_DIR in regs["node-runtime-model"]["inputs"]["destroy"]
        assert ("userdel" if kind == "systemd" else "docker image rm") in install["inputs"]["destroy"]

    return settle(fleet).apply(check)


@pytest.mark.parametrize("kind", ["systemd", "docker"])
@pulumi.runtime.test
def test_a_hugging_face_token_is_stored_only_as_a_secret(recorder, kind):
    """The engine's env file carries HF_TOKEN: the service step's files were a plain input, which
    Pulumi keeps in the state unencrypted (additional_secret_outputs covers outputs only)."""
    runtime = {"kind": kind} if kind == "systemd" else {"kind": kind, "image": "vllm/vllm-openai-cpu:v0.32.0"}
    raw, secret = raw_config("cpu-epyc-prod", runtime=runtime, hfToken=HF_TOKEN)
    fleet = Fleet("fleet", args_for(config.parse(raw, secret | {"hfToken"})))

    def check(_):
        regs = by_name(recorder)
        assert "files" in regs["node-runtime-unit"]["secret_fields"]
        assert HF_TOKEN in repr(regs["node-runtime-unit"]["inputs"]["files"])  # it does reach the engine
        for name, r in regs.items():
            plain = {k: v for k, v in r["inputs"].items() if k not in r["secret_fields"]}
            assert HF_TOKEN not in repr(plain), f"the HF token in plain inputs of {name}"

    return settle(fleet).apply(check)
