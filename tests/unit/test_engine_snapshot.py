"""The serving snapshots (scripts/engine_snapshot.py): one per node name and image variant, so a
fleet's VMs each adopt their own engine, building one never deletes another node's, and two
that are both missing build at once."""

from __future__ import annotations

import json
import threading

import yaml

from components import config
from scripts import engine_snapshot, local_fleet
from scripts import local_deploy as ld
from tests.e2e import local_stack
from tests.helpers import TINY_CONFIG, raw_config, set_path


def saved(root, name, variant, node) -> None:
    d = root / name
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"variant": variant, "label": {"engine": f"vllm-{node}.service"}}))


def test_a_new_snapshot_replaces_only_the_same_nodes_older_one(tmp_path):
    for name, variant, node in (("old-node", "vllm", "node"), ("node2", "vllm", "node2"),
                                ("docker", "docker-engine", "node"), ("new-node", "vllm", "node")):
        saved(tmp_path, name, variant, node)
    (tmp_path / "broken").mkdir()  # no manifest: a build that died
    engine_snapshot.prune(tmp_path, tmp_path / "new-node", "vllm", "node")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docker", "new-node", "node2"]


def test_each_node_gets_a_snapshot_of_its_own_engine(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    cfg = config.parse(*raw_config("local-vm", host={"kind": "local-vm", "testbedState": str(tmp_path)},
                                   model={"source": "local", "localPath": str(model)}))
    one, two = engine_snapshot._steps(cfg, "node"), engine_snapshot._steps(cfg, "node2")
    assert [f["path"] for f in two["files"]][0] == "/etc/systemd/system/vllm-node2.service"
    base = {"dir": "/snap", "created_at": 1}
    assert engine_snapshot.snapshot_key(base, one) != engine_snapshot.snapshot_key(base, two)
    assert engine_snapshot.snapshot_key(base, one) == engine_snapshot.snapshot_key(base, engine_snapshot._steps(cfg, "node"))


def test_a_fleets_two_serving_snapshots_build_at_once(tmp_path, monkeypatch):
    """Each emulated engine start keeps one host core busy, so the fleet's two snapshots build
    side by side: one after the other, the barrier below would time out."""
    both = threading.Barrier(len(local_fleet.NODES), timeout=10)
    built, restored = [], []

    def serving_snapshot(config_file, wheelhouse, variant="vllm", node="node"):
        both.wait()
        built.append(node)
        return tmp_path / node

    monkeypatch.setattr(ld, "stack_config", lambda config_file, *a, **kw: config_file)
    monkeypatch.setattr(ld, "serving_snapshot", serving_snapshot)
    monkeypatch.setattr(ld, "start_vm", lambda state, wheelhouse, **kw: restored.append(kw["node"]))
    local_fleet.start(tmp_path, tmp_path / "Pulumi.local-fleet.yaml", {"model_dir": "m", "wheelhouse": "w"},
                      serving=True)
    assert sorted(built) == sorted(local_fleet.NODES) and restored == list(local_fleet.NODES)


def local_stack_file(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    doc = yaml.safe_load((ld.ROOT / "stacks" / "Pulumi.local.yaml").read_text())
    set_path(doc["config"], "fimfleet:model.localPath", str(model))
    path = tmp_path / "Pulumi.local.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_cached_finds_the_snapshot_that_ensure_would_return(tmp_path):
    """cached() and ensure() agree on where the stack's snapshot is: the local e2e decides by it
    whether the docker e2e's snapshot builds beside its own."""
    config_file, cache = local_stack_file(tmp_path), tmp_path / "cache"

    def vm(*args, state, env=None, **kw):
        return {"dir": "/snap", "created_at": 1}

    assert not engine_snapshot.cached(vm, config_file, cache, {})
    cfg = engine_snapshot.stack_config(config_file, tmp_path / "vm")
    built = cache / "testbed" / "serving" / engine_snapshot.snapshot_key(vm(state=None), engine_snapshot._steps(cfg))
    built.mkdir(parents=True)
    (built / "manifest.json").write_text("{}")
    assert engine_snapshot.cached(vm, config_file, cache, {})
    assert engine_snapshot.ensure(vm, config_file, cache, {}) == built


def test_the_docker_e2es_snapshot_builds_beside_the_local_one(tmp_path, monkeypatch):
    """The local e2e builds its serving snapshot while a thread builds the docker e2e's (one
    after the other, the barrier times out): at once they took 675 s, apart 476 s + 591 s."""
    both = threading.Barrier(2, timeout=10)
    built = {}
    engine = local_stack.DockerEngine(build=type("Build", (), {"REGISTRY": "127.0.0.1:5959", "GUEST_REGISTRY": "10.0.2.2:5959"}),
                                      pushed="127.0.0.1:5959/fimfleet/vllm-cpu@sha256:" + "a" * 64)
    monkeypatch.setattr(local_stack, "docker_engine", lambda: engine)
    monkeypatch.setattr(ld, "stack_config", lambda config_file, state, model_dir, extra=None, stack="local":
                        built.setdefault("config", (stack, extra)) and config_file)

    def serving_snapshot(config_file, wheelhouse, variant="vllm", node="node", variant_env=None):
        both.wait()
        built["snapshot"] = (variant, variant_env)
        return tmp_path / variant

    monkeypatch.setattr(ld, "serving_snapshot", serving_snapshot)
    worker = local_stack.docker_snapshot_beside(tmp_path, {"model_dir": "m", "wheelhouse": "w"})
    both.wait()  # the local stack's own build, in this thread
    worker.join(timeout=10)
    assert built["config"] == ("local-docker", {"fimfleet:runtime.image": "10.0.2.2:5959/fimfleet/vllm-cpu@sha256:" + "a" * 64})
    assert built["snapshot"] == ("docker-engine", {"FIMFLEET_PRELOAD_IMAGE": engine.pushed, "FIMFLEET_PRELOAD_AS": engine.image})


def test_a_failed_build_beside_is_reported_and_left_to_the_docker_e2e(tmp_path, monkeypatch, capsys):
    def refused():
        raise RuntimeError("./fimfleet image push failed: its output is above")

    monkeypatch.setattr(local_stack, "docker_engine", refused)
    worker = local_stack.docker_snapshot_beside(tmp_path, {"model_dir": "m", "wheelhouse": "w"})
    worker.join(timeout=10)
    assert not worker.is_alive()
    err = capsys.readouterr().err
    assert "image push failed" in err and "test_local_docker builds it itself" in err


def test_the_docker_test_vm_runs_the_local_stacks_engine_settings():
    """stacks/Pulumi.local-docker.yaml repeats the local stack's engine section (a stack file
    includes no other): the test-VM settings (plain SSE4.1 paths, the model worker inside the
    EngineCore) must not drift between the two runtimes the e2e compares."""
    stacks = ld.ROOT / "stacks"
    one, docker = (yaml.safe_load((stacks / f"Pulumi.{s}.yaml").read_text())["config"]["fimfleet:engine"]
                   for s in ("local", "local-docker"))
    assert docker == one


def test_a_vm_restores_onto_the_ports_it_is_given_or_its_stopped_predecessors(tmp_path, monkeypatch):
    """tests/e2e/upgrade.py restores its saved VM on the recorded ports (a state that names them
    then needs no update), and a reinstalled host keeps its address (same_ports)."""
    calls = []

    def vm(*args, state, **kw):
        calls.append(args)
        return {"running": False, "variant": "vllm", "ports": {"22": 2201, "443": 8401}} if args[0] == "status" else {}

    monkeypatch.setattr(ld, "vm", vm)
    ld.start_vm(tmp_path / "a", "w", snapshot=tmp_path / "saved", host_ports={"22": 2222, "443": 8443})
    assert calls[-1] == ("restore", "--snapshot", str(tmp_path / "saved"), "--ssh-port", "2222", "--forward", "8443:443")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "info.json").write_text("{}")
    ld.start_vm(tmp_path / "b", "w", snapshot=tmp_path / "saved", same_ports=True)
    assert calls[-1] == ("restore", "--snapshot", str(tmp_path / "saved"), "--ssh-port", "2201", "--forward", "8401:443")
    ld.start_vm(tmp_path / "c", "w")
    assert calls[-1] == ("restore", "--variant", "vllm", "--forward", "443")
