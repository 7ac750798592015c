"""CLI: ``python -m components.sla --endpoint https://host:port --key-env FIMFLEET_KEY
--model NAME [--ca FILE] ...``; exit code 0 = SLA met, 1 = SLA missed, 2 = bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

from components.sla.probe import ProbeConfig, check_sla
from components.sla.thresholds import SlaThresholds

_DEFAULTS = ProbeConfig(endpoint="http://unused", model="unused")
_LIMITS = tuple(f.name for f in dataclasses.fields(SlaThresholds))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m components.sla",
        description="Measure FIM completion latency of an OpenAI-compatible endpoint "
        "(vLLM) and check it against an SLA. Exit 0 = SLA met, 1 = missed, 2 = usage error.",
    )
    p.add_argument("--endpoint", required=True, help="base URL, e.g. https://host:8443")
    p.add_argument("--key-env", default="FIMFLEET_KEY",
                   help="name of the environment variable holding the bearer key (default: %(default)s)")
    p.add_argument("--no-key", action="store_true", help="send no Authorization header")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--ca", help="CA bundle or server certificate (PEM file)")
    p.add_argument("--insecure-skip-verify", action="store_true",
                   help="do not verify TLS (the report says so)")
    p.add_argument("--tls-server-name", help="hostname to verify / send as SNI")
    p.add_argument("--samples", type=int, default=_DEFAULTS.samples)
    p.add_argument("--warmup", type=int, default=_DEFAULTS.warmup)
    p.add_argument("--concurrency", type=int, default=_DEFAULTS.concurrency)
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS.max_tokens)
    p.add_argument("--max-prompt-chars", type=int, default=_DEFAULTS.max_prompt_chars)
    p.add_argument("--connect-timeout", type=float, default=_DEFAULTS.connect_timeout_s)
    p.add_argument("--read-timeout", type=float, default=_DEFAULTS.read_timeout_s)
    p.add_argument("--request-timeout", type=float, default=_DEFAULTS.request_timeout_s)
    p.add_argument("--total-timeout", type=float, default=None)
    p.add_argument("--max-consecutive-errors", type=int, default=_DEFAULTS.max_consecutive_errors)
    p.add_argument("--ttft-p50-ms", type=float)
    p.add_argument("--ttft-p95-ms", type=float)
    p.add_argument("--ttft-p99-ms", type=float)
    p.add_argument("--min-decode-tps", type=float, dest="min_decode_tokens_per_s")
    p.add_argument("--min-decode-fraction", type=float, dest="min_decode_ceiling_fraction",
                   help="median decode rate as a fraction of the ceiling (needs the next two)")
    p.add_argument("--bandwidth-bytes-per-s", type=float, help="the node's memory bandwidth, for the decode ceiling")
    p.add_argument("--weight-bytes-per-token", type=float, dest="active_weight_bytes_per_token",
                   help="weight bytes read per decoded token, for the decode ceiling")
    p.add_argument("--max-error-rate", type=float)
    p.add_argument("--max-errors", type=int)
    p.add_argument("--json", action="store_true", help="print the structured report as JSON")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    key = None
    if not args.no_key:
        key = os.environ.get(args.key_env)
        if not key:
            print(f"error: environment variable {args.key_env} is not set (or use --no-key)",
                  file=sys.stderr)
            return 2
    try:
        thresholds = SlaThresholds(**{k: getattr(args, k) for k in _LIMITS if getattr(args, k) is not None})
        cfg = ProbeConfig(
            endpoint=args.endpoint, model=args.model, api_key=key, ca_pem=args.ca,
            insecure_skip_verify=args.insecure_skip_verify, tls_server_name=args.tls_server_name,
            samples=args.samples, warmup=args.warmup, concurrency=args.concurrency,
            max_tokens=args.max_tokens, max_prompt_chars=args.max_prompt_chars,
            connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
            request_timeout_s=args.request_timeout, total_timeout_s=args.total_timeout,
            max_consecutive_errors=args.max_consecutive_errors,
            bandwidth_bytes_per_s=args.bandwidth_bytes_per_s,
            active_weight_bytes_per_token=args.active_weight_bytes_per_token,
        )
        problems = cfg.validate()
        if problems:
            raise ValueError("; ".join(problems))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = check_sla(cfg, thresholds)
    if args.json:
        data = result.report.to_dict()
        data["violations"] = [v.to_dict() for v in result.violations]
        data["thresholds"] = thresholds.to_dict()
        data["passed"] = result.passed
        print(json.dumps(data, indent=2))
    else:
        print(result.summary)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
