"""The serving snapshots (scripts/engine_snapshot.py): one per node name and image variant, so a
fleet's VMs each adopt their own engine, and building one never deletes another node's."""

from __future__ import annotations

import json

from components import config
from scripts import engine_snapshot
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
