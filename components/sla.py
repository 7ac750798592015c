"""FIM latency SLA: a streaming probe, SLA evaluation, and the ``FimSlaCheck`` gate.

Three layers, each usable on its own:

1. The probe (``ProbeConfig`` -> ``run_probe`` -> ``ProbeReport``). ONE httpx client
   speaking HTTP/1.1 with keepalive (as an editor plugin does) streams FIM requests
   to ``/v1/completions``: prompt ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``,
   stop tokens, ``stream: true``, ``stream_options.include_usage``, temperature 0,
   ``max_tokens``, the model name and ``Authorization: Bearer <key>``. For each
   request it measures TTFT (send -> first SSE chunk whose text is non-empty), the
   gaps between content chunks, the total time (send -> ``[DONE]``), completion
   tokens (from the final usage chunk; SSE chunks can merge tokens) and decode
   tokens/s = (tokens - 1) / (total - TTFT). Warmup requests run first and are not
   counted. Every request gets a unique first line, so prefix caching cannot help.
   Timeouts are bounded everywhere: connect, read (per socket read), and an overall
   deadline per request enforced with ``asyncio.wait_for``; a stalled engine shows up
   as errors in the report, it never hangs the probe. After ``max_consecutive_errors``
   failures in a row the remaining requests are not sent and are counted as errors.

2. SLA evaluation (``SlaThresholds``, ``evaluate``, ``render_text``). Percentiles are
   nearest-rank (see ``percentile``).

3. The Pulumi gate: ``FimSlaCheck`` (a ``pulumi.dynamic.Resource``) and its
   ``FimSlaCheckProvider``. create/update run the probe and raise ``SlaViolationError``
   (whose message is the readable report) when the SLA is missed; ``diff`` re-runs the
   check only when the upstream ``trigger`` or a probe input changes.

CLI: ``python -m components.sla --endpoint https://host:port --key-env FIMFLEET_KEY
--model NAME [--ca FILE] ...``; exit code 0 = SLA met, 1 = SLA missed, 2 = bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import ssl
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fractions import Fraction
from typing import Any, Iterable, Mapping, Optional, Sequence

import httpx
import pulumi
import pulumi.dynamic
from pulumi.runtime.rpc import UNKNOWN as _PULUMI_UNKNOWN

from components import fim_corpus
from components.fim_corpus import FimCase

__all__ = [
    "DEFAULT_STOP",
    "PERCENTILE_METHOD",
    "ProbeConfig",
    "RequestResult",
    "ProbeReport",
    "SlaThresholds",
    "Violation",
    "SlaResult",
    "SlaViolationError",
    "percentile",
    "summarize",
    "histogram_bins",
    "text_histogram",
    "run_probe",
    "run_probe_async",
    "evaluate",
    "render_text",
    "check_sla",
    "FimSlaCheckProvider",
    "FimSlaCheck",
    "main",
]

DEFAULT_STOP: tuple[str, ...] = (
    "<|endoftext|>",
    "<|file_sep|>",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
)
"""Stop strings for Qwen2.5-Coder FIM: end of text, or the model starting another file or FIM
frame. The OpenAI schema that vLLM enforces allows at most 4 stop strings (a 5th is HTTP 400)."""

PERCENTILE_METHOD = "nearest-rank"
USER_AGENT = "fimfleet-sla-probe/1"
_MAX_ERROR_CHARS = 300


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------


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
        "min": _r(min(xs)),
        "mean": _r(sum(xs) / len(xs)),
        "p50": _r(percentile(xs, 50)),
        "p95": _r(percentile(xs, 95)),
        "p99": _r(percentile(xs, 99)),
        "max": _r(max(xs)),
    }


def _r(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(float(x), nd)


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
        return [{"lo": _r(lo), "hi": _r(hi), "count": len(xs)}]
    width = (hi - lo) / bins
    counts = [0] * bins
    for x in xs:
        i = min(int((x - lo) / width), bins - 1)
        counts[i] += 1
    return [
        {"lo": _r(lo + i * width), "hi": _r(hi if i == bins - 1 else lo + (i + 1) * width),
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


# --------------------------------------------------------------------------------------
# Probe configuration and results
# --------------------------------------------------------------------------------------


@dataclass
class ProbeConfig:
    """Everything the probe needs. Only ``endpoint`` and ``model`` are required."""

    endpoint: str
    """Base URL of the ingress, e.g. ``https://10.0.0.5:8443``. ``/v1/completions`` is
    appended (a URL already ending in ``/v1`` or ``/v1/completions`` is used as is)."""
    model: str
    """``model`` field of the request (vLLM's ``--served-model-name``)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """Bearer key. Never printed, and redacted from error messages."""
    ca_pem: Optional[str] = field(default=None, repr=False)
    """CA bundle or the server certificate itself, as PEM text or a file path. If
    unset, https is verified against the default (certifi) trust store."""
    insecure_skip_verify: bool = False
    """Disable TLS verification. Only when explicitly set; the report says so."""
    tls_server_name: Optional[str] = None
    """SNI / hostname to verify, when the endpoint is an IP but the cert has a name."""
    samples: int = 20
    """Measured requests (0 = warmup only)."""
    warmup: int = 2
    """Requests sent first and not counted (connection setup, first-request costs)."""
    concurrency: int = 1
    """Requests in flight at once (1 = sequential, as a single editor does)."""
    max_tokens: int = 16
    """``max_tokens`` of each request."""
    max_prompt_chars: Optional[int] = 512
    """Cap on prefix+suffix characters of each prompt (None = whole case)."""
    connect_timeout_s: float = 10.0
    """TCP + TLS connect timeout."""
    read_timeout_s: float = 30.0
    """Longest wait for any single read (headers or the next SSE bytes)."""
    request_timeout_s: float = 60.0
    """Hard deadline for one request, send -> end of stream."""
    total_timeout_s: Optional[float] = None
    """Optional budget for the whole probe; requests not started in time are errors."""
    max_consecutive_errors: int = 5
    """Stop sending after this many failures in a row (0 = never stop early)."""
    stop: tuple[str, ...] = DEFAULT_STOP
    """Stop strings of each request."""
    run_id: Optional[str] = None
    """Tag put in every prompt's unique first line (random when None)."""
    corpus: Optional[Sequence[FimCase]] = field(default=None, repr=False)
    """FIM cases to cycle through (default: ``fim_corpus.CORPUS``)."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Extra JSON fields merged into each request body (vendor parameters)."""

    @property
    def url(self) -> str:
        base = self.endpoint.rstrip("/")
        if base.endswith("/v1/completions"):
            return base
        if base.endswith("/v1"):
            return base + "/completions"
        return base + "/v1/completions"

    def validate(self) -> list[str]:
        """Problems with this config, as readable strings (empty when valid)."""
        errs: list[str] = []
        if not isinstance(self.endpoint, str) or not self.endpoint.startswith(("http://", "https://")):
            errs.append(f"endpoint must be an http:// or https:// URL, got {self.endpoint!r}")
        if not self.model or not isinstance(self.model, str):
            errs.append("model must be a non-empty string")
        for name, lo in (("samples", 0), ("warmup", 0), ("concurrency", 1), ("max_tokens", 1),
                         ("max_consecutive_errors", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                errs.append(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.max_prompt_chars is not None and (
            not isinstance(self.max_prompt_chars, int) or self.max_prompt_chars < 16
        ):
            errs.append(f"max_prompt_chars must be None or an integer >= 16, got {self.max_prompt_chars!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf:
                errs.append(f"{name} must be a positive finite number of seconds, got {v!r}")
        if self.total_timeout_s is not None and not (
            isinstance(self.total_timeout_s, (int, float)) and 0 < self.total_timeout_s < math.inf
        ):
            errs.append(f"total_timeout_s must be None or positive, got {self.total_timeout_s!r}")
        if self.insecure_skip_verify and self.ca_pem:
            errs.append("set either ca_pem or insecure_skip_verify, not both")
        if self.ca_pem and "-----BEGIN" not in self.ca_pem and not os.path.isfile(self.ca_pem):
            errs.append("ca_pem must be PEM text or the path of an existing file")
        return errs


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
            "ttft_ms": _r(self.ttft_ms),
            "total_ms": _r(self.total_ms),
            "max_gap_ms": _r(max(self.gaps_ms)) if self.gaps_ms else None,
            "completion_tokens": self.completion_tokens,
            "decode_tokens_per_s": _r(self.decode_tps, 2),
            "prompt_chars": self.prompt_chars,
            "finish_reason": self.finish_reason,
            "error_kind": self.error_kind,
            "error": self.error,
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
        tps_stats = summarize(tps)
        tps_stats = {k: (_r(v, 2) if isinstance(v, float) else v) for k, v in tps_stats.items()}
        worst = sorted((r for r in ok if r.ttft_ms is not None), key=lambda r: -r.ttft_ms)[:5]
        out: dict[str, Any] = {
            "version": 1,
            "endpoint": self.endpoint,
            "url": self.url,
            "model": self.model,
            "run_id": self.run_id,
            "started_at": self.started_at,
            "duration_s": _r(self.duration_s),
            "settings": dict(self.settings),
            "tls": self.tls,
            "insecure_skip_verify": self.insecure_skip_verify,
            "percentile_method": PERCENTILE_METHOD,
            "requests": n,
            "ok": len(ok),
            "errors": len(errors),
            "error_rate": _r(len(errors) / n, 4) if n else 0.0,
            "empty_completions": sum(1 for r in ok if r.content_chunks == 0),
            "warmup_errors": sum(1 for r in self.warmup_results if not r.ok),
            "ttft_ms": summarize(ttfts),
            "itl_ms": summarize(gaps),
            "total_ms": summarize(totals),
            "decode_tokens_per_s": tps_stats,
            "completion_tokens": {
                "sum": sum(tokens),
                "mean": _r(sum(tokens) / len(tokens), 2) if tokens else None,
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
            seen[key] = {"kind": r.error_kind, "message": r.error, "count": 0,
                         "first_index": r.index}
        seen[key]["count"] += 1
    return list(seen.values())[:limit]


# --------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------


def _tls_settings(cfg: ProbeConfig) -> tuple[Any, str]:
    """(httpx ``verify`` value, human description) for the endpoint."""
    if cfg.endpoint.startswith("http://"):
        return True, "none (plain http)"
    if cfg.insecure_skip_verify:
        return False, "https, VERIFICATION DISABLED (insecure_skip_verify=True)"
    if cfg.ca_pem:
        if "-----BEGIN" in cfg.ca_pem:
            ctx = ssl.create_default_context(cadata=cfg.ca_pem)
            desc = "https, verified against ca_pem (PEM text)"
        else:
            ctx = ssl.create_default_context(cafile=cfg.ca_pem)
            desc = f"https, verified against ca_pem file {cfg.ca_pem}"
        # Lets ca_pem be the server's own (self-signed or leaf) certificate.
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return ctx, desc
    try:
        import certifi

        ctx = ssl.create_default_context(cafile=certifi.where())
    except ImportError:  # pragma: no cover - certifi ships with httpx
        ctx = ssl.create_default_context()
    return ctx, "https, verified against the default trust store"


def _redact(text: str, secret: Optional[str]) -> str:
    if secret and len(secret) >= 4:
        text = text.replace(secret, "<redacted>")
    return text


def _classify(exc: BaseException, cfg: ProbeConfig) -> tuple[str, str]:
    msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout", f"connect timed out after {cfg.connect_timeout_s:g} s"
    if isinstance(exc, httpx.ReadTimeout):
        return "read_timeout", f"no data for {cfg.read_timeout_s:g} s (read timeout)"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", msg
    if isinstance(exc, httpx.ConnectError):
        low = str(exc).lower()
        if "certificate" in low or "ssl" in low or "tls" in low or "handshake" in low:
            return "tls", msg
        return "connect", msg
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.LocalProtocolError)):
        return "protocol", msg
    if isinstance(exc, httpx.ReadError):
        return "read_error", msg
    if isinstance(exc, (json.JSONDecodeError, ValueError)):
        return "protocol", f"bad SSE payload: {msg}"
    return "client", msg


@dataclass
class _Job:
    index: int
    case: FimCase
    prompt: str
    warmup: bool


@dataclass
class _RunState:
    deadline: Optional[float]
    max_consecutive: int
    consecutive_errors: int = 0
    abort_reason: Optional[str] = None


def _jobs(cfg: ProbeConfig, run_id: str, n: int, warmup: bool) -> list[_Job]:
    cases = list(cfg.corpus) if cfg.corpus else list(fim_corpus.CORPUS)
    jobs = []
    for i in range(n):
        # Warmup and measured requests walk the corpus from different offsets.
        case = cases[(i + (len(cases) // 2 if warmup else 0)) % len(cases)]
        tag = f"fimfleet-probe {run_id} {'w' if warmup else 'm'}{i:04d}"
        jobs.append(_Job(i, case, fim_corpus.build_prompt(case, tag, cfg.max_prompt_chars), warmup))
    return jobs


async def _read_snippet(resp: httpx.Response, limit: int = 2000) -> str:
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) >= limit:
            break
    return buf[:limit].decode("utf-8", "replace").strip().replace("\n", " ")


async def _one_request(
    client: httpx.AsyncClient, cfg: ProbeConfig, job: _Job, r: RequestResult
) -> None:
    """Send one streaming FIM request and fill ``r`` in as data arrives.

    ``r`` is filled progressively so that a request cancelled by its deadline
    still reports what it got (e.g. the TTFT before a stall).
    """
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": job.prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": list(cfg.stop),
    }
    body.update(cfg.extra_body)
    payload = json.dumps(body).encode()
    extensions = {"sni_hostname": cfg.tls_server_name} if cfg.tls_server_name else None
    content_times: list[float] = []
    usage_tokens: Optional[int] = None
    saw_done = False
    t_done: Optional[float] = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", cfg.url, content=payload, extensions=extensions) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.fail("http", f"HTTP {resp.status_code}: {await _read_snippet(resp)}")
                return
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if saw_done or not line.startswith("data:"):
                    continue  # blank separators, ": keepalive" comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    saw_done, t_done = True, now
                    continue  # keep reading to the end so the connection is reusable
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError(f"SSE data is not an object: {data[:80]}")
                if obj.get("error"):
                    err = obj["error"]
                    detail = err.get("message", err) if isinstance(err, dict) else err
                    r.fail("stream_error", f"error event in stream: {detail}")
                    return
                usage = obj.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        r.prompt_tokens = int(usage["prompt_tokens"])
                has_text = False
                for choice in obj.get("choices") or []:
                    text = choice.get("text") or ""
                    if text:
                        has_text = True
                        r.text_chars += len(text)
                    if choice.get("finish_reason"):
                        r.finish_reason = choice["finish_reason"]
                if has_text:
                    content_times.append(now)
                    r.content_chunks += 1
                    if len(content_times) == 1:
                        r.ttft_ms = (now - t0) * 1000.0
                    else:
                        r.gaps_ms.append((now - content_times[-2]) * 1000.0)
            t_end = time.perf_counter()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a report entry
        kind, msg = _classify(exc, cfg)
        r.fail(kind, _redact(msg, cfg.api_key))
        return
    if not saw_done and r.finish_reason is None:
        r.fail("protocol", "stream ended without [DONE] or a finish_reason (truncated?)")
        return
    r.total_ms = ((t_done or t_end) - t0) * 1000.0
    if usage_tokens is not None:
        r.completion_tokens, r.tokens_from_usage = usage_tokens, True
    else:
        r.completion_tokens, r.tokens_from_usage = r.content_chunks, False
    r.ok = True


async def _run_phase(
    client: httpx.AsyncClient, cfg: ProbeConfig, jobs: list[_Job], state: _RunState
) -> list[RequestResult]:
    pending = list(jobs)
    results: list[RequestResult] = []

    async def worker() -> None:
        while pending:
            job = pending.pop(0)
            r = RequestResult(job.index, job.case.name, job.case.language, warmup=job.warmup,
                              prompt_chars=len(job.prompt))
            results.append(r)
            timeout = cfg.request_timeout_s
            if state.deadline is not None and state.abort_reason is None:
                remaining = state.deadline - time.perf_counter()
                if remaining <= 0:
                    state.abort_reason = f"probe time budget of {cfg.total_timeout_s:g} s exhausted"
                timeout = min(timeout, max(remaining, 0.001))
            if state.abort_reason:
                r.fail("aborted", f"not sent: {state.abort_reason}")
                continue
            try:
                await asyncio.wait_for(_one_request(client, cfg, job, r), timeout)
            except asyncio.TimeoutError:
                got = f"; first token after {r.ttft_ms:.0f} ms" if r.ttft_ms is not None else ""
                r.fail("deadline", f"request exceeded its {timeout:g} s deadline{got}")
            if r.ok:
                state.consecutive_errors = 0
            else:
                state.consecutive_errors += 1
                if state.max_consecutive and state.consecutive_errors >= state.max_consecutive:
                    state.abort_reason = (
                        f"aborted after {state.consecutive_errors} consecutive errors"
                    )

    workers = max(1, min(cfg.concurrency, len(jobs)))
    await asyncio.gather(*(worker() for _ in range(workers)))
    results.sort(key=lambda r: r.index)
    return results


async def run_probe_async(config: ProbeConfig) -> ProbeReport:
    """Async form of ``run_probe`` (for callers that already run an event loop)."""
    problems = config.validate()
    if problems:
        raise ValueError("invalid probe config: " + "; ".join(problems))
    run_id = config.run_id or uuid.uuid4().hex[:12]
    verify, tls_desc = _tls_settings(config)
    headers = {
        "Accept": "text/event-stream",
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
    }
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    timeout = httpx.Timeout(
        connect=config.connect_timeout_s,
        read=config.read_timeout_s,
        write=config.read_timeout_s,
        pool=config.request_timeout_s,
    )
    limits = httpx.Limits(
        max_connections=config.concurrency,
        max_keepalive_connections=config.concurrency,
        keepalive_expiry=300.0,
    )
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    state = _RunState(
        deadline=(t_start + config.total_timeout_s) if config.total_timeout_s else None,
        max_consecutive=config.max_consecutive_errors,
    )
    async with httpx.AsyncClient(
        http1=True, http2=False, verify=verify, timeout=timeout, limits=limits,
        headers=headers, trust_env=False, follow_redirects=False,
    ) as client:
        warm = await _run_phase(client, config, _jobs(config, run_id, config.warmup, True), state)
        measured = await _run_phase(client, config, _jobs(config, run_id, config.samples, False), state)
    duration = time.perf_counter() - t_start

    warnings: list[str] = []
    if config.insecure_skip_verify and not config.endpoint.startswith("http://"):
        warnings.append("TLS certificate verification was DISABLED (insecure_skip_verify=True)")
    if config.endpoint.startswith("http://"):
        warnings.append("plain http: the probe did not go through TLS")
    ok = [r for r in measured if r.ok]
    if ok and not all(r.tokens_from_usage for r in ok):
        warnings.append(
            "usage missing from the stream (stream_options.include_usage ignored?): "
            "tokens were counted from SSE chunks, which can merge tokens"
        )
    empty = sum(1 for r in ok if r.content_chunks == 0)
    if empty:
        warnings.append(f"{empty} completion(s) returned no text; they have no TTFT")
    warm_errors = [r for r in warm if not r.ok]
    if warm_errors:
        warnings.append(
            f"{len(warm_errors)} of {len(warm)} warmup request(s) failed, "
            f"first: {warm_errors[0].error}"
        )
    settings = {
        "samples": config.samples,
        "warmup": config.warmup,
        "concurrency": config.concurrency,
        "max_tokens": config.max_tokens,
        "max_prompt_chars": config.max_prompt_chars,
        "connect_timeout_s": config.connect_timeout_s,
        "read_timeout_s": config.read_timeout_s,
        "request_timeout_s": config.request_timeout_s,
        "total_timeout_s": config.total_timeout_s,
        "max_consecutive_errors": config.max_consecutive_errors,
    }
    return ProbeReport(
        endpoint=config.endpoint,
        url=config.url,
        model=config.model,
        run_id=run_id,
        started_at=started_at,
        duration_s=duration,
        settings=settings,
        tls=tls_desc,
        insecure_skip_verify=bool(config.insecure_skip_verify),
        results=measured,
        warmup_results=warm,
        warnings=warnings,
        aborted=state.abort_reason,
    )


def run_probe(config: ProbeConfig) -> ProbeReport:
    """Run warmup + measured FIM requests against ``config.endpoint``; never hangs.

    The probe always runs on a private event loop in a worker thread, so the
    caller's thread and its event-loop state are untouched: safe from the Pulumi
    dynamic-provider host, from a Pulumi program's main thread (whose loop Pulumi
    owns), and from inside a running event loop.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fim-probe") as pool:
        return pool.submit(asyncio.run, run_probe_async(config)).result()


# --------------------------------------------------------------------------------------
# SLA thresholds and evaluation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlaThresholds:
    """A stack's FIM latency SLA. Every limit is optional (None = not checked).

    If neither ``max_errors`` nor ``max_error_rate`` is set, any error fails the SLA.
    The sample settings (``samples``, ``warmup``, ``concurrency``, ``max_tokens``), when
    set, override the probe config they are applied to (see ``apply_to``).
    """

    ttft_p50_ms: Optional[float] = None
    """Upper limit for the median time to first token."""
    ttft_p95_ms: Optional[float] = None
    """Upper limit for p95 TTFT."""
    ttft_p99_ms: Optional[float] = None
    """Upper limit for p99 TTFT (nearest rank: the max when samples < 100)."""
    min_decode_tokens_per_s: Optional[float] = None
    """Lower limit for the median per-request decode rate, (tokens-1)/(total-TTFT)."""
    max_error_rate: Optional[float] = None
    """Upper limit for errors / measured requests, in [0, 1]."""
    max_errors: Optional[int] = None
    """Upper limit for the number of failed measured requests."""
    samples: Optional[int] = None
    """Measured requests."""
    warmup: Optional[int] = None
    """Uncounted warmup requests."""
    concurrency: Optional[int] = None
    """Requests in flight at once."""
    max_tokens: Optional[int] = None
    """``max_tokens`` per request."""

    LIMIT_FIELDS = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "min_decode_tokens_per_s",
                    "max_error_rate", "max_errors")
    SAMPLE_FIELDS = ("samples", "warmup", "concurrency", "max_tokens")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "SlaThresholds":
        """Build from a plain dict (stack config); raises ValueError on bad keys/values."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown SLA threshold key(s) {unknown}; valid keys: {', '.join(cls.field_names())}"
            )
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if value is None:
                continue
            if name in ("max_errors",) + cls.SAMPLE_FIELDS:
                kwargs[name] = _as_int(value, name)
            else:
                kwargs[name] = _as_float(value, name)
        th = cls(**kwargs)
        problems = th.validate()
        if problems:
            raise ValueError("; ".join(problems))
        return th

    def validate(self) -> list[str]:
        errs = []
        for name in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and v < math.inf):
                errs.append(f"{name} must be a positive number, got {v!r}")
        v = self.min_decode_tokens_per_s
        if v is not None and not (v >= 0 and v < math.inf):
            errs.append(f"min_decode_tokens_per_s must be a number >= 0, got {v!r}")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            errs.append(f"max_error_rate must be within [0, 1], got {self.max_error_rate!r}")
        for name, lo in (("max_errors", 0), ("samples", 1), ("warmup", 0), ("concurrency", 1),
                         ("max_tokens", 1)):
            v = getattr(self, name)
            if v is not None and v < lo:
                errs.append(f"{name} must be >= {lo}, got {v!r}")
        if self.min_decode_tokens_per_s is not None and self.max_tokens is not None and self.max_tokens < 2:
            errs.append("min_decode_tokens_per_s needs max_tokens >= 2 (decode rate needs 2 tokens)")
        return errs

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that are set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def limits(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if k in self.LIMIT_FIELDS}

    def apply_to(self, config: ProbeConfig) -> ProbeConfig:
        """``config`` with this SLA's sample settings (those that are set) applied."""
        changes = {k: getattr(self, k) for k in self.SAMPLE_FIELDS if getattr(self, k) is not None}
        return dataclasses.replace(config, **changes)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def _as_float(value: Any, name: str) -> float:
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
        measured = "n/a" if self.measured is None else _fmt(self.measured)
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.metric}: measured {measured}, limit {op} {_fmt(self.limit)}{extra}"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "measured": self.measured, "limit": self.limit,
                "detail": self.detail}


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1 else f"{x:.1f}"
    return str(x)


def _report_dict(report: "ProbeReport | Mapping[str, Any]") -> Mapping[str, Any]:
    return report.to_dict(per_request=False) if isinstance(report, ProbeReport) else report


def _measured(rep: Mapping[str, Any], metric: str) -> Optional[float]:
    if metric.startswith("ttft_p"):
        return (rep.get("ttft_ms") or {}).get(metric[len("ttft_"):-len("_ms")])
    if metric == "min_decode_tokens_per_s":
        return (rep.get("decode_tokens_per_s") or {}).get("p50")
    if metric == "max_error_rate":
        return rep.get("error_rate")
    if metric == "max_errors":
        return rep.get("errors")
    raise KeyError(metric)


def evaluate(report: "ProbeReport | Mapping[str, Any]", thresholds: SlaThresholds) -> list[Violation]:
    """Limits of ``thresholds`` that ``report`` misses (empty list = SLA met).

    ``report`` may be a ``ProbeReport`` or its ``to_dict()`` form (e.g. from stack
    outputs). A report without a single successful request always fails.
    """
    rep = _report_dict(report)
    out: list[Violation] = []
    if not rep.get("ok"):
        out.append(Violation("ok_requests", int(rep.get("ok") or 0), 1,
                             f"no successful request out of {rep.get('requests', 0)}"))
    for metric in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"):
        limit = getattr(thresholds, metric)
        if limit is None:
            continue
        m = _measured(rep, metric)
        if m is None:
            out.append(Violation(metric, None, limit, "no TTFT samples"))
        elif m > limit:
            out.append(Violation(metric, m, limit))
    if thresholds.min_decode_tokens_per_s:  # None or 0 = not checked
        m = _measured(rep, "min_decode_tokens_per_s")
        if m is None:
            out.append(Violation("min_decode_tokens_per_s", None, thresholds.min_decode_tokens_per_s,
                                 "not measurable: no request produced 2+ tokens"))
        elif m < thresholds.min_decode_tokens_per_s:
            out.append(Violation("min_decode_tokens_per_s", m, thresholds.min_decode_tokens_per_s,
                                 "median per-request decode rate"))
    max_errors, max_rate = thresholds.max_errors, thresholds.max_error_rate
    if max_errors is None and max_rate is None:
        max_errors = 0
    if max_errors is not None and (rep.get("errors") or 0) > max_errors:
        out.append(Violation("max_errors", int(rep.get("errors") or 0), max_errors))
    if max_rate is not None and (rep.get("error_rate") or 0) > max_rate:
        out.append(Violation("max_error_rate", rep.get("error_rate"), max_rate))
    return out


def _stat_line(label: str, stats: Mapping[str, Any], keys: Sequence[str]) -> str:
    if not stats or not stats.get("n"):
        return f"  {label:<14} (no samples)"
    parts = [f"{k} {_fmt(float(stats[k]))}" for k in keys if stats.get(k) is not None]
    return f"  {label:<14} " + "  ".join(parts) + f"  (n={stats['n']})"


def render_text(
    report: "ProbeReport | Mapping[str, Any]",
    thresholds: Optional[SlaThresholds] = None,
    violations: Optional[Sequence[Violation]] = None,
) -> str:
    """Short human-readable report: stats, TTFT histogram, worst requests, errors, SLA.

    With ``thresholds`` it ends with a table of every configured limit against the
    measured value and the verdict (violations are computed when not given).
    """
    rep = _report_dict(report)
    s = rep.get("settings") or {}
    lines = [
        f"FIM probe {rep.get('url')}  model={rep.get('model')}  run={rep.get('run_id')}",
        f"  {rep.get('ok')}/{rep.get('requests')} ok, {rep.get('errors')} error(s); "
        f"warmup {s.get('warmup')}, concurrency {s.get('concurrency')}, "
        f"max_tokens {s.get('max_tokens')}, took {_fmt(float(rep.get('duration_s') or 0))} s",
        f"  TLS: {rep.get('tls')}",
    ]
    for w in rep.get("warnings") or []:
        lines.append(f"  WARNING: {w}")
    if rep.get("aborted"):
        lines.append(f"  ABORTED: {rep['aborted']}")
    pct = ("p50", "p95", "p99", "max", "mean")
    lines += [
        f"Latency ({rep.get('percentile_method', PERCENTILE_METHOD)} percentiles):",
        _stat_line("TTFT ms", rep.get("ttft_ms") or {}, pct),
        _stat_line("inter-token ms", rep.get("itl_ms") or {}, pct),
        _stat_line("total ms", rep.get("total_ms") or {}, pct),
        _stat_line("decode tok/s", rep.get("decode_tokens_per_s") or {}, ("mean", "p50", "min")),
        "TTFT histogram:",
        text_histogram(rep.get("ttft_histogram") or []),
    ]
    worst = rep.get("worst") or []
    if worst:
        lines.append("Worst requests (by TTFT):")
        for w in worst[:3]:
            lines.append(
                f"  #{w['index']} {w['case']}: TTFT {_fmt(float(w['ttft_ms']))} ms, "
                f"total {_fmt(float(w['total_ms'] or 0))} ms, {w.get('completion_tokens')} tok"
            )
    errs = rep.get("error_samples") or []
    if errs:
        lines.append(f"Errors ({rep.get('errors')}):")
        for e in errs:
            lines.append(f"  {e['count']}x [{e['kind']}] {e['message']}")
    if thresholds is not None:
        if violations is None:
            violations = evaluate(rep, thresholds)
        failed = {v.metric: v for v in violations}
        lines.append("SLA:")
        limits = thresholds.limits()
        if "max_errors" not in limits and "max_error_rate" not in limits:
            limits["max_errors"] = 0
        for metric, limit in limits.items():
            m = _measured(rep, metric)
            op = ">=" if metric.startswith("min_") else "<="
            verdict = "FAIL" if metric in failed else "ok"
            shown = "n/a" if m is None else _fmt(m)
            lines.append(f"  {metric:<24} measured {shown:>9}  limit {op} {_fmt(limit):<9} {verdict}")
        for metric, v in failed.items():
            if metric not in limits:
                lines.append(f"  {metric:<24} {v}  FAIL")
        lines.append("SLA PASSED" if not violations else f"SLA MISSED ({len(violations)} violation(s)):")
        for v in violations:
            lines.append(f"  - {v}")
    return "\n".join(lines)


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


class SlaViolationError(Exception):
    """The SLA was missed. ``str(exc)`` is the readable report."""

    def __init__(self, summary: str, report: Optional[dict[str, Any]] = None):
        super().__init__(summary)
        self.summary = summary
        self.report = report


def check_sla(config: ProbeConfig, thresholds: SlaThresholds) -> SlaResult:
    """Apply the SLA's sample settings to ``config``, run the probe, and judge it."""
    report = run_probe(thresholds.apply_to(config))
    return SlaResult(report, thresholds, evaluate(report, thresholds))


# --------------------------------------------------------------------------------------
# Pulumi dynamic provider
# --------------------------------------------------------------------------------------

_PROBE_OPTION_KEYS = (
    "max_prompt_chars", "connect_timeout_s", "read_timeout_s", "request_timeout_s",
    "total_timeout_s", "max_consecutive_errors", "tls_server_name",
)
_INPUT_KEYS = (
    "endpoint", "api_key", "ca_pem", "model", "thresholds", "samples", "warmup",
    "concurrency", "max_tokens", "insecure_skip_verify", "probe_options", "trigger",
)
_OUTPUT_ONLY_KEYS = ("report", "summary", "passed", "api_key_sha256")
_DIFF_KEYS = (
    "trigger", "endpoint", "model", "thresholds", "samples", "warmup", "concurrency",
    "max_tokens", "ca_pem", "insecure_skip_verify", "probe_options",
)
_DEFAULTS = ProbeConfig(endpoint="http://unused", model="unused")
_MAX_PER_REQUEST_IN_STATE = 100  # keeps stack state small for large sample counts


def _key_hash(api_key: Any) -> Optional[str]:
    if api_key is None or api_key == "":
        return None
    return hashlib.sha256(b"fimfleet-sla-key:" + str(api_key).encode()).hexdigest()


def _is_unknown(value: Any) -> bool:
    if value == _PULUMI_UNKNOWN:
        return True
    if isinstance(value, dict):
        return any(_is_unknown(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_is_unknown(v) for v in value)
    return False


def _normalize_props(props: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Canonical inputs (+ failures as (property, reason)).

    Pulumi sends numbers as floats; everything is coerced to a canonical form so that
    ``diff`` compares like with like. Sample settings given inside ``thresholds`` are
    moved to the top level. Unknown (preview) values are passed through untouched.
    """
    failures: list[tuple[str, str]] = []
    out: dict[str, Any] = {}
    for key in props:
        if key not in _INPUT_KEYS and key not in _OUTPUT_ONLY_KEYS and key != "__provider":
            failures.append((key, f"unknown input; valid inputs: {', '.join(_INPUT_KEYS)}"))

    def get(key: str) -> Any:
        return props.get(key)

    for key in ("endpoint", "model", "trigger"):
        v = get(key)
        if _is_unknown(v):
            out[key] = v
        elif not isinstance(v, str) or not v:
            failures.append((key, f"{key} is required (a non-empty string)"))
        else:
            out[key] = v
    if isinstance(out.get("endpoint"), str) and not _is_unknown(out["endpoint"]):
        if not out["endpoint"].startswith(("http://", "https://")):
            failures.append(("endpoint", "endpoint must start with https:// (or http://)"))
    for key in ("api_key", "ca_pem"):
        v = get(key)
        if v not in (None, ""):
            out[key] = v
    if "api_key" not in out:
        failures.append(("api_key", "api_key is required (pass it as a secret)"))
    out["insecure_skip_verify"] = bool(get("insecure_skip_verify") or False)
    if out["insecure_skip_verify"] and out.get("ca_pem"):
        failures.append(("insecure_skip_verify", "set either ca_pem or insecure_skip_verify, not both"))

    # thresholds: limits stay in `thresholds`, sample settings move to the top level.
    raw_th = get("thresholds")
    th_dict: dict[str, Any] = {}
    if _is_unknown(raw_th):
        out["thresholds"] = raw_th
    else:
        try:
            th = SlaThresholds.from_dict(raw_th or {})
            th_dict = th.to_dict()
        except ValueError as exc:
            failures.append(("thresholds", str(exc)))
        out["thresholds"] = {k: v for k, v in th_dict.items() if k in SlaThresholds.LIMIT_FIELDS}
    for key in SlaThresholds.SAMPLE_FIELDS:
        v = get(key)
        if _is_unknown(v):
            out[key] = v
            continue
        if v is not None:
            try:
                v = _as_int(v, key)
            except ValueError as exc:
                failures.append((key, str(exc)))
                continue
            if key in th_dict and th_dict[key] != v:
                failures.append((key, f"{key}={v} conflicts with thresholds.{key}={th_dict[key]}"))
        else:
            v = th_dict.get(key, getattr(_DEFAULTS, key))
        lo = 0 if key == "warmup" else 1
        if v < lo:
            failures.append((key, f"{key} must be >= {lo}, got {v}"))
        out[key] = v
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 2 and \
            isinstance(out.get("thresholds"), dict) and "min_decode_tokens_per_s" in out["thresholds"]:
        failures.append(("max_tokens", "min_decode_tokens_per_s needs max_tokens >= 2"))

    raw_opts = get("probe_options")
    if _is_unknown(raw_opts):
        out["probe_options"] = raw_opts
    else:
        opts: dict[str, Any] = {}
        for k, v in dict(raw_opts or {}).items():
            if k not in _PROBE_OPTION_KEYS:
                failures.append((f"probe_options.{k}", f"unknown option; valid: {', '.join(_PROBE_OPTION_KEYS)}"))
            elif v is None:
                continue
            elif k in ("max_prompt_chars", "max_consecutive_errors"):
                try:
                    opts[k] = _as_int(v, k)
                except ValueError as exc:
                    failures.append((f"probe_options.{k}", str(exc)))
            elif k == "tls_server_name":
                opts[k] = str(v)
            else:
                try:
                    opts[k] = _as_float(v, k)
                except ValueError as exc:
                    failures.append((f"probe_options.{k}", str(exc)))
        out["probe_options"] = opts
    return out, failures


def _config_from_props(props: Mapping[str, Any]) -> tuple[ProbeConfig, SlaThresholds]:
    norm, failures = _normalize_props(props)
    if failures:
        raise ValueError("invalid FimSlaCheck inputs: " + "; ".join(f"{p}: {r}" for p, r in failures))
    cfg = ProbeConfig(
        endpoint=norm["endpoint"],
        model=norm["model"],
        api_key=norm.get("api_key"),
        ca_pem=norm.get("ca_pem"),
        insecure_skip_verify=norm["insecure_skip_verify"],
        samples=norm["samples"],
        warmup=norm["warmup"],
        concurrency=norm["concurrency"],
        max_tokens=norm["max_tokens"],
        **norm["probe_options"],
    )
    problems = cfg.validate()
    if problems:
        raise ValueError("invalid FimSlaCheck inputs: " + "; ".join(problems))
    return cfg, SlaThresholds.from_dict(norm["thresholds"])


def changed_inputs(olds: Mapping[str, Any], news: Mapping[str, Any]) -> list[str]:
    """Inputs whose change re-runs the check (what ``FimSlaCheckProvider.diff`` uses).

    ``olds`` are the previous outputs (which echo the normalized inputs plus
    ``api_key_sha256``), ``news`` the new inputs. Outputs such as ``report`` never
    count, so an unchanged stack does not re-run the probe. Unknown values (during
    preview) count as changed.
    """
    old_n, _ = _normalize_props({k: v for k, v in olds.items() if k in _INPUT_KEYS})
    new_n, _ = _normalize_props({k: v for k, v in news.items() if k in _INPUT_KEYS})
    changed = [k for k in _DIFF_KEYS
               if _is_unknown(new_n.get(k)) or old_n.get(k) != new_n.get(k)]
    new_key = news.get("api_key")
    old_hash = olds.get("api_key_sha256")
    if old_hash is None and olds.get("api_key") is not None:
        old_hash = _key_hash(olds.get("api_key"))
    if _is_unknown(new_key) or old_hash != _key_hash(new_key):
        changed.append("api_key")
    return changed


class FimSlaCheckProvider(pulumi.dynamic.ResourceProvider):
    """Dynamic provider behind ``FimSlaCheck``. Holds no state: safe for dill.

    Every method works when called directly (tests do; Pulumi mocks never run
    dynamic providers). httpx clients are created inside ``run_probe`` per call.
    """

    def check(self, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.CheckResult:
        norm, failures = _normalize_props(news)
        return pulumi.dynamic.CheckResult(
            norm, [pulumi.dynamic.CheckFailure(p, r) for p, r in failures]
        )

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.DiffResult:
        changed = changed_inputs(olds, news)
        return pulumi.dynamic.DiffResult(
            changes=bool(changed), replaces=[], stables=[], delete_before_replace=False
        )

    def _probe(self, props: Mapping[str, Any]) -> dict[str, Any]:
        cfg, thresholds = _config_from_props(props)
        result = check_sla(cfg, thresholds)
        report = result.report.to_dict(max_per_request=_MAX_PER_REQUEST_IN_STATE)
        report["violations"] = [v.to_dict() for v in result.violations]
        report["thresholds"] = thresholds.to_dict()
        if not result.passed:
            raise SlaViolationError(
                "FIM latency SLA missed; the deploy is not done.\n" + result.summary, report
            )
        norm, _ = _normalize_props(props)
        outs = {k: v for k, v in norm.items() if k != "api_key"}
        outs.update(
            api_key_sha256=_key_hash(norm.get("api_key")),
            report=report,
            summary=result.summary,
            passed=True,
        )
        return outs

    def create(self, props: dict[str, Any]) -> pulumi.dynamic.CreateResult:
        outs = self._probe(props)
        return pulumi.dynamic.CreateResult(id_=f"fimsla-{uuid.uuid4().hex[:12]}", outs=outs)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> pulumi.dynamic.UpdateResult:
        return pulumi.dynamic.UpdateResult(outs=self._probe(news))

    def read(self, id_: str, props: dict[str, Any]) -> pulumi.dynamic.ReadResult:
        # Refresh keeps the recorded result; it must not send traffic.
        return pulumi.dynamic.ReadResult(id_, props)

    def delete(self, _id: str, _props: dict[str, Any]) -> None:
        return None


def _secret_outputs_opts(opts: Optional[pulumi.ResourceOptions]) -> pulumi.ResourceOptions:
    return pulumi.ResourceOptions.merge(
        opts, pulumi.ResourceOptions(additional_secret_outputs=["api_key", "api_key_sha256"])
    )


class FimSlaCheck(pulumi.dynamic.Resource, module="fimfleet", name="FimSlaCheck"):
    """Post-deploy FIM latency gate (type ``pulumi-python:dynamic/fimfleet:FimSlaCheck``).

    create/update probe ``endpoint`` and fail the deploy with the readable report when
    the SLA is missed. The probe re-runs only when ``trigger`` or a probe input
    (endpoint, model, thresholds, sample settings, TLS settings, probe_options,
    api_key) changes.

    Outputs: ``report`` (dict, see ``ProbeReport.to_dict``; plus ``violations`` and
    ``thresholds``), ``summary`` (text with the TTFT histogram), ``passed`` (bool),
    the normalized inputs (without the key) and ``api_key_sha256`` (secret).
    """

    report: pulumi.Output[dict]
    summary: pulumi.Output[str]
    passed: pulumi.Output[bool]
    api_key_sha256: pulumi.Output[str]

    def __init__(
        self,
        resource_name: str,
        *,
        endpoint: pulumi.Input[str],
        api_key: pulumi.Input[str],
        model: pulumi.Input[str],
        trigger: pulumi.Input[str],
        thresholds: pulumi.Input[Mapping[str, Any]] | SlaThresholds | None = None,
        ca_pem: Optional[pulumi.Input[str]] = None,
        samples: Optional[pulumi.Input[int]] = None,
        warmup: Optional[pulumi.Input[int]] = None,
        concurrency: Optional[pulumi.Input[int]] = None,
        max_tokens: Optional[pulumi.Input[int]] = None,
        insecure_skip_verify: pulumi.Input[bool] = False,
        probe_options: Optional[pulumi.Input[Mapping[str, Any]]] = None,
        opts: Optional[pulumi.ResourceOptions] = None,
    ) -> None:
        if isinstance(thresholds, SlaThresholds):
            thresholds = thresholds.to_dict()
        props: dict[str, Any] = {
            "endpoint": endpoint,
            "api_key": pulumi.Output.secret(api_key),
            "model": model,
            "trigger": trigger,
            "thresholds": thresholds or {},
            "ca_pem": ca_pem,
            "samples": samples,
            "warmup": warmup,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "insecure_skip_verify": insecure_skip_verify,
            "probe_options": probe_options or {},
            # outputs
            "report": None,
            "summary": None,
            "passed": None,
            "api_key_sha256": None,
        }
        super().__init__(FimSlaCheckProvider(), resource_name, props, _secret_outputs_opts(opts))


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


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
        thresholds = SlaThresholds.from_dict({
            k: getattr(args, k) for k in SlaThresholds.LIMIT_FIELDS if getattr(args, k) is not None
        })
        cfg = ProbeConfig(
            endpoint=args.endpoint, model=args.model, api_key=key, ca_pem=args.ca,
            insecure_skip_verify=args.insecure_skip_verify, tls_server_name=args.tls_server_name,
            samples=args.samples, warmup=args.warmup, concurrency=args.concurrency,
            max_tokens=args.max_tokens, max_prompt_chars=args.max_prompt_chars,
            connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
            request_timeout_s=args.request_timeout, total_timeout_s=args.total_timeout,
            max_consecutive_errors=args.max_consecutive_errors,
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
