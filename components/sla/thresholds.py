"""A stack's FIM latency SLA (``SlaThresholds``) and its evaluation against a probe report.

``SlaThresholds`` is the one place that states which SLA limits are valid; the stack
config, the dynamic provider and the CLI all build one. ``evaluate`` works on a
``ProbeReport`` or on its ``to_dict()`` form (as kept in stack outputs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from components.sla.stats import fmt

TTFT_FIELDS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")


@dataclass(frozen=True)
class SlaThresholds:
    """FIM latency limits. Every limit is optional (None = not checked).

    If neither ``max_errors`` nor ``max_error_rate`` is set, any error fails the SLA.
    Invalid limits raise ValueError when the object is built, so a typed
    ``SlaThresholds`` is always valid.
    """

    ttft_p50_ms: Optional[float] = None
    """Upper limit for the median time to first token."""
    ttft_p95_ms: Optional[float] = None
    """Upper limit for p95 TTFT."""
    ttft_p99_ms: Optional[float] = None
    """Upper limit for p99 TTFT (nearest rank: the max when samples < 100)."""
    min_decode_tokens_per_s: Optional[float] = None
    """Lower limit for the median per-request decode rate, (tokens-1)/(total-TTFT); 0 = not checked."""
    min_decode_ceiling_fraction: Optional[float] = None
    """Lower limit for that median rate as a fraction of the node's decode ceiling (measured memory
    bandwidth / weight bytes read per token), in (0, 1]: the same SLA on any hardware."""
    max_error_rate: Optional[float] = None
    """Upper limit for errors / measured requests, in [0, 1]."""
    max_errors: Optional[int] = None
    """Upper limit for the number of failed measured requests."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(msg for _, msg in problems))

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every limit that is out of range."""
        errs: list[tuple[str, str]] = []
        for name in TTFT_FIELDS:
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and 0 < v < math.inf):
                errs.append((name, f"{name} must be a positive number, got {v!r}"))
        set_ttft = [(n, getattr(self, n)) for n in TTFT_FIELDS if getattr(self, n) is not None]
        if not errs and any(a[1] > b[1] for a, b in zip(set_ttft, set_ttft[1:])):
            errs.append(("ttft_p50_ms", "TTFT limits must not decrease from p50 to p95 to p99, got "
                         + ", ".join(f"{n}={v!r}" for n, v in set_ttft)))
        v = self.min_decode_tokens_per_s
        if v is not None and not (_is_number(v) and 0 <= v < math.inf):
            errs.append(("min_decode_tokens_per_s", f"min_decode_tokens_per_s must be a number >= 0, got {v!r}"))
        v = self.min_decode_ceiling_fraction
        if v is not None and not (_is_number(v) and 0 < v <= 1):
            errs.append(("min_decode_ceiling_fraction",
                         f"min_decode_ceiling_fraction must be a fraction in (0, 1], got {v!r}"))
        v = self.max_error_rate
        if v is not None and not (_is_number(v) and 0 <= v <= 1):
            errs.append(("max_error_rate", f"max_error_rate must be within [0, 1], got {v!r}"))
        v = self.max_errors
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            errs.append(("max_errors", f"max_errors must be an integer >= 0, got {v!r}"))
        return errs

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "SlaThresholds":
        """Build from a plain dict (Pulumi inputs send every number as a float); raises
        ValueError naming the bad key and value."""
        data = dict(data or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown SLA threshold key(s) {unknown}; valid keys: {', '.join(names)}")
        kwargs = {name: (as_int(v, name) if name == "max_errors" else as_float(v, name))
                  for name, v in data.items() if v is not None}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Only the limits that are set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def as_int(value: Any, name: str) -> int:
    """``value`` as an int (floats that are whole numbers and digit strings too)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def as_float(value: Any, name: str) -> float:
    """``value`` as a float; ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


@dataclass(frozen=True)
class Violation:
    """One missed SLA limit."""

    metric: str
    """Threshold name, e.g. ``ttft_p99_ms``."""
    measured: Optional[float]
    """Measured value (None when it could not be measured at all)."""
    limit: float
    """The configured limit."""
    detail: str = ""
    """Extra context (``no successful requests`` ...)."""

    def __str__(self) -> str:
        op = ">=" if self.metric.startswith("min_") else "<="
        measured = "n/a" if self.measured is None else fmt(self.measured)
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.metric}: measured {measured}, limit {op} {fmt(self.limit)}{extra}"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "measured": self.measured, "limit": self.limit,
                "detail": self.detail}


def report_dict(report: Any) -> Mapping[str, Any]:
    """The dict form of a ``ProbeReport`` (a dict is returned as is)."""
    return report if isinstance(report, Mapping) else report.to_dict(per_request=False)


def measured(rep: Mapping[str, Any], metric: str) -> Optional[float]:
    """The value in report dict ``rep`` that limit ``metric`` is judged on."""
    if metric in TTFT_FIELDS:
        return (rep.get("ttft_ms") or {}).get(metric[len("ttft_"):-len("_ms")])
    if metric == "min_decode_tokens_per_s":
        return (rep.get("decode_tokens_per_s") or {}).get("p50")
    if metric == "min_decode_ceiling_fraction":
        pct = (rep.get("decode_ceiling") or {}).get("efficiency_pct")
        return None if pct is None else pct / 100.0
    if metric == "max_error_rate":
        return rep.get("error_rate")
    if metric == "max_errors":
        return rep.get("errors")
    raise KeyError(metric)


def evaluate(report: Any, thresholds: SlaThresholds) -> list[Violation]:
    """Limits of ``thresholds`` that ``report`` misses (empty list = SLA met).

    A report without a single successful request always fails.
    """
    rep = report_dict(report)
    out: list[Violation] = []
    if not rep.get("ok"):
        out.append(Violation("ok_requests", int(rep.get("ok") or 0), 1,
                             f"no successful request out of {rep.get('requests', 0)}"))
    for metric in TTFT_FIELDS:
        limit = getattr(thresholds, metric)
        if limit is None:
            continue
        m = measured(rep, metric)
        if m is None:
            out.append(Violation(metric, None, limit, "no TTFT samples"))
        elif m > limit:
            out.append(Violation(metric, m, limit))
    min_tps = thresholds.min_decode_tokens_per_s
    if min_tps:  # None or 0 = not checked
        m = measured(rep, "min_decode_tokens_per_s")
        if m is None:
            out.append(Violation("min_decode_tokens_per_s", None, min_tps,
                                 "not measurable: no request produced 2+ tokens"))
        elif m < min_tps:
            out.append(Violation("min_decode_tokens_per_s", m, min_tps, "median per-request decode rate"))
    fraction = thresholds.min_decode_ceiling_fraction
    if fraction is not None:
        m = measured(rep, "min_decode_ceiling_fraction")
        if m is None:
            out.append(Violation("min_decode_ceiling_fraction", None, fraction,
                                 "no decode ceiling: the node's memory bandwidth was not measured, "
                                 "or no request produced 2+ tokens"))
        elif m < fraction:
            ceiling = (rep.get("decode_ceiling") or {}).get("ceiling_tokens_per_s")
            out.append(Violation("min_decode_ceiling_fraction", m, fraction,
                                 f"median decode rate / ceiling of {fmt(ceiling)} tok/s"))
    max_errors, max_rate = thresholds.max_errors, thresholds.max_error_rate
    if max_errors is None and max_rate is None:
        max_errors = 0
    if max_errors is not None and (rep.get("errors") or 0) > max_errors:
        out.append(Violation("max_errors", int(rep.get("errors") or 0), max_errors))
    if max_rate is not None and (rep.get("error_rate") or 0) > max_rate:
        out.append(Violation("max_error_rate", rep.get("error_rate"), max_rate))
    return out


def judged_limits(thresholds: SlaThresholds) -> dict[str, Any]:
    """The limits ``evaluate`` applies, including the implicit ``max_errors = 0``."""
    limits = thresholds.to_dict()
    if "max_errors" not in limits and "max_error_rate" not in limits:
        limits["max_errors"] = 0
    return limits
