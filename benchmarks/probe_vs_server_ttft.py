#!/usr/bin/env python3
"""Compare the SLA probe's TTFT with vLLM's own TTFT histogram on the same requests.

Shows that the probe (components/sla/probe.py) does not distort what it measures: the
probe's TTFT includes the network, TLS, nginx and SSE framing, the server's
``vllm:time_to_first_token_seconds`` starts when the engine receives the request.
The gap between the two means is the cost of the path in front of the engine.

Steps: warm up (uncounted) -> scrape ``/metrics`` -> run the measured probe
requests (warmup=0) -> scrape again -> compare the histogram deltas (_sum/_count,
buckets) with the probe's per-request TTFTs. Run it alone against the node: other
traffic during the run lands in the server's histogram (the script warns when the
server counted a different number of requests than the probe sent).

Usage (real node, metrics straight from vLLM when nginx restricts /metrics):

    FIMFLEET_KEY=... python benchmarks/probe_vs_server_ttft.py \\
        --endpoint https://node:8443 --ca ca.pem --model qwen2.5-coder-1.5b \\
        --metrics-url http://127.0.0.1:8000/metrics --samples 30 [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from components.sla.probe import ProbeConfig, run_probe, tls_settings  # noqa: E402

METRIC = "vllm:time_to_first_token_seconds"
_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass
class HistogramSnapshot:
    """Sum over all matching series of one Prometheus histogram."""

    count: float = 0.0
    sum: float = 0.0
    buckets: dict[float, float] = dataclasses.field(default_factory=dict)
    """Cumulative counts by upper bound ``le`` (``math.inf`` for +Inf)."""

    def minus(self, before: "HistogramSnapshot") -> "HistogramSnapshot":
        return HistogramSnapshot(
            count=self.count - before.count,
            sum=self.sum - before.sum,
            buckets={le: c - before.buckets.get(le, 0.0) for le, c in self.buckets.items()},
        )

    @property
    def mean(self) -> Optional[float]:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> Optional[float]:
        """Prometheus ``histogram_quantile``: linear interpolation inside the bucket."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


def parse_histogram(text: str, metric: str = METRIC, model: Optional[str] = None) -> HistogramSnapshot:
    """Parse Prometheus text format, summing series of ``metric`` (optionally one model)."""
    snap = HistogramSnapshot()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        name = m.group("name")
        if not name.startswith(metric + "_"):
            continue
        labels = dict(_LABEL_RE.findall(m.group("labels") or ""))
        if model is not None and "model_name" in labels and labels["model_name"] != model:
            continue
        value = float(m.group("value"))
        suffix = name[len(metric) + 1:]
        if suffix == "count":
            snap.count += value
        elif suffix == "sum":
            snap.sum += value
        elif suffix == "bucket":
            le = math.inf if labels.get("le") in ("+Inf", "Inf") else float(labels["le"])
            snap.buckets[le] = snap.buckets.get(le, 0.0) + value
    return snap


def scrape(url: str, verify: Any, api_key: Optional[str], timeout: float = 10.0,
           model: Optional[str] = None) -> HistogramSnapshot:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(verify=verify, timeout=timeout, trust_env=False) as client:
        resp = client.get(url, headers=headers)
        resp.raise_for_status()
        return parse_histogram(resp.text, model=model)


