"""The serving snapshots (scripts/engine_snapshot.py): one per node name and image variant, so a
fleet's VMs each adopt their own engine, and building one never deletes another node's."""

from __future__ import annotations

import json
import threading

from components import config
from scripts import engine_snapshot, local_fleet
from scripts import local_deploy as ld
from tests.helpers import TINY_CONFIG, raw_config


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
