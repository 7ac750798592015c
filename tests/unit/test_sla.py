"""Unit tests of the SLA probe's pure parts: percentiles, histogram, report, evaluate.

No network: reports are built from synthetic RequestResults.
"""

from __future__ import annotations

import ssl

import pytest


from components.sla import corpus as fim_corpus
from components.sla.probe import ProbeConfig, tls_settings
from components.sla.report import ProbeReport, RequestResult, decode_ceiling, decode_efficiency, render_text
from components.sla.stats import histogram_bins, percentile, summarize, text_histogram
from components.sla.thresholds import SlaThresholds, Violation, evaluate


# ---------------------------------------------------------------- percentiles


def test_percentile_nearest_rank_textbook_example():
    # Nearest-rank worked example: rank = ceil(p/100 * n), n = 5.
    data = [15, 20, 35, 40, 50]
    assert percentile(data, 5) == 15    # ceil(0.25) = 1
    assert percentile(data, 30) == 20   # ceil(1.5)  = 2
    assert percentile(data, 40) == 20   # ceil(2.0)  = 2 (exactly at the rank)
    assert percentile(data, 50) == 35   # ceil(2.5)  = 3
    assert percentile(data, 100) == 50  # ceil(5)    = 5


def test_percentile_is_order_independent_and_returns_observed_values():
    data = [40, 15, 50, 35, 20]
    assert percentile(data, 50) == 35
    assert percentile(data, 75) == 40   # ceil(3.75) = 4


def test_percentile_exact_rank_arithmetic_no_float_drift():
    one_to_twenty = list(range(1, 21))
    # 0.95 * 20 is 18.999... in binary floating point; the exact rank is 19.
    assert percentile(one_to_twenty, 95) == 19
    assert percentile(one_to_twenty, 99) == 20   # ceil(19.8) = 20
    assert percentile(one_to_twenty, 50) == 10
    assert percentile(one_to_twenty, 0) == 1
    assert percentile(one_to_twenty, 99.9) == 20
    hundred = list(range(1, 101))
    assert percentile(hundred, 99) == 99
    assert percentile(hundred, 95) == 95
    assert percentile(hundred, 50) == 50
    assert percentile(hundred, 99.5) == 100      # ceil(99.5) = 100
    assert percentile([3.0] * 7, 99) == 3.0


def test_percentile_small_samples_p99_is_max():
    assert percentile([10.0, 11.0, 500.0], 99) == 500.0
    assert percentile([10.0, 11.0, 500.0], 50) == 11.0
    assert percentile([7.5], 50) == 7.5
    assert percentile([7.5], 99) == 7.5


def test_percentile_empty_and_invalid():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1, 2], 101)
    with pytest.raises(ValueError):
        percentile([1, 2], -1)


def test_summarize():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s == {"n": 4, "min": 1.0, "mean": 2.5, "p50": 2.0, "p95": 4.0, "p99": 4.0, "max": 4.0}
    assert summarize([])["n"] == 0 and summarize([])["p99"] is None


# ---------------------------------------------------------------- histogram


def test_histogram_bins_equal_width_last_bin_closed():
    bins = histogram_bins([float(x) for x in range(10)], bins=5)
    assert [b["count"] for b in bins] == [2, 2, 2, 2, 2]
    assert bins[0]["lo"] == 0.0 and bins[-1]["hi"] == 9.0
    assert bins[1]["lo"] == pytest.approx(1.8)
    # the maximum lands in the last bin, not in an extra one
    bins = histogram_bins([0.0, 10.0, 10.0], bins=4)
    assert [b["count"] for b in bins] == [1, 0, 0, 2]


def test_histogram_bins_degenerate():
    assert histogram_bins([]) == []
    assert histogram_bins([5.0, 5.0, 5.0]) == [{"lo": 5.0, "hi": 5.0, "count": 3}]


