"""The streaming FIM probe: ``ProbeConfig`` -> ``run_probe`` -> ``ProbeReport``.

ONE aiohttp session speaking HTTP/1.1 with keepalive (as an editor plugin does) streams
FIM requests to ``/v1/completions``: a prompt from ``corpus.build_prompt``, stop
tokens, ``stream: true``, ``stream_options.include_usage``, temperature 0,
``max_tokens``, the model name and ``Authorization: Bearer <key>``. For each request
it measures TTFT (send -> first SSE chunk whose text is non-empty), the gaps between
content chunks, the total time (send -> ``[DONE]``), completion tokens (from the final
usage chunk; SSE chunks can merge tokens) and decode tokens/s = (tokens - 1) / (total -
TTFT). Warmup requests run first and are not counted. Every request gets a unique
first line, so prefix caching cannot help. Timeouts are bounded everywhere: connect,
read (per socket read), and an overall deadline per request enforced with
``asyncio.wait_for``; a stalled engine shows up as errors in the report, it never
hangs the probe. After ``max_consecutive_errors`` failures in a row the remaining
requests are not sent and are counted as errors.

Why aiohttp: it is the client of vLLM's own serving benchmark (``vllm bench serve``), and
its C HTTP parser keeps the probe's own time out of the TTFT it reports. httpx (pure-Python
h11 over anyio) added about 1 ms to every TTFT against a busy engine, 6-7 % of the tiny
model's 11 ms (benchmarks/probe_vs_vllm_bench.py, results in benchmarks/results/).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import ssl
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from components.sla import corpus
from components.sla.corpus import FimCase
from components import models
from components.sla.report import ProbeReport, RequestResult, SlaResult
from components.sla.thresholds import SlaThresholds, evaluate

if TYPE_CHECKING:  # imported where a probe runs: the program and the provider's diffs never need it (0.1 s)
    import aiohttp

DEFAULT_STOP: tuple[str, ...] = models.QWEN_FIM.stop
"""The served model's FIM stop strings (components/models.py, at most 4: vLLM's OpenAI schema
answers a 5th with HTTP 400)."""

USER_AGENT = "fimfleet-sla-probe/1"


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
    """FIM cases to cycle through (default: ``corpus.CORPUS``)."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Extra JSON fields merged into each request body (vendor parameters)."""
    bandwidth_bytes_per_s: Optional[float] = None
    """The node's measured memory bandwidth; with the next, the report's decode ceiling."""
    active_weight_bytes_per_token: Optional[float] = None

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


def tls_settings(cfg: ProbeConfig) -> tuple[Any, str]:
    """(aiohttp ``ssl`` value: True, False or an SSLContext; human description) for the endpoint."""
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
    except ImportError:  # pragma: no cover - certifi is pinned in requirements.txt
        ctx = ssl.create_default_context()
    return ctx, "https, verified against the default trust store"


def _redact(text: str, secret: Optional[str]) -> str:
    if secret and len(secret) >= 4:
        text = text.replace(secret, "<redacted>")
    return text


