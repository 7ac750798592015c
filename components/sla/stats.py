"""Statistics for the SLA probe: nearest-rank percentiles and a text histogram.

Pure functions, no I/O. Percentiles are always an observed value, so an SLA is judged
against a latency some request really had.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Iterable, Mapping, Optional, Sequence

PERCENTILE_METHOD = "nearest-rank"


def rounded(x: Optional[float], nd: int = 3) -> Optional[float]:
    """``x`` rounded for reports (None stays None)."""
    return None if x is None else round(float(x), nd)


def percentile(values: Iterable[float], p: float) -> Optional[float]:
    """Nearest-rank percentile of ``values`` (None when there are no values).

    Definition: sort the n values ascending; the p-th percentile (0 < p <= 100) is
    the value at 1-based rank ``ceil(p/100 * n)``, i.e. the smallest observed value
    such that at least p% of the observations are <= it. ``p == 0`` gives the
    minimum. The result is always an observed value (no interpolation), so with
    fewer than 100 samples p99 is the maximum: conservative, which is what an SLA
    gate wants. ``p/100 * n`` is computed exactly (``Fraction``), so 95% of 20 is
    rank 19, not 20 through float rounding.
    """
    if p < 0 or p > 100 or (isinstance(p, float) and math.isnan(p)):
        raise ValueError(f"percentile must be within [0, 100], got {p!r}")
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None
    if p == 0:
        return xs[0]
    rank = math.ceil(Fraction(str(p)) * n / 100)
    return xs[min(max(rank, 1), n) - 1]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """n, min, mean, p50, p95, p99, max of ``values`` (None entries when empty)."""
    xs = list(values)
    if not xs:
        return {"n": 0, "min": None, "mean": None, "p50": None, "p95": None,
                "p99": None, "max": None}
    return {
        "n": len(xs),
        "min": rounded(min(xs)),
        "mean": rounded(sum(xs) / len(xs)),
        "p50": rounded(percentile(xs, 50)),
        "p95": rounded(percentile(xs, 95)),
        "p99": rounded(percentile(xs, 99)),
        "max": rounded(max(xs)),
    }


def histogram_bins(values: Sequence[float], bins: int = 8) -> list[dict[str, Any]]:
    """Equal-width bins from min to max: ``[{"lo", "hi", "count"}, ...]``.

    Each bin is [lo, hi) except the last, which also holds the maximum. When all
    values are equal there is a single bin.
    """
    xs = sorted(values)
    if not xs:
        return []
    lo, hi = xs[0], xs[-1]
    if hi == lo or bins <= 1:
        return [{"lo": rounded(lo), "hi": rounded(hi), "count": len(xs)}]
    width = (hi - lo) / bins
    counts = [0] * bins
    for x in xs:
        counts[min(int((x - lo) / width), bins - 1)] += 1
    return [
        {"lo": rounded(lo + i * width), "hi": rounded(hi if i == bins - 1 else lo + (i + 1) * width),
         "count": c}
        for i, c in enumerate(counts)
    ]


def text_histogram(bins: Sequence[Mapping[str, Any]], width: int = 30, unit: str = "ms") -> str:
    """Render ``histogram_bins`` output as text, one line per bin::

        12.0 -   15.3 ms |##############################| 8
    """
    if not bins:
        return "  (no samples)"
    peak = max(int(b["count"]) for b in bins) or 1
    lines = []
    for b in bins:
        count = int(b["count"])
        bar = round(count / peak * width)
        if count and not bar:
            bar = 1
        lines.append(
            f"  {float(b['lo']):>9.1f} - {float(b['hi']):>9.1f} {unit} |{'#' * bar:<{width}}| {count}"
        )
    return "\n".join(lines)


def fmt(x: Any) -> str:
    """A number as reports print it: 4 significant digits below 1, one decimal above."""
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1 else f"{x:.1f}"
    return str(x)