def test_text_histogram_format():
    bins = [{"lo": 10.0, "hi": 20.0, "count": 4}, {"lo": 20.0, "hi": 30.0, "count": 1},
            {"lo": 30.0, "hi": 40.0, "count": 0}]
    text = text_histogram(bins, width=8)
    assert text.splitlines() == [
        "       10.0 -      20.0 ms |########| 4",
        "       20.0 -      30.0 ms |##      | 1",
        "       30.0 -      40.0 ms |        | 0",
    ]
    assert text_histogram([]) == "  (no samples)"
    # a non-zero count always shows at least one '#'
    assert "|#" in text_histogram([{"lo": 0, "hi": 1, "count": 1}, {"lo": 1, "hi": 2, "count": 1000}],
                                  width=10).splitlines()[0]


# ---------------------------------------------------------------- report


def _ok(i, ttft, total, tokens=16, gaps=(), case="python/x"):
    return RequestResult(index=i, case=case, language=case.split("/")[0], ok=True, status=200,
                         ttft_ms=ttft, total_ms=total, gaps_ms=list(gaps),
                         completion_tokens=tokens, tokens_from_usage=True,
                         content_chunks=tokens, finish_reason="length")


def _err(i, kind="http", msg="HTTP 500: boom"):
    r = RequestResult(index=i, case="go/y", language="go")
    r.fail(kind, msg)
    return r


def _report(results, **kw):
    base = dict(endpoint="https://n:8443", url="https://n:8443/v1/completions", model="m",
                run_id="r1", started_at="2025-01-01T00:00:00+00:00", duration_s=1.5,
                settings={"samples": len(results), "warmup": 1, "concurrency": 1, "max_tokens": 16},
                tls="https, verified against ca_pem (PEM text)", insecure_skip_verify=False,
                results=results)
    base.update(kw)
    return ProbeReport(**base)


def test_decode_tokens_per_second():
    r = _ok(0, ttft=100.0, total=250.0, tokens=16)
    assert r.decode_tps == pytest.approx(15 / 0.150)
    assert _ok(0, 100.0, 250.0, tokens=1).decode_tps is None      # needs two tokens
    assert _ok(0, 100.0, 100.0, tokens=5).decode_tps is None      # no decode time
    assert _err(0).decode_tps is None


def test_report_to_dict_stats_errors_and_worst():
    results = [_ok(i, ttft=10.0 * (i + 1), total=100.0 + 10 * i, gaps=[2.0, 4.0]) for i in range(8)]
    results += [_err(8), _err(9), _err(10, "read_timeout", "no data for 30 s (read timeout)")]
    d = _report(results).to_dict()
    assert d["requests"] == 11 and d["ok"] == 8 and d["errors"] == 3
    assert d["error_rate"] == pytest.approx(3 / 11, abs=1e-4)
    assert d["ttft_ms"]["p50"] == 40.0          # ceil(0.5*8)=4 -> 40
    assert d["ttft_ms"]["p95"] == 80.0 and d["ttft_ms"]["max"] == 80.0
    assert d["itl_ms"]["n"] == 16 and d["itl_ms"]["p50"] == 2.0 and d["itl_ms"]["max"] == 4.0
    assert d["completion_tokens"]["sum"] == 128 and d["completion_tokens"]["from_usage"] is True
    assert [w["index"] for w in d["worst"]] == [7, 6, 5, 4, 3]
    samples = {(e["kind"], e["message"]): e["count"] for e in d["error_samples"]}
    assert samples == {("http", "HTTP 500: boom"): 2,
                       ("read_timeout", "no data for 30 s (read timeout)"): 1}
    assert sum(b["count"] for b in d["ttft_histogram"]) == 8
    assert len(d["per_request"]) == 11
    assert d["percentile_method"] == "nearest-rank"
    assert "per_request" not in _report(results).to_dict(per_request=False)
    capped = _report(results).to_dict(max_per_request=3)
    assert [r["index"] for r in capped["per_request"]] == [0, 1, 2] and capped["per_request_truncated"]
    assert capped["requests"] == 11 and d["per_request_truncated"] is False


# ---------------------------------------------------------------- thresholds / evaluate


