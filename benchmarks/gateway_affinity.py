#!/usr/bin/env python3
"""The gateway's key affinity against round robin, measured by vLLM's own prefix-cache counters
(issue 12, item 7).

Two native vLLM CPU engines (the tiny FIM model, prefix caching on, as the tests start them),
each behind its own real nginx ingress (components/ingress_render.py), behind one real gateway
(a FleetUpstream, TLS to the nodes verified). The same replay runs twice in one invocation,
first with the gateway's key affinity and then with round robin, on fresh file contents each
time so that neither leg finds the other's prefixes cached: 4 simulated developers, each
typing keystroke by keystroke in a few places of their own file, every keystroke one FIM
request (prefix = the file up to the cursor, suffix = the rest), interleaved.

Around each leg every engine's ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``
are scraped: hits / queries is the hit rate, queries - hits the prompt tokens the fleet had
to prefill. Both are reported per leg, with the ratios affinity / round robin.

    .venv/bin/python benchmarks/gateway_affinity.py [--developers 4] [--keystrokes 12] \\
        [--out benchmarks/results/gateway_affinity.json]

Progress goes to stderr; the engines are always stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import ssl
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks._engine import API_KEY, SERVED, Engine, arm_sigterm, make_log, tiny_model, vllm_python, vllm_versions  # noqa: E402
from benchmarks._fleet import Gateway, NativeFleet  # noqa: E402
from components import models  # noqa: E402

log = make_log("affinity")
WORDS = ("alpha", "beta", "gamma", "delta", "value", "index", "result", "buffer", "config", "handler", "items",
         "count", "total", "parse", "render", "client", "server", "token", "cache", "stream")


def source_file(rng: random.Random, lines: int) -> str:
    """A file of plausible Python, different for every seed."""
    out = []
    for i in range(lines):
        a, b, c = rng.sample(WORDS, 3)
        out.append(f"def {a}_{b}_{i}({c}, n={rng.randint(0, 999)}):\n    return {c}.{a}(n) + {rng.randint(0, 99)}\n")
    return "".join(out)


def replay(developers: int, keystrokes: int, seed: int) -> list[tuple[str, str]]:
    """(developer, FIM prompt) in the order the developers' editors send them, interleaved."""
    fim = models.QWEN_FIM
    rng = random.Random(seed)
    per_dev = []
    for d in range(developers):
        text = source_file(rng, 40)
        prompts = []
        for _burst in range(3):  # three places in the file, a few keystrokes each
            cursor = rng.randint(len(text) // 4, len(text) - 1)
            for ch in rng.choices("abcdefghij_(", k=keystrokes):
                text = text[:cursor] + ch + text[cursor:]
                cursor += 1
                prompts.append((f"dev{d}", fim.prompt(text[:cursor], text[cursor:])))
        per_dev.append(prompts)
    return [p for step in zip(*per_dev) for p in step]


def prefix_counters(engine: Engine) -> tuple[float, float]:
    """(queries, hits) of the engine's prefix cache, in tokens."""
    text = httpx.get(engine.base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    total = {"queries": 0.0, "hits": 0.0}
    for kind in total:
        for m in re.finditer(rf"^vllm:prefix_cache_{kind}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M):
            total[kind] += float(m.group(1))
    return total["queries"], total["hits"]


def run_leg(name: str, gateway: Gateway, keys: dict, engines: list[Engine], prompts) -> dict:
    before = [prefix_counters(e) for e in engines]
    ctx = ssl.create_default_context(cafile=str(gateway.ca))
    per_node = {}
    with httpx.Client(verify=ctx, timeout=60) as client:
        for i, (dev, prompt) in enumerate(prompts):
            r = client.post(gateway.url("/v1/completions"), headers={"Authorization": f"Bearer {keys[dev]}"},
                            json={"model": SERVED, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
            if i % 20 == 19:
                log(f"{name}: {i + 1}/{len(prompts)} requests")
    for e, (q0, h0) in zip(engines, before):
        q1, h1 = prefix_counters(e)
        per_node[e.base] = {"queries": q1 - q0, "hits": h1 - h0}
    queries = sum(v["queries"] for v in per_node.values())
    hits = sum(v["hits"] for v in per_node.values())
    leg = {"requests": len(prompts), "prompt_tokens": queries, "cache_hit_tokens": hits,
           "prefilled_tokens": queries - hits, "hit_rate": round(hits / queries, 4) if queries else None,
           "per_engine": list(per_node.values())}
    log(f"{name}: hit rate {leg['hit_rate']}, {leg['prefilled_tokens']:.0f} of {queries:.0f} prompt tokens prefilled")
    return leg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--developers", type=int, default=4)
    p.add_argument("--keystrokes", type=int, default=12, help="per burst; each developer types in 3 places")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/gateway_affinity.json"))
    a = p.parse_args()
    arm_sigterm()
    py = vllm_python()
    model = tiny_model(py)
    work = Path(tempfile.mkdtemp(prefix="fimfleet-affinity-"))
    keys = {f"dev{d}": secrets.token_urlsafe(24) for d in range(a.developers)}
    engines = [Engine(py, model, log=log) for _ in range(2)]
    fleet = NativeFleet(work, engines, keys, log)
    try:
        fleet.start()
        legs = {}
        for leg, affinity in (("affinity", True), ("round_robin", False)):
            gw = fleet.gateway(leg, affinity=affinity)
            seed = 1 if affinity else 2  # fresh files: neither leg reuses the other's prefixes
            legs[leg] = run_leg(leg, gw, keys, engines, replay(a.developers, a.keystrokes, seed))
    finally:
        fleet.stop()
    aff, rr = legs["affinity"], legs["round_robin"]
    result = {
        "benchmark": "gateway_affinity",
        "issue": "12 item 7: prefix-cache hit rate with the gateway's key affinity vs round robin",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"nproc": os.cpu_count(), "vllm": vllm_versions(py)[0]},
        "replay": {"developers": a.developers, "bursts_per_developer": 3, "keystrokes_per_burst": a.keystrokes,
                   "engines": len(engines), "model": SERVED, "block_size_note": "vLLM CPU caches 128-token blocks"},
        "legs": legs,
        "ratios": {"hit_rate_affinity_over_round_robin": round(aff["hit_rate"] / rr["hit_rate"], 3)
                   if aff["hit_rate"] and rr["hit_rate"] else None,
                   "prefilled_tokens_round_robin_over_affinity": round(rr["prefilled_tokens"] / aff["prefilled_tokens"], 3)
                   if aff["prefilled_tokens"] else None},
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
