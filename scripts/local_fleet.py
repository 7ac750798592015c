"""The `local-fleet` stack: two test VMs as a two-node fleet behind a gateway beside the first.

VM 1 carries the canary, `node`, and the gateway (guest ports 443 for the node's ingress and
8443 for the gateway's). VM 2 carries `node2`. The gateway reaches VM 2's ingress through
QEMU's user network, at the port this machine forwards to it (components/gateway.py).
`serving=True` restores each VM from a snapshot whose engine already serves its node's runtime
(scripts/engine_snapshot.py; VM 1's is the `local` stack's, same name and runtime; VM 2's is
built once, the first time, beside VM 1's when both are missing), so `up` adopts both engines. Without it both VMs start from the
booted snapshot, and their engines start during `up` (benchmarks/fleet_deploy.py).

    .venv/bin/python -m scripts.local_fleet            # deploy it (state in .work/), print the endpoint
    .venv/bin/python -m scripts.local_fleet --destroy  # destroy it and stop both VMs
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from scripts import local_deploy as ld

STACK = "local-fleet"
NODES = ("node", "node2")
GATEWAY_PORT = yaml.safe_load((ld.ROOT / "stacks" / f"Pulumi.{STACK}.yaml").read_text())["config"][
    "fimfleet:gateway"]["httpsPort"]


def states(root: Path) -> dict[str, Path]:
    return {n: root / f"vm-{n}" for n in NODES}


def start(root: Path, config_file: Path, paths: dict, serving: bool = False) -> dict[str, Path]:
    """Both VMs (restored, or reused while they run) and the stack's config naming them."""
    vms = states(root)
    ld.stack_config(config_file, None, paths["model_dir"], stack=STACK,
                    extra={f"fimfleet:nodes.{n}.testbedState": s for n, s in vms.items()})
    serving_config = None
    if serving:  # every node runs the `local` stack's runtime under its own name
        serving_config = ld.stack_config(root / "Pulumi.local.yaml", vms[NODES[0]], paths["model_dir"])
        # An emulated engine start leaves host cores idle part of the time: on a fresh machine both
        # snapshots build at once (one engine's start took 403 s beside another's, 368 s alone).
        with ThreadPoolExecutor(len(NODES)) as pool:
            list(pool.map(lambda n: ld.serving_snapshot(serving_config, paths["wheelhouse"], node=n), NODES))
    for name, guest_ports in zip(NODES, ((443, GATEWAY_PORT), (443,))):
        ld.start_vm(vms[name], paths["wheelhouse"], serving_config=serving_config, guest_ports=guest_ports, node=name)
    return vms


def stop(root: Path) -> None:
    for state in states(root).values():
        ld.stop_vm(state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ld.CACHE / "testbed" / "vms" / "demo-fleet")
    ap.add_argument("--config-file", type=Path, default=ld.WORK / f"Pulumi.{STACK}.yaml")
    ap.add_argument("--destroy", action="store_true")
    a = ap.parse_args(argv)
    if a.destroy:
        rc = ld.destroy(a.config_file, check=False, stack=STACK).returncode
        stop(a.root)
        return rc
    t0 = time.monotonic()
    paths = ld.prepare()
    start(a.root, a.config_file, paths, serving=True)
    ld.clear_stale_lock(STACK)
    ld.say(f"pulumi up -s {STACK}: the canary, then node2, then the fleet's check through the gateway")
    if ld.up(a.config_file, check=False, stack=STACK).returncode != 0:
        raise SystemExit(f"fimfleet: pulumi up -s {STACK} failed (its output above says why); rerun to converge")
    out = ld.outputs(a.config_file, stack=STACK)
    print(f"\nfleet endpoint: {out['endpoint']}\nnodes: {out.get('nodes')}\n\n{out.get('fleetSlaReport')}")
    ld.say(f"done in {time.monotonic() - t0:.0f} s; destroy with: .venv/bin/python -m scripts.local_fleet --destroy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
