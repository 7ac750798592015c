#!/usr/bin/env python3
"""The capacity a fleet keeps while it rolls (issue 12, item 7), and that no request fails.

Two native vLLM CPU engines (the tiny FIM model), each pinned to its own core so that each
stands for a node, each behind its own real nginx ingress, behind one real gateway with key
affinity (benchmarks/_fleet.py). Developers stream FIM completions through the gateway
without pause the whole time. The roll is what `pulumi up` does to a changed fleet, node by
node, canary first (rollout.maxUnavailable 1): the real drain step, a real engine restart,
one completion straight through the node's own ingress (its SLA check), the real enable step.

Reported per phase (before the roll, during it, after it): completed requests per second,
failed requests (any status but 200, a broken stream, a stream without [DONE]) and the TTFT
p50 at the client; with the ratios roll / before and after / before.

    .venv/bin/python benchmarks/roll_capacity.py [--developers 8] [--window-s 45] \\
        [--out benchmarks/results/roll_capacity.json]

Progress goes to stderr; the engines are always stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import ssl
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks._engine import SERVED, Engine, arm_sigterm, make_log, tiny_model, vllm_python, vllm_versions  # noqa: E402
from benchmarks._fleet import Gateway, NativeFleet  # noqa: E402
from benchmarks.gateway_affinity import source_file  # noqa: E402
from components import models  # noqa: E402

log = make_log("roll")
MAX_TOKENS = 8
MAX_FILE_CHARS = 3000
"""A developer's file stays well inside the engines' 2048-token context (vLLM answers 400 past it)."""


def stream_once(client: httpx.Client, url: str, key: str, prompt: str) -> dict:
    """One streamed FIM completion: when it started, its first text, its end, and whether it was whole."""
    t0 = time.monotonic()
    rec = {"t0": t0, "ttft": None, "t1": None, "ok": False, "why": None}
    body = {"model": SERVED, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                rec["why"] = f"status {r.status_code}"
                r.read()
            else:
                done = False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and rec["ttft"] is None and '"text":""' not in line.replace(" ", ""):
                        rec["ttft"] = time.monotonic() - t0
                rec["ok"] = done
                rec["why"] = None if done else "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        rec["why"] = f"{type(exc).__name__}: {exc}"
    rec["t1"] = time.monotonic()
    return rec


def developer(name: str, key: str, gw: Gateway, stop: threading.Event, out: list, seed: int) -> None:
    """Types into its own file without pause: every keystroke one streamed FIM request."""
    rng = random.Random(seed)
    text = source_file(rng, 30)
    cursor = len(text) // 2
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    with httpx.Client(verify=ctx, timeout=httpx.Timeout(120.0)) as client:
        while not stop.is_set():
            if len(text) > MAX_FILE_CHARS:  # on to another file, before the prompt outgrows the model
                text = source_file(rng, 30)
                cursor = len(text) // 2
            text = text[:cursor] + rng.choice("abcdefghij_(") + text[cursor:]
            cursor += 1
            rec = stream_once(client, gw.url("/v1/completions"), key, models.QWEN_FIM.prompt(text[:cursor], text[cursor:]))
            rec["dev"] = name
            out.append(rec)


def direct_check(fleet: NativeFleet, i: int, key: str) -> float:
    """The node's own check after its change: one completion through its ingress, not the gateway."""
    ngx = fleet.nodes[i]
    ctx = ssl.create_default_context(cafile=str(fleet.node_ca[i]))
    with httpx.Client(verify=ctx, timeout=120) as client:
        rec = stream_once(client, ngx.url("/v1/completions"), key, models.QWEN_FIM.prompt("def f(", "):\n"))
    if not rec["ok"]:
        raise RuntimeError(f"node{i} failed its check after the restart: {rec['why']}")
    return rec["t1"] - rec["t0"]