def compare(config: ProbeConfig, metrics_url: Optional[str] = None,
            metrics_verify: Any = None, metrics_model: Optional[str] = None) -> dict[str, Any]:
    """Warm up, scrape, probe, scrape; return the comparison as a dict."""
    metrics_url = metrics_url or config.endpoint.rstrip("/") + "/metrics"
    verify = metrics_verify if metrics_verify is not None else tls_settings(config)[0]
    if config.warmup:
        run_probe(dataclasses.replace(config, samples=0))
    before = scrape(metrics_url, verify, config.api_key, model=metrics_model)
    report = run_probe(dataclasses.replace(config, warmup=0))
    after = scrape(metrics_url, verify, config.api_key, model=metrics_model)
    delta = after.minus(before)

    ttfts = [r.ttft_ms for r in report.results if r.ok and r.ttft_ms is not None]
    sent = len([r for r in report.results if r.error_kind != "aborted"])
    probe_mean = sum(ttfts) / len(ttfts) if ttfts else None
    server_mean = delta.mean * 1000.0 if delta.mean is not None else None
    out: dict[str, Any] = {
        "endpoint": config.endpoint,
        "metrics_url": metrics_url,
        "model": config.model,
        "probe_requests_sent": sent,
        "probe_ok": len(report.ok_results),
        "probe_ttft_samples": len(ttfts),
        "server_ttft_count": delta.count,
        "probe_ttft_mean_ms": _r(probe_mean),
        "server_ttft_mean_ms": _r(server_mean),
        "gap_mean_ms": _r(probe_mean - server_mean) if probe_mean is not None and server_mean is not None else None,
        "gap_ratio": _r(probe_mean / server_mean) if probe_mean and server_mean else None,
        "server_ttft_p50_ms_from_buckets": _r((delta.quantile(0.5) or 0) * 1000) if delta.count else None,
        "probe_ttft_p50_ms": report.to_dict(per_request=False)["ttft_ms"]["p50"],
        "warnings": [],
    }
    if delta.count != len(ttfts):
        out["warnings"].append(
            f"server counted {delta.count:g} first tokens, the probe {len(ttfts)}: "
            "other traffic, failed requests or empty completions make the means less comparable"
        )
    if report.errors:
        out["warnings"].append(f"{len(report.errors)} probe request(s) failed")
    return out


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="probe TTFT vs vllm:time_to_first_token_seconds")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--key-env", default="FIMFLEET_KEY")
    p.add_argument("--no-key", action="store_true")
    p.add_argument("--model", required=True)
    p.add_argument("--ca")
    p.add_argument("--insecure-skip-verify", action="store_true")
    p.add_argument("--metrics-url", help="default: <endpoint>/metrics")
    p.add_argument("--metrics-ca", help="CA for the metrics URL (default: --ca)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=512)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    key = None
    if not a.no_key:
        key = os.environ.get(a.key_env)
        if not key:
            print(f"error: environment variable {a.key_env} is not set (or use --no-key)", file=sys.stderr)
            return 2
    cfg = ProbeConfig(
        endpoint=a.endpoint, model=a.model, api_key=key, ca_pem=a.ca,
        insecure_skip_verify=a.insecure_skip_verify, samples=a.samples, warmup=a.warmup,
        concurrency=a.concurrency, max_tokens=a.max_tokens, max_prompt_chars=a.max_prompt_chars,
        request_timeout_s=a.request_timeout,
    )
    problems = cfg.validate()
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    metrics_verify = None
    if a.metrics_ca:
        metrics_verify = tls_settings(dataclasses.replace(cfg, ca_pem=a.metrics_ca, insecure_skip_verify=False))[0]
    try:
        result = compare(cfg, a.metrics_url, metrics_verify, metrics_model=a.model)
    except httpx.HTTPError as exc:
        print(f"error: could not scrape metrics: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"endpoint {result['endpoint']}  metrics {result['metrics_url']}")
        print(f"requests: probe sent {result['probe_requests_sent']}, ok {result['probe_ok']}, "
              f"server counted {result['server_ttft_count']:g}")
        print(f"probe  TTFT mean {result['probe_ttft_mean_ms']} ms  (p50 {result['probe_ttft_p50_ms']} ms)")
        print(f"server TTFT mean {result['server_ttft_mean_ms']} ms  "
              f"(p50 ~{result['server_ttft_p50_ms_from_buckets']} ms from buckets)")
        print(f"gap (probe - server) {result['gap_mean_ms']} ms, ratio {result['gap_ratio']}")
        for w in result["warnings"]:
            print(f"WARNING: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