def _classify(exc: BaseException, cfg: ProbeConfig) -> tuple[str, str]:
    """(error kind, message) of a failed request; aiohttp's exception classes, most specific first."""
    import aiohttp

    msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout", f"connect timed out after {cfg.connect_timeout_s:g} s"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "read_timeout", f"no data for {cfg.read_timeout_s:g} s (read timeout)"
    if isinstance(exc, TimeoutError):
        return "timeout", msg
    if isinstance(exc, (aiohttp.ClientSSLError, ssl.SSLError)):
        return "tls", msg
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect", msg
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return "protocol", msg
    if isinstance(exc, (aiohttp.ClientOSError, OSError)):
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
    cases = list(cfg.corpus) if cfg.corpus else list(corpus.CORPUS)
    jobs = []
    for i in range(n):
        # Warmup and measured requests walk the corpus from different offsets.
        case = cases[(i + (len(cases) // 2 if warmup else 0)) % len(cases)]
        tag = f"fimfleet-probe {run_id} {'w' if warmup else 'm'}{i:04d}"
        jobs.append(_Job(i, case, corpus.build_prompt(case, tag, cfg.max_prompt_chars), warmup))
    return jobs


async def _read_snippet(resp: aiohttp.ClientResponse, limit: int = 2000) -> str:
    buf = await resp.content.read(limit)
    return buf.decode("utf-8", "replace").strip().replace("\n", " ")


async def _one_request(
    session: aiohttp.ClientSession, cfg: ProbeConfig, job: _Job, r: RequestResult
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
    content_times: list[float] = []
    usage_tokens: Optional[int] = None
    saw_done = False
    t_done: Optional[float] = None
    t0 = time.perf_counter()
    try:
        async with session.post(cfg.url, data=payload, server_hostname=cfg.tls_server_name or None,
                                allow_redirects=False) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.fail("http", f"HTTP {resp.status}: {await _read_snippet(resp)}")
                return
            async for line in resp.content:  # one SSE line per iteration, b"\n" included
                now = time.perf_counter()
                if saw_done or not line.startswith(b"data:"):
                    continue  # blank separators, ": keepalive" comments, event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    saw_done, t_done = True, now
                    continue  # keep reading to the end so the connection is reusable
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise ValueError(f"SSE data is not an object: {data[:80].decode('utf-8', 'replace')}")
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
    session: aiohttp.ClientSession, cfg: ProbeConfig, jobs: list[_Job], state: _RunState
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
                await asyncio.wait_for(_one_request(session, cfg, job, r), timeout)
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


def open_session(config: ProbeConfig, verify: Any = None) -> "aiohttp.ClientSession":
    """The probe's HTTP client: one keepalive pool of ``concurrency`` connections, its TLS
    (``verify``: tls_settings' value, computed when None), headers and timeouts
    (benchmarks/probe_vs_vllm_bench.py's raw leg times the same client)."""
    import aiohttp

    headers = {
        "Accept": "text/event-stream",
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
    }
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    # connect: waiting for a pooled connection plus opening one; sock_read: each read.
    # The deadline of a whole request is _run_phase's asyncio.wait_for.
    timeout = aiohttp.ClientTimeout(total=None, connect=config.request_timeout_s,
                                    sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.concurrency, limit_per_host=config.concurrency,
                                     keepalive_timeout=300.0,
                                     ssl=tls_settings(config)[0] if verify is None else verify)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers, trust_env=False,
                                 cookie_jar=aiohttp.DummyCookieJar())


async def run_probe_async(config: ProbeConfig) -> ProbeReport:
    """Async form of ``run_probe`` (for callers that already run an event loop)."""
    problems = config.validate()
    if problems:
        raise ValueError("invalid probe config: " + "; ".join(problems))
    run_id = config.run_id or uuid.uuid4().hex[:12]
    verify, tls_desc = tls_settings(config)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    state = _RunState(
        deadline=(t_start + config.total_timeout_s) if config.total_timeout_s else None,
        max_consecutive=config.max_consecutive_errors,
    )
    async with open_session(config, verify) as session:
        warm = await _run_phase(session, config, _jobs(config, run_id, config.warmup, True), state)
        measured = await _run_phase(session, config, _jobs(config, run_id, config.samples, False), state)
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
    settings = {k: getattr(config, k) for k in (
        "samples", "warmup", "concurrency", "max_tokens", "max_prompt_chars", "connect_timeout_s",
        "read_timeout_s", "request_timeout_s", "total_timeout_s", "max_consecutive_errors")}
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
        bandwidth_bytes_per_s=config.bandwidth_bytes_per_s,
        active_weight_bytes_per_token=config.active_weight_bytes_per_token,
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


def check_sla(config: ProbeConfig, thresholds: SlaThresholds) -> SlaResult:
    """Run the probe with ``config`` and judge the report against ``thresholds``."""
    report = run_probe(config)
    return SlaResult(report, thresholds, evaluate(report, thresholds))