def phase(records: list[dict], start: float, end: float) -> dict:
    ended = [r for r in records if start <= r["t1"] < end]
    ok = [r for r in ended if r["ok"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {"seconds": round(end - start, 1), "completed": len(ok), "failed": len(ended) - len(ok),
            "requests_per_s": round(len(ok) / (end - start), 3) if end > start else None,
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
            "failures": sorted({r["why"] for r in ended if not r["ok"]})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--developers", type=int, default=8)
    p.add_argument("--window-s", type=float, default=45, help="load before and after the roll")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/roll_capacity.json"))
    a = p.parse_args()
    arm_sigterm()
    py = vllm_python()
    model = tiny_model(py)
    work = Path(tempfile.mkdtemp(prefix="fimfleet-roll-"))
    keys = {f"dev{d}": secrets.token_urlsafe(24) for d in range(a.developers)}
    ncpu = os.cpu_count() or 1
    engines = [Engine(py, model, log=log, cpus=str(i % ncpu) if ncpu > 1 else None) for i in range(2)]
    fleet = NativeFleet(work, engines, keys, log)
    records: list[dict] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    steps: list[dict] = []
    member_steps: list[float] = []  # when each drain and enable step began (before, each reloaded the gateway)
    try:
        fleet.start()
        gw = fleet.gateway("gateway", affinity=True)
        threads = [threading.Thread(target=developer, args=(d, k, gw, stop, records, n), daemon=True)
                   for n, (d, k) in enumerate(keys.items())]
        for t in threads:
            t.start()
        warm = time.monotonic()
        time.sleep(10)  # every developer's first request is behind it
        t_before = time.monotonic()
        time.sleep(a.window_s)
        t_roll = time.monotonic()
        for i, engine in enumerate(engines):  # the canary alone, then the wave (one node: maxUnavailable 1)
            node = f"node{i}"
            t0 = time.monotonic()
            log(f"{node}: drain")
            gw.member(node, enabled=False)
            t1 = time.monotonic()
            log(f"{node}: drained in {t1 - t0:.1f} s; restarting its engine")
            engine.stop()
            engine.start()
            engine.wait_healthy()
            t2 = time.monotonic()
            check_s = direct_check(fleet, i, keys["dev0"])
            member_steps += [t0, t2 + check_s]
            gw.member(node, enabled=True)
            t3 = time.monotonic()
            log(f"{node}: back in rotation after {t3 - t0:.1f} s")
            steps.append({"node": node, "drain_s": round(t1 - t0, 1), "restart_s": round(t2 - t1, 1),
                          "check_s": round(check_s, 2), "out_of_rotation_s": round(t3 - t0, 1)})
        t_after = time.monotonic()
        time.sleep(a.window_s)
        t_end = time.monotonic()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
        fleet.stop()
    phases = {"before": phase(records, t_before, t_roll), "roll": phase(records, t_roll, t_after),
              "after": phase(records, t_after, t_end)}
    warmup = phase(records, warm, t_before)
    failed = [{"at_s_from_roll_start": round(r["t1"] - t_roll, 2), "why": r["why"],
               "from_nearest_member_step_s": round(min((r["t1"] - t for t in member_steps), key=abs), 2)
               if member_steps else None}
              for r in records if not r["ok"] and r["t1"] >= warm]
    before, roll, after = (phases[k]["requests_per_s"] for k in ("before", "roll", "after"))
    result = {
        "benchmark": "roll_capacity",
        "issue": "12 item 7: requests served per second during a roll vs before, and failed requests",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"nproc": ncpu, "vllm": vllm_versions(py)[0],
                    "engines": "2 native, each pinned to its own core (one node each)"},
        "load": {"developers": a.developers, "max_tokens": MAX_TOKENS, "streamed": True, "gateway_affinity": True,
                 "warmup_failed": warmup["failed"]},
        "roll": steps,
        "phases": phases,
        "failed_requests": len(failed),
        "failed": failed,
        "ratios": {"roll_over_before": round(roll / before, 3) if before else None,
                   "after_over_before": round(after / before, 3) if before else None},
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ratios": result["ratios"], "failed_requests": result["failed_requests"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
