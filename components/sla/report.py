"""What the probe measured, as data (``RequestResult``, ``ProbeReport``) and as text.

``ProbeReport.to_dict`` is the structured, JSON-ready report kept in stack outputs;
``render_text`` is the short readable form shown when the SLA gate fails. Both can
carry the decode ceiling: memory bandwidth / active weight bytes read per token, the
physical limit of decode tokens/s (``decode_ceiling``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from components.errors import Error
from components.sla.stats import (PERCENTILE_METHOD, fmt, histogram_bins, rounded, summarize,
                                  text_histogram)
from components.sla.thresholds import SlaThresholds, Violation, evaluate, judged_limits, measured, report_dict

_MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """One probe request. Times are milliseconds from just before the request is sent."""

    index: int
    case: str
    language: str
    warmup: bool = False
    prompt_chars: int = 0
    ok: bool = False
    error: Optional[str] = None
    error_kind: Optional[str] = None
    status: Optional[int] = None
    ttft_ms: Optional[float] = None
    total_ms: Optional[float] = None
    gaps_ms: list[float] = field(default_factory=list)
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    tokens_from_usage: bool = False
    content_chunks: int = 0
    text_chars: int = 0
    finish_reason: Optional[str] = None

    @property
    def decode_tps(self) -> Optional[float]:
        """(completion_tokens - 1) / (total - TTFT): tokens after the first, per second."""
        t, ttft, total = self.completion_tokens, self.ttft_ms, self.total_ms
        if not self.ok or t is None or t < 2 or ttft is None or total is None or total <= ttft:
            return None
        return (t - 1) / ((total - ttft) / 1000.0)

    def fail(self, kind: str, message: str) -> None:
        self.ok = False
        self.error_kind = kind
        self.error = message[:_MAX_ERROR_CHARS]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "case": self.case,
            "ok": self.ok,
            "status": self.status,
            "ttft_ms": rounded(self.ttft_ms),
            "total_ms": rounded(self.total_ms),
            "max_gap_ms": rounded(max(self.gaps_ms)) if self.gaps_ms else None,
            "completion_tokens": self.completion_tokens,
            "decode_tokens_per_s": rounded(self.decode_tps, 2),
            "prompt_chars": self.prompt_chars,
            "finish_reason": self.finish_reason,
            "error_kind": self.error_kind,
            "error": self.error,
        }


def decode_ceiling(bandwidth_bytes_per_s: Optional[float],
                   active_weight_bytes_per_token: Optional[float]) -> Optional[float]:
    """Upper bound of decode tokens/s: each decoded token reads every active weight once, so
    it cannot beat sustained memory bandwidth / active weight bytes per token.
    None when either figure is unknown."""
    if bandwidth_bytes_per_s is None or active_weight_bytes_per_token is None:
        return None
    for name, v in (("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
                    ("active_weight_bytes_per_token", active_weight_bytes_per_token)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{name} must be a positive number of bytes, got {v!r}")
    return bandwidth_bytes_per_s / active_weight_bytes_per_token


def decode_efficiency(measured_tokens_per_s: Optional[float], bandwidth_bytes_per_s: Optional[float],
                      active_weight_bytes_per_token: Optional[float]) -> dict[str, Optional[float]]:
    """Measured decode tok/s, the ceiling and measured / ceiling in percent (None where unknown)."""
    ceiling = decode_ceiling(bandwidth_bytes_per_s, active_weight_bytes_per_token)
    efficiency = None
    if ceiling is not None and measured_tokens_per_s is not None:
        efficiency = rounded(100.0 * measured_tokens_per_s / ceiling, 1)
    return {
        "measured_tokens_per_s": rounded(measured_tokens_per_s, 2),
        "ceiling_tokens_per_s": rounded(ceiling, 2),
        "efficiency_pct": efficiency,
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        "active_weight_bytes_per_token": active_weight_bytes_per_token,
    }


@dataclass
class ProbeReport:
    """Outcome of one probe run. ``to_dict`` is the structured, JSON-ready form."""

    endpoint: str
    url: str
    model: str
    run_id: str
    started_at: str
    duration_s: float
    settings: dict[str, Any]
    tls: str
    insecure_skip_verify: bool
    results: list[RequestResult]
    warmup_results: list[RequestResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    aborted: Optional[str] = None
    bandwidth_bytes_per_s: Optional[float] = None
    """Sustained memory bandwidth of the node, when measured: gives the decode ceiling."""
    active_weight_bytes_per_token: Optional[float] = None
    """Weight bytes the model reads per decoded token (model config and quantization)."""

    @property
    def ok_results(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    def to_dict(self, per_request: bool = True, max_per_request: Optional[int] = None) -> dict[str, Any]:
        """Stats, histogram, errors and worst requests; with ``per_request`` also one
        compact entry per measured request (the first ``max_per_request`` of them)."""
        ok = self.ok_results
        errors = self.errors
        ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        gaps = [g for r in ok for g in r.gaps_ms]
        totals = [r.total_ms for r in ok if r.total_ms is not None]
        tps = [x for x in (r.decode_tps for r in ok) if x is not None]
        tokens = [r.completion_tokens for r in ok if r.completion_tokens is not None]
        n = len(self.results)
        tps_stats = {k: (rounded(v, 2) if isinstance(v, float) else v) for k, v in summarize(tps).items()}
        worst = sorted((r for r in ok if r.ttft_ms is not None), key=lambda r: -r.ttft_ms)[:5]
        out: dict[str, Any] = {
            "version": 1,
            "endpoint": self.endpoint,
            "url": self.url,
            "model": self.model,
            "run_id": self.run_id,
            "started_at": self.started_at,
            "duration_s": rounded(self.duration_s),
            "settings": dict(self.settings),
            "tls": self.tls,
            "insecure_skip_verify": self.insecure_skip_verify,
            "percentile_method": PERCENTILE_METHOD,
            "requests": n,
            "ok": len(ok),
            "errors": len(errors),
            "error_rate": rounded(len(errors) / n, 4) if n else 0.0,
            "empty_completions": sum(1 for r in ok if r.content_chunks == 0),
            "warmup_errors": sum(1 for r in self.warmup_results if not r.ok),
            "ttft_ms": summarize(ttfts),
            "itl_ms": summarize(gaps),
            "total_ms": summarize(totals),
            "decode_tokens_per_s": tps_stats,
            "decode_ceiling": decode_efficiency(tps_stats["p50"], self.bandwidth_bytes_per_s,
                                                self.active_weight_bytes_per_token),
            "completion_tokens": {
                "sum": sum(tokens),
                "mean": rounded(sum(tokens) / len(tokens), 2) if tokens else None,
                "from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
            },
            "ttft_histogram": histogram_bins(ttfts),
            "error_samples": _error_samples(errors),
            "worst": [r.to_dict() for r in worst],
            "warnings": list(self.warnings),
            "aborted": self.aborted,
        }
        if per_request:
            shown = self.results if max_per_request is None else self.results[:max_per_request]
            out["per_request"] = [r.to_dict() for r in shown]
            out["per_request_truncated"] = len(shown) < len(self.results)
        return out


def _error_samples(errors: Sequence[RequestResult], limit: int = 5) -> list[dict[str, Any]]:
    """Distinct error messages (first ``limit``), each with how often it occurred."""
    seen: dict[str, dict[str, Any]] = {}
    for r in errors:
        key = f"{r.error_kind}|{r.error}"
        if key not in seen:
            seen[key] = {"kind": r.error_kind, "message": r.error, "count": 0, "first_index": r.index}
        seen[key]["count"] += 1
    return list(seen.values())[:limit]


def _stat_line(label: str, stats: Mapping[str, Any], keys: Sequence[str]) -> str:
    if not stats or not stats.get("n"):
        return f"  {label:<14} (no samples)"
    parts = [f"{k} {fmt(float(stats[k]))}" for k in keys if stats.get(k) is not None]
    return f"  {label:<14} " + "  ".join(parts) + f"  (n={stats['n']})"


def _ceiling_line(dc: Optional[Mapping[str, Any]]) -> list[str]:
    if not dc or dc.get("ceiling_tokens_per_s") is None:
        return []
    m, eff = dc.get("measured_tokens_per_s"), dc.get("efficiency_pct")
    shown = "n/a" if m is None else fmt(float(m))
    pct = "" if eff is None else f" ({fmt(float(eff))}% of the ceiling)"
    return [f"  {'decode ceiling':<14} measured {shown} tok/s, ceiling {fmt(float(dc['ceiling_tokens_per_s']))}"
            f" tok/s{pct} = {float(dc['bandwidth_bytes_per_s']) / 1e9:.4g} GB/s / "
            f"{float(dc['active_weight_bytes_per_token']) / 1e9:.4g} GB per token"]


def render_text(
    report: "ProbeReport | Mapping[str, Any]",
    thresholds: Optional[SlaThresholds] = None,
    violations: Optional[Sequence[Violation]] = None,
) -> str:
    """Short human-readable report: stats, decode ceiling (when known), TTFT histogram,
    worst requests, errors, and with ``thresholds`` a table of every limit against the
    measured value and the verdict (violations are computed when not given)."""
    rep = report_dict(report)
    s = rep.get("settings") or {}
    lines = [
        f"FIM probe {rep.get('url')}  model={rep.get('model')}  run={rep.get('run_id')}",
        f"  {rep.get('ok')}/{rep.get('requests')} ok, {rep.get('errors')} error(s); "
        f"warmup {s.get('warmup')}, concurrency {s.get('concurrency')}, "
        f"max_tokens {s.get('max_tokens')}, took {fmt(float(rep.get('duration_s') or 0))} s",
        f"  TLS: {rep.get('tls')}",
    ]
    lines += [f"  WARNING: {w}" for w in rep.get("warnings") or []]
    if rep.get("aborted"):
        lines.append(f"  ABORTED: {rep['aborted']}")
    pct = ("p50", "p95", "p99", "max", "mean")
    lines += [
        f"Latency ({rep.get('percentile_method', PERCENTILE_METHOD)} percentiles):",
        _stat_line("TTFT ms", rep.get("ttft_ms") or {}, pct),
        _stat_line("inter-token ms", rep.get("itl_ms") or {}, pct),
        _stat_line("total ms", rep.get("total_ms") or {}, pct),
        _stat_line("decode tok/s", rep.get("decode_tokens_per_s") or {}, ("mean", "p50", "min")),
        *_ceiling_line(rep.get("decode_ceiling")),
        "TTFT histogram:",
        text_histogram(rep.get("ttft_histogram") or []),
    ]
    worst = rep.get("worst") or []
    if worst:
        lines.append("Worst requests (by TTFT):")
        lines += [f"  #{w['index']} {w['case']}: TTFT {fmt(float(w['ttft_ms']))} ms, "
                  f"total {fmt(float(w['total_ms'] or 0))} ms, {w.get('completion_tokens')} tok"
                  for w in worst[:3]]
    errs = rep.get("error_samples") or []
    if errs:
        lines.append(f"Errors ({rep.get('errors')}):")
        lines += [f"  {e['count']}x [{e['kind']}] {e['message']}" for e in errs]
    if thresholds is not None:
        lines += _sla_lines(rep, thresholds, evaluate(rep, thresholds) if violations is None else violations)
    return "\n".join(lines)


def _sla_lines(rep: Mapping[str, Any], thresholds: SlaThresholds, violations: Sequence[Violation]) -> list[str]:
    failed = {v.metric: v for v in violations}
    limits = judged_limits(thresholds)
    lines = ["SLA:"]
    for metric, limit in limits.items():
        m = measured(rep, metric)
        op = ">=" if metric.startswith("min_") else "<="
        shown = "n/a" if m is None else fmt(m)
        verdict = "FAIL" if metric in failed else "ok"
        lines.append(f"  {metric:<24} measured {shown:>9}  limit {op} {fmt(limit):<9} {verdict}")
    lines += [f"  {metric:<24} {v}  FAIL" for metric, v in failed.items() if metric not in limits]
    lines.append("SLA PASSED" if not violations else f"SLA MISSED ({len(violations)} violation(s)):")
    lines += [f"  - {v}" for v in violations]
    return lines


@dataclass
class SlaResult:
    """A probe report judged against an SLA."""

    report: ProbeReport
    thresholds: SlaThresholds
    violations: list[Violation]

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def summary(self) -> str:
        return render_text(self.report, self.thresholds, self.violations)


class SlaViolationError(Error):
    """The SLA was missed. ``str(exc)`` is the readable report (shown without a traceback)."""

    def __init__(self, summary: str, report: Optional[dict[str, Any]] = None):
        super().__init__(summary)
        self.summary = summary
        self.report = report


SlaViolationError.__module__ = "fimfleet"