def test_thresholds_from_dict_coerces_and_rejects():
    th = SlaThresholds.from_dict({"ttft_p99_ms": 500, "max_errors": 1.0, "ttft_p50_ms": None})
    assert th.ttft_p99_ms == 500.0 and th.max_errors == 1 and isinstance(th.max_errors, int)
    assert th.to_dict() == {"ttft_p99_ms": 500.0, "max_errors": 1}
    with pytest.raises(ValueError, match="unknown SLA threshold key.*ttft_p999_ms"):
        SlaThresholds.from_dict({"ttft_p999_ms": 1})
    with pytest.raises(ValueError, match="unknown SLA threshold key.*samples"):
        SlaThresholds.from_dict({"samples": 20})          # sample settings are not limits
    with pytest.raises(ValueError, match="max_error_rate"):
        SlaThresholds.from_dict({"max_error_rate": 2})
    with pytest.raises(ValueError, match="max_errors must be an integer"):
        SlaThresholds.from_dict({"max_errors": 2.5})
    with pytest.raises(ValueError, match="ttft_p50_ms must be a number"):
        SlaThresholds.from_dict({"ttft_p50_ms": "fast"})
    with pytest.raises(ValueError, match="ttft_p50_ms must be a positive"):
        SlaThresholds.from_dict({"ttft_p50_ms": 0})
    assert SlaThresholds.from_dict({"min_decode_tokens_per_s": 0}).min_decode_tokens_per_s == 0.0


def test_the_cli_takes_every_sla_limit():
    from components.sla.__main__ import _LIMITS, _parser

    dests = {a.dest for a in _parser()._actions}
    assert set(_LIMITS) <= dests, set(_LIMITS) - dests


def test_typed_thresholds_are_always_valid():
    # the typed object checks itself, so node.py, the provider and the CLI share one set of rules
    for bad, word in (({"ttft_p99_ms": -1}, "ttft_p99_ms"), ({"ttft_p95_ms": float("nan")}, "ttft_p95_ms"),
                      ({"min_decode_tokens_per_s": -0.5}, "min_decode"), ({"max_errors": -1}, "max_errors"),
                      ({"max_errors": True}, "max_errors"), ({"max_error_rate": 1.5}, "max_error_rate"),
                      ({"ttft_p50_ms": 500, "ttft_p99_ms": 400}, "must not decrease"),
                      ({"min_decode_ceiling_fraction": 0}, "fraction"), ({"min_decode_ceiling_fraction": 1.01}, "fraction")):
        with pytest.raises(ValueError, match=word):
            SlaThresholds(**bad)
    assert SlaThresholds(ttft_p50_ms=100, ttft_p99_ms=100).problems() == []
    with pytest.raises(Exception):
        SlaThresholds(ttft_p99_ms=1).ttft_p99_ms = 2        # frozen


