#!/usr/bin/env python3
"""fimfleet's SLA probe against vLLM's own serving benchmark, side by side (issue 13, item 2).

Why: the SLA gate (components/sla, FimSlaCheckProvider -> check_sla -> run_probe) fails a
deploy on TTFT. If the probe's client added its own latency, the gate would judge the
client, not the engine. vLLM's ``vllm.benchmarks.serve`` is the reference client. This
script starts ONE native vLLM CPU server (the tiny FIM model, started the way
tests/integration/conftest.py's ``vllm_server`` fixture starts it) and alternates two
legs against it, ABBA order (probe, bench, bench, probe, ...) so that drift cancels:

  probe  ``components.sla.probe.run_probe`` (what the provider's create runs), in this
         process (the project venv: aiohttp, pulumi).
  bench  ``vllm.benchmarks.serve.main_async`` with a Namespace from its ``add_cli_args``,
         backend ``openai`` against /v1/completions, a ``custom`` JSONL dataset holding
         the SAME prompts (built by the probe's own job builder from components/sla/corpus),
         the same max_tokens, temperature 0, the same stop strings and the same concurrency.
         It runs in the vLLM venv (aiohttp): benchmarks/_vllm_bench_worker.py, a process
         that imports vLLM once and runs one main_async per leg. (The venv has no pandas,
         which CustomDataset uses only to read the JSONL; the worker reads it with json.)

Both legs run their own warmup (uncounted). Each leg gets a fresh run id, so no prompt
repeats and the prefix cache cannot favour either leg. Around each leg the server's
``vllm:time_to_first_token_seconds`` _sum/_count is scraped, so the engine-side TTFT of
each leg is known too (warmups included: the delta covers the whole leg).

TTFT is not defined alike: the probe stops its clock at the first chunk with non-empty
text (what an editor shows), vLLM's bench at the first chunk with ``choices`` even when its
text is empty. With the FIM stop strings (up to 14 characters) vLLM holds the last 13
characters of text back while they could still become a stop string, so the first 2-3
chunks arrive empty. --diagnose adds legs that separate that from client cost:
``raw`` (a bare aiohttp loop timing first chunk and first text in the same request),
``probe_nostop``/``bench_nostop`` (no stop strings: both definitions coincide) and
``probe_stopids`` (the probe sending the same stops as ``stop_token_ids``, looked up with
vLLM's /tokenize: no holdback). benchmarks/sse_client_overhead.py measures the client
cost alone, against a stub server.

TTFT: pooled over the rounds per leg; p50/p99 with the probe's nearest-rank percentile
(components/sla/stats.py) for all legs; the bench's own (interpolated) median is kept as
well. Ratio = probe / bench.

    .venv/bin/python benchmarks/probe_vs_vllm_bench.py --rounds 6 --samples 50 --diagnose \\
        [--concurrency 1] [--out benchmarks/results/probe_vs_vllm_bench.json]

Progress goes to stderr, the result JSON to --out (and stdout with --json). The server is
always stopped (its own process group) in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._engine import (API_KEY, MAX_MODEL_LEN, SERVED, Engine, arm_sigterm, make_log, tiny_model,  # noqa: E402
                               vllm_python, vllm_versions)
from benchmarks._vllm_bench_worker import BenchWorker  # noqa: E402

DIAG_LEGS = ("raw", "probe_nostop", "bench_nostop", "probe_stopids")
"""--diagnose legs: a bare aiohttp loop; probe and bench without the FIM stop strings; the probe
with the same stops sent as stop_token_ids (the proposed fix: no stop-string holdback)."""
log = make_log("probe-vs-bench")


_TTFT_RE = re.compile(r"^vllm:time_to_first_token_seconds_(sum|count)(?:\{[^}]*\})?\s+(\S+)", re.M)


def server_ttft(base: str) -> tuple[float, float]:
    """(sum seconds, count) of the engine's TTFT histogram, summed over series."""
    import httpx

    text = httpx.get(base + "/metrics", timeout=10).text
    s = c = 0.0
    for kind, value in _TTFT_RE.findall(text):
        if kind == "sum":
            s += float(value)
        else:
            c += float(value)
    return s, c


