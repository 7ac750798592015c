"""The `local-fleet` stack: two test VMs as a two-node fleet behind a gateway beside the first.

VM 1 carries the canary, `node`, and the gateway (guest ports 443 for the node's ingress and
8443 for the gateway's). VM 2 carries `node2`. The gateway reaches VM 2's ingress through
QEMU's user network, at the port this machine forwards to it (components/gateway.py).
`serving=True` restores VM 1 from the `local` stack's serving snapshot, whose engine the
canary adopts (same name, same runtime); VM 2, and both VMs otherwise, start from the booted
snapshot, so their engines start during `up`.

    .venv/bin/python -m scripts.local_fleet            # deploy it (state in .work/), print the endpoint
    .venv/bin/python -m scripts.local_fleet --destroy  # destroy it and stop both VMs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
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
    if serving:  # the `local` stack's runtime is the canary's: its serving snapshot holds that engine
        serving_config = ld.stack_config(root / "Pulumi.local.yaml", vms[NODES[0]], paths["model_dir"])
    ld.start_vm(vms[NODES[0]], paths["wheelhouse"], serving_config=serving_config, guest_ports=(443, GATEWAY_PORT))
    ld.start_vm(vms[NODES[1]], paths["wheelhouse"])
    return vms


def stop(root: Path) -> None:
    for state in states(root).values():
        ld.stop_vm(state)


def destroy(config_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(ld.ROOT / "fimfleet"), "pulumi", "destroy", "--yes", "-s", STACK, "--non-interactive",
                           "--skip-preview", "--config-file", str(config_file)], cwd=ld.ROOT, text=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ld.CACHE / "testbed" / "vms" / "demo-fleet")
    ap.add_argument("--config-file", type=Path, default=ld.WORK / f"Pulumi.{STACK}.yaml")
    ap.add_argument("--destroy", action="store_true")
    a = ap.parse_args(argv)
    if a.destroy:
        rc = destroy(a.config_file).returncode
        stop(a.root)
        return rc
    t0 = time.monotonic()
    paths = ld.prepare()
    start(a.root, a.config_file, paths, serving=True)
    ld.clear_stale_lock(STACK)
    ld.say(f"pulumi up -s {STACK}: the canary, then node2 (its engine starts under emulation: minutes)")
    if ld.up(a.config_file, check=False, stack=STACK).returncode != 0:
        raise SystemExit(f"fimfleet: pulumi up -s {STACK} failed (its output above says why); rerun to converge")
    out = ld.outputs(a.config_file, stack=STACK)
    print(f"\nfleet endpoint: {out['endpoint']}\nnodes: {out.get('nodes')}\n\n{out.get('fleetSlaReport')}")
    ld.say(f"done in {time.monotonic() - t0:.0f} s; destroy with: .venv/bin/python -m scripts.local_fleet --destroy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
