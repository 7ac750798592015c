#!/usr/bin/env python3
"""A fresh two-node fleet's deploy against a fresh one-node deploy (issue 12 item 7).

In one invocation, one after the other on this machine (three emulated VMs would not fit its
memory at once), each onto VMs restored from the booted snapshot, so every engine starts for
real:
  A. `pulumi up -s local`: one node;
  B. `pulumi up -s local-fleet`: two nodes on two VMs behind a gateway beside the first
     (scripts/local_fleet.py). A fresh fleet deploys the canary alone, then the others at once,
     so two nodes take about two node deploys, and any larger fleet about the same.
B also sends a FIM completion through the gateway with a user's key. Results go to
benchmarks/results/fleet_deploy.json.

    .venv/bin/python benchmarks/fleet_deploy.py     # about 30 minutes under emulation
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from scripts import local_deploy as ld  # noqa: E402
from scripts import local_fleet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "fleet_deploy.json"


def timed_up(config_file: Path, stack: str) -> float:
    t0 = time.monotonic()
    if ld.up(config_file, check=False, stack=stack).returncode:
        raise SystemExit(f"pulumi up -s {stack} failed (its output is above)")
    return time.monotonic() - t0


def completion_through(out: dict, key: str, ca: Path) -> dict:
    ca.write_text(out["caPem"])
    with httpx.Client(base_url=out["endpoint"], verify=str(ca), timeout=120) as c:
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": out["model"], "prompt": "<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>", "max_tokens": 2})
    return {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]}


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="fleet-deploy-"))
    os.environ["FIMFLEET_BACKEND_URL"] = f"file://{tmp / 'state'}"  # never the demo's stacks
    paths = ld.prepare()
    one_cfg, fleet_cfg = tmp / "Pulumi.local.yaml", tmp / "Pulumi.local-fleet.yaml"
    try:
        ld.stack_config(one_cfg, tmp / "vm-one", paths["model_dir"])
        ld.start_vm(tmp / "vm-one", paths["wheelhouse"])
        ld.say("A: pulumi up -s local onto a fresh VM (the engine starts for real)")
        one_s = timed_up(one_cfg, "local")
    finally:
        ld.destroy(one_cfg, check=False, capture=True)
        ld.stop_vm(tmp / "vm-one")
    try:
        local_fleet.start(tmp, fleet_cfg, paths)
        ld.say("B: pulumi up -s local-fleet onto two fresh VMs (the canary, then node2)")
        fleet_s = timed_up(fleet_cfg, local_fleet.STACK)
        out = ld.outputs(fleet_cfg, stack=local_fleet.STACK)
        keys = json.loads(json.loads(ld.fimfleet_pulumi("config", "--show-secrets", "--json", "-s", local_fleet.STACK,
                                                        "--config-file", str(fleet_cfg)))["fimfleet:apiKeys"]["value"])
        through = completion_through(out, next(iter(keys.values())), tmp / "ca.pem")
        nodes = {n: v["state"] for n, v in out["nodes"].items()}
    finally:
        ld.destroy(fleet_cfg, check=False, stack=local_fleet.STACK, capture=True)
        local_fleet.stop(tmp)
    result = {"one_node_up_s": round(one_s, 1), "two_node_fleet_up_s": round(fleet_s, 1),
              "ratio_two_nodes_over_one": round(fleet_s / one_s, 3), "fleet_endpoint_completion": through,
              "node_states": nodes, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "note": "each leg from the booted snapshot: every engine starts under emulation (about 6 min each); "
                      "the fleet's canary goes alone, then node2, then the fleet's SLA check through the gateway"}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