# --------------------------------------------------------------------------- legs
def stop_token_ids(base: str) -> list[int]:
    """The served tokenizer's ids of the probe's FIM stop strings (vLLM's /tokenize); each must be one token."""
    import httpx

    from components.sla.probe import DEFAULT_STOP

    ids = []
    for text in DEFAULT_STOP:
        r = httpx.post(base + "/tokenize", json={"model": SERVED, "prompt": text, "add_special_tokens": False},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        r.raise_for_status()
        toks = r.json()["tokens"]
        if len(toks) != 1:
            raise RuntimeError(f"stop string {text!r} is {len(toks)} tokens, not one")
        ids.append(toks[0])
    return ids


def probe_config(a: argparse.Namespace, base: str, run_id: str, stop: bool = True, extra: Optional[dict] = None):
    """The probe's config; stop=False drops the FIM stop strings (diagnosis legs only)."""
    from components.sla.probe import DEFAULT_STOP, ProbeConfig

    return ProbeConfig(endpoint=base, model=SERVED, api_key=API_KEY, samples=a.samples, warmup=a.warmup,
                       concurrency=a.concurrency, max_tokens=a.max_tokens, stop=DEFAULT_STOP if stop else (),
                       extra_body=extra or {},
                       max_prompt_chars=a.max_prompt_chars, run_id=run_id, request_timeout_s=60.0,
                       total_timeout_s=a.leg_timeout)


def run_probe_leg(a, base: str, stop: bool = True, extra: Optional[dict] = None) -> dict[str, Any]:
    from components.sla.probe import run_probe

    rep = run_probe(probe_config(a, base, "p" + uuid.uuid4().hex[:11], stop, extra))
    ok = [r for r in rep.results if r.ok]
    return {
        "ttfts_ms": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "failed": len(rep.results) - len(ok),
        "no_text": sum(1 for r in ok if r.ttft_ms is None),
        "completion_tokens_mean": (sum(r.completion_tokens or 0 for r in ok) / len(ok)) if ok else None,
        "native_p50_ms": rep.to_dict(per_request=False)["ttft_ms"]["p50"],
        "warnings": rep.warnings,
    }


def run_bench_leg(a, base: str, model_dir: Path, worker: BenchWorker, tmp: Path,
                  stop: bool = True) -> dict[str, Any]:
    from components.sla import probe as probe_mod

    run_id = "b" + uuid.uuid4().hex[:11]
    cfg = probe_config(a, base, run_id, stop)
    jobs = probe_mod._jobs(cfg, run_id, a.samples, False)  # the probe's own prompts, order and tags
    dataset = tmp / f"{run_id}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": j.prompt}) + "\n" for j in jobs))
    spec = {"base_url": base, "model_dir": str(model_dir), "served": SERVED, "dataset": str(dataset),
            "samples": a.samples, "max_tokens": a.max_tokens, "concurrency": a.concurrency,
            "warmup": a.warmup, "stop": list(cfg.stop), "api_key": API_KEY}
    res = worker.run(spec, a.leg_timeout + 60)
    res["native_p50_ms"] = res.get("median_ttft_ms")
    return res


