#!/usr/bin/env python3
"""Where a full deploy's time goes, step by step (issue 13 item 5).

`pulumi up -s local` onto a fresh test VM restored from the serving snapshot, as the e2e does:
a new host identity, so every step is applied, and the engine is adopted (its start is measured
by the snapshot's build and by deploy_time.py). The CLI's own event log gives each resource's
start and end (whole seconds: the engine's timestamps); the report lists them in start order
with the longest first in `slowest`, and goes to benchmarks/results/deploy_steps.json. The
`destroy` that follows is timed the same way (`destroy_steps`): the e2e runs three of them.

    .venv/bin/python benchmarks/deploy_steps.py
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

from scripts import local_deploy as ld  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "deploy_steps.json"


def step_times(event_log: Path) -> list[dict]:
    """(name, type, op, start, seconds) per resource that the update touched, from the event log."""
    pre, done = {}, {}
    for line in event_log.read_text().splitlines():
        ev = json.loads(line)
        for kind, into in (("resourcePreEvent", pre), ("resOutputsEvent", done)):
            if kind in ev:
                md = ev[kind]["metadata"]
                into.setdefault(md["urn"], (ev["timestamp"], md["op"], md["type"]))
    t0 = min(t for t, _, _ in pre.values())
    rows = [{"name": urn.rsplit("::", 1)[-1], "type": typ, "op": op, "start_s": t - t0,
             "seconds": done[urn][0] - t if urn in done else None}
            for urn, (t, op, typ) in pre.items() if op != "same"]
    return sorted(rows, key=lambda r: (r["start_s"], r["name"]))


def slowest(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if r["seconds"] is not None), key=lambda r: -r["seconds"])[:10]


def timed(command, cfg: Path, events: Path) -> tuple[float, list[dict]]:
    """Wall time and per-step times of one CLI run (ld.up or ld.destroy) with its event log."""
    t0 = time.monotonic()
    proc = command(cfg, "--event-log", str(events), check=False)
    wall = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"pulumi {command.__name__} failed (its output is above)")
    return wall, step_times(events)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="deploy-steps-"))
    os.environ["FIMFLEET_BACKEND_URL"] = f"file://{tmp / 'state'}"  # never the demo's state
    os.environ["PULUMI_DEBUG_COMMANDS"] = "true"  # the CLI offers --event-log only with it
    state, cfg = tmp / "vm", tmp / "Pulumi.local.yaml"
    paths = ld.prepare()
    ld.stack_config(cfg, state, paths["model_dir"])
    ld.start_vm(state, paths["wheelhouse"], serving_config=cfg)
    try:
        ld.say("pulumi up -s local with the event log (every step applied, the engine adopted)")
        wall, rows = timed(ld.up, cfg, tmp / "up.jsonl")
        ld.say("pulumi destroy -s local with the event log")
        destroy_wall, gone = timed(ld.destroy, cfg, tmp / "destroy.jsonl")
    finally:  # the VM goes, and the stack's state with it (a temporary backend)
        ld.stop_vm(state)
    result = {"up_wall_s": round(wall, 1), "steps": rows, "slowest": slowest(rows),
              "destroy_wall_s": round(destroy_wall, 1), "destroy_steps": gone, "destroy_slowest": slowest(gone),
              "where": "test VM (QEMU TCG) restored from the serving snapshot, on this machine",
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for what, steps, took in (("up", rows, wall), ("destroy", gone, destroy_wall)):
        for r in steps:
            print(f"{r['start_s']:5d} s  +{r['seconds'] if r['seconds'] is not None else '?':>4} s  {r['op']:7} {r['name']}")
        print(f"pulumi {what}: {took:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