def test_evaluate_pass_and_each_violation():
    results = [_ok(i, ttft=10.0 * (i + 1), total=200.0 + 10 * (i + 1), tokens=11) for i in range(10)]
    rep = _report(results)
    # ttft: p50 = 50, p95 = p99 = 100; decode tps = 10 tokens / 0.2 s = 50 for each
    ok = SlaThresholds(ttft_p50_ms=50, ttft_p95_ms=100, ttft_p99_ms=100, min_decode_tokens_per_s=50)
    assert evaluate(rep, ok) == []
    bad = SlaThresholds(ttft_p50_ms=1, ttft_p95_ms=1, ttft_p99_ms=1, min_decode_tokens_per_s=60)
    v = {x.metric: x for x in evaluate(rep, bad)}
    assert set(v) == {"ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "min_decode_tokens_per_s"}
    assert v["ttft_p99_ms"].measured == 100.0 and v["ttft_p99_ms"].limit == 1
    assert v["min_decode_tokens_per_s"].measured == pytest.approx(50.0)
    # the dict form (as stored in stack outputs) evaluates the same way
    assert [x.metric for x in evaluate(rep.to_dict(), bad)] == [x.metric for x in evaluate(rep, bad)]


def test_decode_limit_as_a_fraction_of_the_ceiling():
    # decode is 50 tok/s per request; 1e9 B/s over 1e7 B per token gives a ceiling of 100 tok/s
    rep = _report([_ok(i, ttft=10.0, total=210.0, tokens=11) for i in range(5)],
                  bandwidth_bytes_per_s=1e9, active_weight_bytes_per_token=1e7)
    assert evaluate(rep, SlaThresholds(min_decode_ceiling_fraction=0.5)) == []
    [v] = evaluate(rep, SlaThresholds(min_decode_ceiling_fraction=0.7))
    assert (v.metric, v.measured, v.limit) == ("min_decode_ceiling_fraction", pytest.approx(0.5), 0.7)
    assert "ceiling of 100" in str(v) and str(v).startswith("min_decode_ceiling_fraction: measured 0.5, limit >= 0.7")
    # the dict form, as kept in stack outputs, judges the same
    assert [x.metric for x in evaluate(rep.to_dict(), SlaThresholds(min_decode_ceiling_fraction=0.7))] == [v.metric]
    # no ceiling measured (no bandwidth probe): the limit cannot be met, and says why
    [v] = evaluate(_report(rep.results), SlaThresholds(min_decode_ceiling_fraction=0.1))
    assert v.measured is None and "bandwidth was not measured" in str(v)


def test_evaluate_errors_strict_by_default_and_rate():
    results = [_ok(i, 10.0, 50.0) for i in range(9)] + [_err(9)]
    rep = _report(results)
    v = evaluate(rep, SlaThresholds())
    assert [(x.metric, x.measured, x.limit) for x in v] == [("max_errors", 1, 0)]
    assert evaluate(rep, SlaThresholds(max_errors=1)) == []
    assert evaluate(rep, SlaThresholds(max_error_rate=0.1)) == []
    v = evaluate(rep, SlaThresholds(max_error_rate=0.05))
    assert [(x.metric, x.measured) for x in v] == [("max_error_rate", 0.1)]


def test_evaluate_no_successful_request_always_fails():
    rep = _report([_err(i) for i in range(3)])
    v = evaluate(rep, SlaThresholds(ttft_p99_ms=1000, max_errors=10))
    metrics = [x.metric for x in v]
    assert metrics == ["ok_requests", "ttft_p99_ms"]
    assert v[1].measured is None and "no TTFT samples" in str(v[1])


def test_violation_str_names_metric_measured_limit():
    assert str(Violation("ttft_p99_ms", 123.45, 100.0)) == "ttft_p99_ms: measured 123.5, limit <= 100.0"
    s = str(Violation("min_decode_tokens_per_s", 3.2, 10.0, "median"))
    assert s == "min_decode_tokens_per_s: measured 3.2, limit >= 10.0 (median)"


def test_render_text_sections():
    results = [_ok(i, ttft=10.0 * (i + 1), total=300.0, case="rust/parse_kv") for i in range(6)]
    results.append(_err(6, "deadline", "request exceeded its 5 s deadline"))
    rep = _report(results, warnings=["TLS certificate verification was DISABLED (insecure_skip_verify=True)"],
                  insecure_skip_verify=True)
    th = SlaThresholds(ttft_p99_ms=1.0, max_errors=0)
    text = render_text(rep, th)
    assert "6/7 ok, 1 error(s)" in text
    assert "WARNING: TLS certificate verification was DISABLED" in text
    assert "TTFT histogram:" in text and "ms |" in text
    assert "TTFT ms        p50 30.0  p95 60.0  p99 60.0  max 60.0" in text
    assert "#5 rust/parse_kv: TTFT 60.0 ms" in text
    assert "1x [deadline] request exceeded its 5 s deadline" in text
    assert "ttft_p99_ms              measured      60.0  limit <= 1.0       FAIL" in text
    assert "max_errors               measured         1  limit <= 0         FAIL" in text
    assert "  - max_errors: measured 1, limit <= 0" in text
    assert "SLA MISSED (2 violation(s)):" in text
    assert "  - ttft_p99_ms: measured 60.0, limit <= 1.0" in text
    assert render_text(_report(results[:6]), SlaThresholds(ttft_p99_ms=100)).endswith("SLA PASSED")
    # without thresholds there is no SLA section
    assert "SLA" not in render_text(rep).replace("SLA probe", "")


# ---------------------------------------------------------------- decode ceiling


def test_decode_ceiling_is_bandwidth_over_bytes_per_token():
    # 4.28 TB/s HBM (measured on an H200) over 15.2 GB of bf16 weights read per token
    assert decode_ceiling(4.28e12, 15.2e9) == pytest.approx(281.58, abs=0.01)
    assert decode_ceiling(100e9, 4e9) == 25.0
    assert decode_ceiling(None, 4e9) is None and decode_ceiling(100e9, None) is None
    for bad in (0, -1.0, float("inf"), float("nan"), True, "100"):
        with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
            decode_ceiling(bad, 4e9)
    with pytest.raises(ValueError, match="active_weight_bytes_per_token"):
        decode_ceiling(100e9, 0)


def test_decode_efficiency_fields():
    assert decode_efficiency(20.0, 100e9, 4e9) == {
        "measured_tokens_per_s": 20.0, "ceiling_tokens_per_s": 25.0, "efficiency_pct": 80.0,
        "bandwidth_bytes_per_s": 100e9, "active_weight_bytes_per_token": 4e9}
    unknown = decode_efficiency(20.0, None, 4e9)          # bandwidth not measured
    assert unknown["ceiling_tokens_per_s"] is None and unknown["efficiency_pct"] is None
    assert decode_efficiency(None, 100e9, 4e9)["efficiency_pct"] is None


def test_report_shows_decode_ceiling_only_when_known():
    # 10 requests, 11 tokens each, 200 ms of decode: 50 tok/s per request
    results = [_ok(i, ttft=10.0, total=210.0, tokens=11) for i in range(10)]
    plain = _report(results)
    assert plain.to_dict()["decode_ceiling"]["ceiling_tokens_per_s"] is None
    assert "decode ceiling" not in render_text(plain, SlaThresholds(ttft_p99_ms=100))
    rep = _report(results, bandwidth_bytes_per_s=100e9, active_weight_bytes_per_token=1e9)
    d = rep.to_dict()
    assert d["decode_ceiling"] == {"measured_tokens_per_s": 50.0, "ceiling_tokens_per_s": 100.0,
                                   "efficiency_pct": 50.0, "bandwidth_bytes_per_s": 100e9,
                                   "active_weight_bytes_per_token": 1e9}
    line = "  decode ceiling measured 50.0 tok/s, ceiling 100.0 tok/s (50.0% of the ceiling) = 100 GB/s / 1 GB per token"
    assert line in render_text(rep).splitlines()
    assert line in render_text(d, SlaThresholds(ttft_p99_ms=100)).splitlines()   # the stored dict form too


# ---------------------------------------------------------------- config, TLS


def test_probe_config_url_and_validate():
    assert ProbeConfig(endpoint="https://h:8443/", model="m").url == "https://h:8443/v1/completions"
    assert ProbeConfig(endpoint="https://h/v1", model="m").url == "https://h/v1/completions"
    assert ProbeConfig(endpoint="https://h/v1/completions", model="m").url == "https://h/v1/completions"
    assert ProbeConfig(endpoint="https://h", model="m").validate() == []
    errs = ProbeConfig(endpoint="h:1", model="", samples=-1, concurrency=0,
                       request_timeout_s=0).validate()
    joined = " | ".join(errs)
    for word in ("endpoint", "model", "samples", "concurrency", "request_timeout_s"):
        assert word in joined
    assert ProbeConfig(endpoint="https://h", model="m", ca_pem="/nonexistent/ca.pem").validate()
    both = ProbeConfig(endpoint="https://h", model="m", ca_pem="-----BEGIN CERTIFICATE-----",
                       insecure_skip_verify=True)
    assert any("not both" in e for e in both.validate())
    assert "api_key" not in repr(ProbeConfig(endpoint="https://h", model="m", api_key="sekrit-123"))
    assert "sekrit" not in repr(ProbeConfig(endpoint="https://h", model="m", api_key="sekrit-123"))


def testtls_settings():
    verify, desc = tls_settings(ProbeConfig(endpoint="https://h", model="m", insecure_skip_verify=True))
    assert verify is False and "DISABLED" in desc
    verify, desc = tls_settings(ProbeConfig(endpoint="https://h", model="m"))
    assert isinstance(verify, ssl.SSLContext) and verify.verify_mode == ssl.CERT_REQUIRED
    assert verify.check_hostname and "default trust store" in desc
    verify, desc = tls_settings(ProbeConfig(endpoint="http://h", model="m"))
    assert "plain http" in desc


def _failures():
    """One instance of each client failure the probe can meet, with the kind the report must give it."""
    import json
    from types import SimpleNamespace

    import aiohttp

    key = SimpleNamespace(host="10.0.0.5", port=8443, ssl=True, is_ssl=True)
    return [
        (aiohttp.ConnectionTimeoutError("Connection timeout to host"), "connect_timeout"),
        (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), "read_timeout"),
        (aiohttp.ServerTimeoutError("timeout"), "timeout"),
        (aiohttp.ClientConnectorCertificateError(key, ssl.SSLCertVerificationError("hostname mismatch")), "tls"),
        (aiohttp.ClientConnectorSSLError(key, ssl.SSLError("wrong version number")), "tls"),
        (aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "Connection refused")), "connect"),
        (aiohttp.ServerDisconnectedError(), "protocol"),
        (aiohttp.ClientPayloadError("Response payload is not completed"), "protocol"),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), "read_error"),
        (json.JSONDecodeError("Expecting value", "data: {", 6), "protocol"),
        (RuntimeError("something else"), "client"),
    ]