def run_raw_leg(a, base: str) -> dict[str, Any]:
    """Diagnosis: the probe's request on the probe's client (aiohttp, one keepalive pool), with a bare loop.

    Per request: t_headers (response headers in), t_first_data (first ``data:`` line, no JSON
    parsed: what the bench calls TTFT), t_first_text (first chunk with non-empty text: the
    probe's TTFT). probe - raw(first_text) = the probe's own bookkeeping; raw(first_data) -
    bench = the two request loops on one client library; first_text - first_data = the TTFT definition.
    """
    import asyncio

    from components.sla import probe as probe_mod

    run_id = "r" + uuid.uuid4().hex[:11]
    cfg = probe_config(a, base, run_id)
    jobs = probe_mod._jobs(cfg, run_id, a.warmup, True) + probe_mod._jobs(cfg, run_id, a.samples, False)

    async def go() -> list[dict[str, float]]:
        rows: list[dict[str, float]] = []
        async with probe_mod.open_session(cfg) as client:
            pending = list(jobs)

            async def worker() -> None:
                while pending:
                    job = pending.pop(0)
                    body = json.dumps({"model": SERVED, "prompt": job.prompt, "max_tokens": a.max_tokens,
                                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                                       "stop": list(cfg.stop)}).encode()
                    row: dict[str, float] = {}
                    t0 = time.perf_counter()
                    async with client.post(cfg.url, data=body, allow_redirects=False) as resp:
                        row["headers_ms"] = (time.perf_counter() - t0) * 1000
                        async for line in resp.content:
                            if not line.startswith(b"data:"):
                                continue
                            now = time.perf_counter()
                            if "first_data_ms" not in row:
                                row["first_data_ms"] = (now - t0) * 1000
                            if "first_text_ms" not in row and line[5:].strip() != b"[DONE]":
                                obj = json.loads(line[5:])
                                if any((c.get("text") or "") for c in obj.get("choices") or []):
                                    row["first_text_ms"] = (now - t0) * 1000
                                elif obj.get("choices"):
                                    row["chunks_before_text"] = row.get("chunks_before_text", 0) + 1
                    if not job.warmup:
                        rows.append(row)

            await asyncio.gather(*(worker() for _ in range(max(1, a.concurrency))))
        return rows

    rows = asyncio.run(asyncio.wait_for(go(), a.leg_timeout))
    out: dict[str, Any] = {"ttfts_ms": [r["first_text_ms"] for r in rows if "first_text_ms" in r]}
    for k in ("headers_ms", "first_data_ms", "first_text_ms"):
        xs = [r[k] for r in rows if k in r]
        out[k.replace("_ms", "_p50_ms")] = _r(percentile(xs, 50))
        out[k.replace("_ms", "_all")] = xs
    out["holdback_all"] = [r["first_text_ms"] - r["first_data_ms"] for r in rows if "first_text_ms" in r]
    out["chunks_before_text_all"] = [r.get("chunks_before_text", 0) for r in rows if "first_text_ms" in r]
    out["failed"] = sum(1 for r in rows if "first_data_ms" not in r)
    out["first_chunk_empty"] = sum(1 for r in rows if r.get("first_text_ms", -1) != r.get("first_data_ms"))
    return out


def percentile(xs: list[float], p: float) -> Optional[float]:
    from components.sla.stats import percentile as nearest_rank

    return nearest_rank(xs, p)


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


