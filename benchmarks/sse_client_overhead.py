#!/usr/bin/env python3
"""Client-side cost of the SLA probe against vLLM's benchmark client, with no engine in the way.

Why: probe_vs_vllm_bench.py compares the two clients against a real engine, whose TTFT
(tens of ms on a shared 2-core box) swamps a client difference of a millisecond or two.
Here both clients talk to a stub SSE server (a subprocess, stdlib asyncio) that answers
every POST at once, the way vLLM frames a streamed /v1/completions reply (HTTP/1.1
keepalive, chunked, one ``data:`` event per chunk, usage chunk, ``[DONE]``), so the TTFT
each client reports is its own overhead plus the loopback round trip:

  probe  ``components.sla.probe.run_probe`` (the project venv, aiohttp), as the gate runs it;
  bench  ``vllm.benchmarks.lib.endpoint_request_func.async_request_openai_completions`` on
         one aiohttp session, as ``vllm.benchmarks.serve.benchmark`` drives it (the vLLM venv).

Legs alternate (ABBA) for --rounds rounds; p50/p99 are nearest-rank over the pooled samples.

    .venv/bin/python benchmarks/sse_client_overhead.py [--rounds 6 --samples 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._engine import arm_sigterm, make_log, stop_group, vllm_python  # noqa: E402
from components.sla.probe import ProbeConfig, run_probe  # noqa: E402
from components.sla.stats import percentile  # noqa: E402
from tests.helpers import free_port  # noqa: E402

STUB = r'''
import asyncio, json, sys
CHUNK = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": None, "stop_reason": None}]}
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(n))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            events = []
            for i in range(int(body.get("max_tokens", 16))):
                c = dict(CHUNK); c["choices"] = [dict(CHUNK["choices"][0])]
                if i == int(body.get("max_tokens", 16)) - 1:
                    c["choices"][0]["finish_reason"] = "length"
                events.append("data: " + json.dumps(c) + "\n\n")
            events.append("data: " + json.dumps({"id": "cmpl-x", "choices": [], "usage": {
                "prompt_tokens": 10, "completion_tokens": int(body.get("max_tokens", 16)), "total_tokens": 26}}) + "\n\n")
            events.append("data: [DONE]\n\n")
            for ev in events:
                b = ev.encode()
                writer.write(b"%x\r\n%s\r\n" % (len(b), b))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    async with srv:
        await srv.serve_forever()
asyncio.run(main())
'''

BENCH = r'''
import asyncio, json, sys, time
import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions
url, n, warm, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
async def main():
    conn = aiohttp.TCPConnector(limit=1, limit_per_host=1, ttl_dns_cache=300, use_dns_cache=True,
                                keepalive_timeout=60, enable_cleanup_closed=True, force_close=False, ssl=False)
    out = []
    async with aiohttp.ClientSession(connector=conn, trust_env=True,
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        for i in range(warm + n):
            inp = RequestFuncInput(prompt=f"<|fim_prefix|># {i}\ndef f(x):\n    return <|fim_suffix|>\n<|fim_middle|>",
                                   api_url=url, prompt_len=10, output_len=max_tokens, model="m",
                                   extra_body={"temperature": 0, "stop": ["<|endoftext|>", "<|file_sep|>",
                                                                         "<|fim_prefix|>", "<|fim_suffix|>"]})
            r = await async_request_openai_completions(inp, s)
            if i >= warm and r.success:
                out.append(r.ttft * 1000)
    print(json.dumps(out))
asyncio.run(main())
'''


log = make_log("sse-overhead")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sse_client_overhead.json"))
    p.add_argument("--no-out", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    py = vllm_python()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    legs: dict[str, list[list[float]]] = {"probe": [], "bench": []}
    arm_sigterm()
    try:
        if stub.stdout.readline().strip() != "ready":
            raise RuntimeError("stub server did not start")
        log(f"stub SSE server on {base}")
        for rnd in range(a.rounds):
            for leg in (("probe", "bench") if rnd % 2 == 0 else ("bench", "probe")):
                if leg == "probe":
                    rep = run_probe(ProbeConfig(endpoint=base, model="m", samples=a.samples, warmup=a.warmup,
                                                max_tokens=a.max_tokens, request_timeout_s=30))
                    xs = [r.ttft_ms for r in rep.results if r.ok and r.ttft_ms is not None]
                else:
                    r = subprocess.run([py, "-c", BENCH, base + "/v1/completions", str(a.samples), str(a.warmup),
                                        str(a.max_tokens)], capture_output=True, text=True, timeout=600,
                                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
                    if r.returncode != 0:
                        raise RuntimeError(f"bench client failed:\n{r.stderr[-2000:]}")
                    xs = json.loads(r.stdout.strip().splitlines()[-1])
                legs[leg].append(xs)
                log(f"round {rnd} {leg}: n={len(xs)} p50 {percentile(xs, 50):.3f} ms")
    finally:
        stop_group(stub, grace_s=30)
        log("stub stopped")

    def summary(leg: str) -> dict:
        xs = [x for r in legs[leg] for x in r]
        return {"n": len(xs), "p50_ms": round(percentile(xs, 50), 3), "p99_ms": round(percentile(xs, 99), 3),
                "mean_ms": round(sum(xs) / len(xs), 3),
                "per_round_p50_ms": [round(percentile(r, 50), 3) for r in legs[leg]]}

    pr, be = summary("probe"), summary("bench")
    result = {
        "benchmark": "sse_client_overhead",
        "why": "client-only TTFT (stub server answers at once): the SLA probe vs vLLM bench client (both aiohttp)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"nproc": os.cpu_count(), "loadavg_at_end": round(os.getloadavg()[0], 2)},
        "settings": {"rounds": a.rounds, "samples_per_leg": a.samples, "warmup": a.warmup,
                     "max_tokens": a.max_tokens, "concurrency": 1},
        "probe": pr, "bench": be,
        "probe_minus_bench_p50_ms": round(pr["p50_ms"] - be["p50_ms"], 3),
        "ratio_probe_over_bench_p50": round(pr["p50_ms"] / be["p50_ms"], 3),
    }
    if not a.no_out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.out}")
    log(f"probe p50 {pr['p50_ms']} ms, bench p50 {be['p50_ms']} ms, difference {result['probe_minus_bench_p50_ms']} ms")
    if a.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