@pytest.mark.parametrize("exc, kind", _failures(), ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v)
def test_each_client_failure_gets_its_kind(exc, kind):
    from components.sla.probe import _classify

    got, message = _classify(exc, ProbeConfig(endpoint="https://h", model="m", connect_timeout_s=3, read_timeout_s=7))
    assert got == kind, (exc, message)
    if kind == "connect_timeout":
        assert message == "connect timed out after 3 s"
    if kind == "read_timeout":
        assert message == "no data for 7 s (read timeout)"


# ---------------------------------------------------------------- corpus


def test_corpus_is_multilingual_and_well_formed():
    langs = {c.language for c in fim_corpus.CORPUS}
    assert {"python", "typescript", "go", "rust", "java", "c"} <= langs
    assert len(langs) >= 8
    names = [c.name for c in fim_corpus.CORPUS]
    assert len(names) == len(set(names))
    for c in fim_corpus.CORPUS:
        assert c.prefix and c.suffix and c.comment
        for tok in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"):
            assert tok not in c.prefix + c.suffix


def test_build_prompt_format_and_unique_first_line():
    case = fim_corpus.CORPUS[0]
    p = fim_corpus.build_prompt(case, "fimfleet-probe r1 m0001")
    assert p == f"<|fim_prefix|># fimfleet-probe r1 m0001\n{case.prefix}<|fim_suffix|>{case.suffix}<|fim_middle|>"
    other = fim_corpus.build_prompt(case, "fimfleet-probe r1 m0002")
    assert p != other
    # the unique part is at the very start, so no shared KV-cache block prefix
    assert p.split("\n")[0] != other.split("\n")[0]


def test_build_prompt_max_chars_keeps_text_near_cursor():
    for case in fim_corpus.CORPUS:
        for limit in (40, 120, 300):
            p = fim_corpus.build_prompt(case, "t-0001", max_chars=limit)
            body = p[len("<|fim_prefix|>"):-len("<|fim_middle|>")]
            prefix, suffix = body.split("<|fim_suffix|>")
            assert len(prefix) + len(suffix) <= max(limit, len(f"{case.comment} t-0001\n"))
            assert prefix.startswith(f"{case.comment} t-0001\n")
            kept = prefix[len(f"{case.comment} t-0001\n"):]
            assert case.prefix.endswith(kept)        # the end of the prefix is kept
            assert case.suffix.startswith(suffix)    # the start of the suffix is kept
    # no limit, or a limit larger than the case: untouched
    c = fim_corpus.CORPUS[1]
    assert fim_corpus.build_prompt(c, "t", 10_000) == fim_corpus.build_prompt(c, "t")