def machine_facts(py: str) -> dict[str, Any]:
    vllm_ver, torch_ver = vllm_versions(py)
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "vllm": vllm_ver, "torch": torch_ver,
            "loadavg_at_start": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="probe+bench pairs, ABBA order")
    p.add_argument("--samples", type=int, default=50, help="measured requests per leg")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=512)
    p.add_argument("--leg-timeout", type=float, default=300.0, help="seconds per leg")
    p.add_argument("--health-timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/probe_vs_vllm_bench.json"))
    p.add_argument("--no-out", action="store_true", help="do not write --out (smoke runs)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--endpoint", help="attach to a running engine (serving tiny-qwen2-fim with benchmarks/_engine.py's API_KEY) instead of starting one")
    p.add_argument("--diagnose", action="store_true",
                   help="add the diagnosis legs (DIAG_LEGS): raw aiohttp, both clients without stop strings, probe with stop_token_ids")
    a = p.parse_args()

    py = vllm_python()
    model = tiny_model(py)
    facts = machine_facts(py)
    log(f"vllm python {py}, model {model}, facts {facts}")
    server = Engine(py, model, log=log)
    legs: dict[str, list[dict[str, Any]]] = {"probe": [], "bench": [], **({k: [] for k in DIAG_LEGS} if a.diagnose else {})}
    sequence: list[str] = []
    t_start = time.monotonic()
    worker: Optional[BenchWorker] = None
    arm_sigterm()  # or a SIGTERM from timeout(1) skips the finally below and the engine outlives us
    try:
        worker = BenchWorker(py)  # imports vllm while the engine starts
        if a.endpoint:
            server.attach(a.endpoint)
        else:
            server.start()
            server.wait_healthy(a.health_timeout)
        worker.wait_ready()
        stop_ids = stop_token_ids(server.base) if a.diagnose else []
        with tempfile.TemporaryDirectory(prefix="probe-vs-bench-") as td:
            for rnd in range(a.rounds):
                order = ["probe", "bench"] + (list(DIAG_LEGS) if a.diagnose else [])
                if rnd % 2:
                    order.reverse()
                for leg in order:
                    s0, c0 = server_ttft(server.base)
                    t0 = time.monotonic()
                    stop = not leg.endswith(("_nostop", "_stopids"))
                    if leg == "probe_stopids":
                        res = run_probe_leg(a, server.base, False, {"stop_token_ids": stop_ids})
                    elif leg.startswith("probe"):
                        res = run_probe_leg(a, server.base, stop)
                    elif leg.startswith("bench"):
                        res = run_bench_leg(a, server.base, model, worker, Path(td), stop)
                    else:
                        res = run_raw_leg(a, server.base)
                    s1, c1 = server_ttft(server.base)
                    res["round"], res["wall_s"] = rnd, round(time.monotonic() - t0, 2)
                    res["server_ttft_mean_ms"] = _r((s1 - s0) / (c1 - c0) * 1000) if c1 > c0 else None
                    res["server_ttft_count"] = c1 - c0
                    res["p50_ms"] = _r(percentile(res["ttfts_ms"], 50))
                    legs[leg].append(res)
                    sequence.append(leg)
                    log(f"round {rnd} {leg}: n={len(res['ttfts_ms'])} p50 {res['p50_ms']} ms, "
                        f"server mean {res['server_ttft_mean_ms']} ms, {res['wall_s']} s")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing may cut the cleanup short
        if worker is not None:
            worker.close()
        if not a.endpoint:
            server.stop()

    def pooled(leg: str) -> dict[str, Any]:
        xs = [t for r in legs[leg] for t in r["ttfts_ms"]]
        srv = [r["server_ttft_mean_ms"] for r in legs[leg] if r["server_ttft_mean_ms"] is not None]
        return {"n": len(xs), "p50_ms": _r(percentile(xs, 50)), "p99_ms": _r(percentile(xs, 99)),
                "mean_ms": _r(sum(xs) / len(xs)) if xs else None,
                "server_ttft_mean_ms": _r(sum(srv) / len(srv)) if srv else None,
                "failed": sum(r.get("failed") or 0 for r in legs[leg]),
                "per_round_p50_ms": [r["p50_ms"] for r in legs[leg]],
                "native_p50_ms_per_round": [_r(r.get("native_p50_ms")) for r in legs[leg]]}

    probe, bench = pooled("probe"), pooled("bench")

    def ratio(x, y):
        return _r(x / y, 4) if x and y else None

    round_ratios = [ratio(p_["p50_ms"], b["p50_ms"]) for p_, b in zip(legs["probe"], legs["bench"])]
    ratio_p50 = ratio(probe["p50_ms"], bench["p50_ms"])
    result = {
        "benchmark": "probe_vs_vllm_bench",
        "issue": "13 item 2: probe TTFT p50 within 5% of vLLM's serving benchmark",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": facts,
        "server": {"model": str(model), "served_model_name": SERVED, "kv_cache_gib": server.kv_gib,
                   "dtype": server.dtype, "flags": f"--enforce-eager --max-model-len {MAX_MODEL_LEN} --api-key ... "
                                                     "--custom-histogram-buckets",
                   "healthy_s": _r(server.healthy_s, 1)},
        "settings": {"rounds": a.rounds, "samples_per_leg": a.samples, "warmup_per_leg": a.warmup,
                     "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                     "max_prompt_chars": a.max_prompt_chars, "order": sequence,
                     "percentile_method": "nearest-rank (components/sla/stats.py), pooled over rounds",
                     "bench": "vllm.benchmarks.serve.main_async, backend openai, /v1/completions, custom "
                              "dataset of the probe's prompts, temperature 0, the probe's stop strings"},
        "probe": probe,
        "bench": bench,
        "ratio_probe_over_bench": {"p50": ratio_p50, "p99": ratio(probe["p99_ms"], bench["p99_ms"]),
                                   "mean": ratio(probe["mean_ms"], bench["mean_ms"]),
                                   "p50_per_round": round_ratios,
                                   "server_side_mean": ratio(probe["server_ttft_mean_ms"],
                                                             bench["server_ttft_mean_ms"])},
        "goal_p50_within_5pct": (abs(ratio_p50 - 1) <= 0.05) if ratio_p50 else None,
        "wall_s": round(time.monotonic() - t_start, 1),
        "loadavg_at_end": round(os.getloadavg()[0], 2),
        "legs": {k: [{kk: vv for kk, vv in r.items() if kk not in ("ttfts_ms", "output_lens")
                      and not kk.endswith("_all")} for r in v]
                 for k, v in legs.items()},
    }
    if a.diagnose:
        raw = legs["raw"]
        pool = {k: [x for r in raw for x in r[k + "_all"]] for k in ("headers", "first_data", "first_text")}
        hb = [x for r in raw for x in r["holdback_all"]]
        cb = [x for r in raw for x in r["chunks_before_text_all"]]
        result["diagnosis"] = {
            "raw_client_p50_ms": {k: _r(percentile(v, 50)) for k, v in pool.items()},
            "raw_client_mean_ms": {k: _r(sum(v) / len(v)) if v else None for k, v in pool.items()},
            "requests_whose_first_data_chunk_had_no_text": sum(r["first_chunk_empty"] for r in raw),
            "requests": len(pool["first_data"]),
            "paired_holdback_ms (first text - first chunk, same request)": {
                "p50": _r(percentile(hb, 50)), "mean": _r(sum(hb) / len(hb)) if hb else None},
            "empty_chunks_before_first_text": {"p50": percentile(cb, 50), "max": max(cb) if cb else None},
            "bench_median_itl_ms_per_leg": [_r(r.get("median_itl_ms")) for r in legs["bench"]],
            "probe_minus_raw_first_text_p50_ms": _r(probe["p50_ms"] - percentile(pool["first_text"], 50))
            if pool["first_text"] and probe["p50_ms"] else None,
            "raw_first_data_minus_bench_p50_ms": _r(percentile(pool["first_data"], 50) - bench["p50_ms"])
            if pool["first_data"] and bench["p50_ms"] else None,
        }
        result["raw"] = pooled("raw")
        pn, bn = pooled("probe_nostop"), pooled("bench_nostop")
        result["probe_nostop"], result["bench_nostop"] = pn, bn
        result["ratio_probe_over_bench_without_stop_strings"] = {
            "p50": ratio(pn["p50_ms"], bn["p50_ms"]), "p99": ratio(pn["p99_ms"], bn["p99_ms"]),
            "mean": ratio(pn["mean_ms"], bn["mean_ms"]),
            "server_side_mean": ratio(pn["server_ttft_mean_ms"], bn["server_ttft_mean_ms"])}
        same = ratio(pn["p50_ms"], bn["p50_ms"])
        result["goal_same_definition"] = {
            "statement": "probe TTFT p50 at most 1.05x vLLM bench's when both time the same event "
                         "(no stop strings: the first chunk is the first text)",
            "ratio_p50": same, "met": same <= 1.05 if same else None,
            "within_5pct_both_ways": abs(same - 1) <= 0.05 if same else None}
        ps = pooled("probe_stopids")
        result["probe_stopids"] = ps
        result["stop_token_ids"] = stop_ids
        result["ratio_probe_stopids_over_bench"] = {
            "p50": ratio(ps["p50_ms"], bench["p50_ms"]), "p99": ratio(ps["p99_ms"], bench["p99_ms"]),
            "mean": ratio(ps["mean_ms"], bench["mean_ms"])}
        result["diagnosis"]["stop_string_holdback_p50_ms"] = _r(
            percentile(pool["first_text"], 50) - percentile(pool["first_data"], 50)) if pool["first_text"] else None
    if not a.no_out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.out}")
    server.discard_log()  # the logs are kept only when the run failed
    if worker is not None:
        worker.discard_log()
    log(f"probe p50 {probe['p50_ms']} p99 {probe['p99_ms']} | bench p50 {bench['p50_ms']} p99 {bench['p99_ms']} "
        f"| ratio p50 {ratio_p50} p99 {result['ratio_probe_over_bench']['p99']}")
    if a.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
