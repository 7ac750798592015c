"""The SLA probe end to end against a fake OpenAI-compatible streaming server.

tests/integration/fake_vllm.py stands in for vLLM (real-vLLM tests come later and
use the same API): generous SLA passes, impossible SLA fails with a report, an
erroring engine fails with errors counted, a stalled engine fails within a bounded
time; plus TLS verification, keepalive, unique prompts, the CLI and the benchmark. The gate under
the real Pulumi engine is in test_sla_pulumi.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from components.sla.probe import ProbeConfig, check_sla, run_probe
from components.sla.provider import FimSlaCheckProvider
from components.sla.report import render_text
from components.sla.thresholds import SlaThresholds, evaluate
from tests.helpers import free_port


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fake_vllm = _load("fimfleet_tests_fake_vllm", ROOT / "tests" / "integration" / "fake_vllm.py")
bench = _load("fimfleet_bench_probe_vs_server", ROOT / "benchmarks" / "probe_vs_server_ttft.py")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = "sk-fimfleet-it-abcdef012345"
MODEL = "fake-qwen"


@pytest.fixture
def fake():
    with fake_vllm.FakeVllm(fake_vllm.FakeConfig(api_keys=(KEY, "second-key-5678"), model=MODEL,
                                                 ttft_s=0.01, inter_chunk_s=0.002)) as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return fake_vllm.make_test_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture
def tls_fake(pki):
    cfg = fake_vllm.FakeConfig(api_keys=(KEY,), model=MODEL, ttft_s=0.005, inter_chunk_s=0.001)
    with fake_vllm.FakeVllm(cfg, certfile=pki["cert_file"], keyfile=pki["key_file"]) as server:
        yield server


def _cfg(server, **kw) -> ProbeConfig:
    base = dict(endpoint=server.url, model=MODEL, api_key=KEY, samples=6, warmup=1,
                max_tokens=8, request_timeout_s=10.0, read_timeout_s=10.0, connect_timeout_s=5.0)
    base.update(kw)
    return ProbeConfig(**base)


GENEROUS = SlaThresholds(ttft_p50_ms=2000, ttft_p95_ms=3000, ttft_p99_ms=5000,
                         min_decode_tokens_per_s=1.0, max_errors=0)


# ---------------------------------------------------------------- SLA outcomes


def test_generous_sla_passes_and_requests_are_editor_like(fake):
    result = check_sla(_cfg(fake, samples=8, warmup=2), GENEROUS)
    assert result.passed, result.summary
    d = result.report.to_dict()
    assert d["requests"] == 8 and d["ok"] == 8 and d["errors"] == 0
    assert d["ttft_ms"]["p50"] >= 10.0                 # at least the engine's TTFT
    assert d["completion_tokens"] == {"sum": 64, "mean": 8.0, "from_usage": True}
    assert d["itl_ms"]["n"] == 8 * 7
    assert d["decode_tokens_per_s"]["p50"] > 1.0
    # one HTTP/1.1 client with keepalive: all 10 requests over one TCP connection
    assert fake.connections == 1
    reqs = fake.completion_requests()
    assert len(reqs) == 10
    for r in reqs:
        b = r["body"]
        assert r["headers"]["Authorization"] == f"Bearer {KEY}"
        assert b["model"] == MODEL and b["stream"] is True and b["temperature"] == 0
        assert b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 8
        # vLLM's OpenAI schema takes at most 4 stop strings (the fake rejects more, as vLLM does).
        assert set(b["stop"]) == {"<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|file_sep|>"}
        assert b["prompt"].startswith("<|fim_prefix|>") and b["prompt"].endswith("<|fim_middle|>")
        assert b["prompt"].count("<|fim_suffix|>") == 1
        assert "suffix" not in b                        # vLLM rejects OpenAI `suffix` for Qwen
        assert len(b["prompt"]) <= 512 + 3 * 14     # max_prompt_chars + the 3 FIM tokens
    # every prompt differs in its first line -> no shared prefix-cache block
    first_lines = [r["body"]["prompt"].split("\n", 1)[0] for r in reqs]
    assert len(set(first_lines)) == len(first_lines)
    languages = {w["case"].split("/")[0] for w in d["per_request"]}
    assert len(languages) >= 4


def test_impossible_sla_fails_with_report(fake):
    result = check_sla(_cfg(fake), SlaThresholds(ttft_p99_ms=1.0))
    assert not result.passed
    assert [v.metric for v in result.violations] == ["ttft_p99_ms"]
    v = result.violations[0]
    assert v.measured > v.limit == 1.0
    text = result.summary
    assert "SLA MISSED" in text and "ttft_p99_ms" in text and "limit <= 1.0" in text
    assert "TTFT histogram:" in text and "Worst requests" in text


def test_erroring_engine_fails_with_errors_counted(fake):
    fake.config.mode = "error"
    t0 = time.monotonic()
    result = check_sla(_cfg(fake, samples=5, max_consecutive_errors=0), GENEROUS)
    assert time.monotonic() - t0 < 10
    d = result.report.to_dict()
    assert d["errors"] == 5 and d["ok"] == 0 and d["error_rate"] == 1.0
    assert d["warmup_errors"] == 1
    assert d["error_samples"][0]["kind"] == "http"
    assert d["error_samples"][0]["message"].startswith("HTTP 500")
    assert d["error_samples"][0]["count"] == 5
    metrics = [v.metric for v in result.violations]
    assert "ok_requests" in metrics and "max_errors" in metrics and "ttft_p99_ms" in metrics
    assert len(fake.completion_requests()) == 6        # all were really sent


def test_partial_errors_and_error_rate_limit(fake):
    fake.config.fail_every = 4
    report = run_probe(_cfg(fake, samples=8, warmup=0))
    d = report.to_dict()
    assert d["errors"] == 2 and d["error_rate"] == 0.25
    assert evaluate(report, SlaThresholds(max_error_rate=0.3)) == []
    assert [v.metric for v in evaluate(report, SlaThresholds(max_error_rate=0.1))] == ["max_error_rate"]


def test_stalled_engine_fails_within_bounded_time(fake):
    fake.config.mode = "stall"
    cfg = _cfg(fake, samples=5, warmup=1, request_timeout_s=1.0, read_timeout_s=30.0,
               max_consecutive_errors=3)
    t0 = time.monotonic()
    result = check_sla(cfg, GENEROUS)
    elapsed = time.monotonic() - t0
    # warmup + 2 measured requests hit the 1 s deadline, then the probe stops sending
    assert elapsed < 3 * 1.0 + 2.5, elapsed
    d = result.report.to_dict()
    assert d["ok"] == 0 and d["errors"] == 5
    kinds = [r["error_kind"] for r in d["per_request"]]
    assert kinds == ["deadline", "deadline", "aborted", "aborted", "aborted"]
    assert "aborted after 3 consecutive errors" in d["aborted"]
    assert not result.passed
    assert "request exceeded its 1 s deadline" in result.summary


def test_stall_mid_stream_is_bounded_by_request_deadline(fake):
    fake.config.mode = "stall_after_first"
    t0 = time.monotonic()
    report = run_probe(_cfg(fake, samples=2, warmup=0, request_timeout_s=0.8, read_timeout_s=30.0))
    assert time.monotonic() - t0 < 2 * 0.8 + 2.0
    assert [r.error_kind for r in report.results] == ["deadline", "deadline"]
    assert "first token after" in report.results[0].error


def test_a_stream_cut_mid_body_is_a_protocol_error_not_a_hang(fake):
    fake.config.mode = "drop_after_first"
    t0 = time.monotonic()
    report = run_probe(_cfg(fake, samples=2, warmup=0, request_timeout_s=10.0, read_timeout_s=10.0))
    assert time.monotonic() - t0 < 3.0
    assert [r.error_kind for r in report.results] == ["protocol", "protocol"], report.to_dict()["error_samples"]
    assert report.results[0].ttft_ms is not None      # what arrived before the cut is kept


def test_read_timeout_is_reported(fake):
    fake.config.mode = "stall"
    t0 = time.monotonic()
    report = run_probe(_cfg(fake, samples=2, warmup=0, read_timeout_s=0.3, request_timeout_s=10))
    assert time.monotonic() - t0 < 3.0
    assert [r.error_kind for r in report.results] == ["read_timeout", "read_timeout"]


def test_total_budget_stops_the_probe(fake):
    fake.config.mode = "stall"
    t0 = time.monotonic()
    report = run_probe(_cfg(fake, samples=10, warmup=0, request_timeout_s=5.0,
                            total_timeout_s=1.0, max_consecutive_errors=0))
    assert time.monotonic() - t0 < 3.0
    assert len(report.results) == 10 and not report.ok_results
    assert "time budget" in report.aborted


def test_midstream_error_event_and_wrong_key_and_model(fake):
    fake.config.mode = "error_midstream"
    r = run_probe(_cfg(fake, samples=1, warmup=0)).results[0]
    assert (r.ok, r.error_kind) == (False, "stream_error") and "engine died" in r.error
    fake.config.mode = "ok"
    r = run_probe(_cfg(fake, samples=1, warmup=0, api_key="wrong-key-000")).results[0]
    assert (r.status, r.error_kind) == (401, "http") and "wrong-key-000" not in (r.error or "")
    r = run_probe(_cfg(fake, samples=1, warmup=0, api_key="second-key-5678")).results[0]
    assert r.ok                                            # any configured key works
    r = run_probe(_cfg(fake, samples=1, warmup=0, model="nope")).results[0]
    assert r.status == 404 and "does not exist" in r.error


def test_connection_refused_is_an_error_not_a_hang():
    report = run_probe(ProbeConfig(endpoint=f"http://127.0.0.1:{free_port()}", model=MODEL, samples=2,
                                   warmup=0, connect_timeout_s=1.0))
    assert [r.error_kind for r in report.results] == ["connect", "connect"]


# ---------------------------------------------------------------- measurement details


def test_ttft_ignores_empty_chunks_and_tokens_come_from_usage(fake):
    fake.config.empty_first_chunk = True
    fake.config.ttft_s = 0.05
    fake.config.merge_every = 4                            # 16 tokens in 4 SSE chunks
    report = run_probe(_cfg(fake, samples=3, warmup=0, max_tokens=16))
    for r in report.results:
        assert r.ok and r.ttft_ms >= 50.0                  # not the empty first chunk
        assert r.content_chunks == 4 and r.completion_tokens == 16 and r.tokens_from_usage
        assert len(r.gaps_ms) == 3


def test_missing_usage_falls_back_with_warning(fake):
    fake.config.include_usage = False
    report = run_probe(_cfg(fake, samples=2, warmup=0))
    assert all(r.ok and not r.tokens_from_usage and r.completion_tokens == 8 for r in report.results)
    assert any("usage missing" in w for w in report.warnings)


def test_concurrency_uses_bounded_keepalive_pool(fake):
    fake.config.ttft_s = 0.1
    t0 = time.monotonic()
    report = run_probe(_cfg(fake, samples=6, warmup=3, concurrency=3, max_tokens=4))
    elapsed = time.monotonic() - t0
    assert len(report.ok_results) == 6
    assert 1 <= fake.connections <= 3
    assert elapsed < 0.88                 # sequential would take >= 9 x 0.1 s: they overlapped


def test_probe_leaves_the_callers_event_loop_alone(fake):
    import asyncio

    async def inner():
        return run_probe(_cfg(fake, samples=2, warmup=0))

    # inside a running loop (not asyncio.run: that would reset this thread's loop)
    loop = asyncio.new_event_loop()
    try:
        assert len(loop.run_until_complete(inner()).ok_results) == 2
    finally:
        loop.close()
    # a Pulumi program's main thread owns its current loop: run_probe must not touch it
    policy = asyncio.get_event_loop_policy()
    try:
        previous = policy.get_event_loop()
    except RuntimeError:
        previous = None
    mine = asyncio.new_event_loop()
    policy.set_event_loop(mine)
    try:
        assert len(run_probe(_cfg(fake, samples=1, warmup=0)).ok_results) == 1
        assert policy.get_event_loop() is mine and not mine.is_closed()
    finally:
        policy.set_event_loop(previous)
        mine.close()


# ---------------------------------------------------------------- TLS


def test_tls_verified_with_ca_pem_text_and_file(tls_fake, pki):
    for ca in (pki["ca_pem"], pki["ca_file"]):
        report = run_probe(_cfg(tls_fake, ca_pem=ca, samples=2))
        assert len(report.ok_results) == 2, report.to_dict()["error_samples"]
        assert report.tls.startswith("https, verified against ca_pem")
        assert not report.insecure_skip_verify and not report.warnings


def test_tls_pinning_the_server_certificate_itself(tls_fake, pki):
    report = run_probe(_cfg(tls_fake, ca_pem=pki["cert_pem"], samples=1, warmup=0))
    assert report.results[0].ok, report.results[0].error


def test_tls_self_signed_server_cert_as_ca_pem(tmp_path):
    ss = fake_vllm.make_self_signed(str(tmp_path))
    cfg = fake_vllm.FakeConfig(api_keys=(KEY,), model=MODEL, ttft_s=0.002, inter_chunk_s=0.001)
    with fake_vllm.FakeVllm(cfg, certfile=ss["cert_file"], keyfile=ss["key_file"]) as server:
        report = run_probe(_cfg(server, ca_pem=ss["cert_pem"], samples=1, warmup=0))
        assert report.results[0].ok, report.results[0].error
        report = run_probe(_cfg(server, samples=1, warmup=0))           # not trusted by default
        assert report.results[0].error_kind == "tls"


def test_tls_rejects_untrusted_or_mismatched_cert(tls_fake, pki, tmp_path):
    other = fake_vllm.make_test_pki(str(tmp_path))
    for cfg in (
        _cfg(tls_fake, ca_pem=other["ca_pem"], samples=2, warmup=0),      # wrong CA
        _cfg(tls_fake, samples=2, warmup=0),                             # default trust store
        _cfg(tls_fake, ca_pem=pki["ca_pem"], tls_server_name="wrong.example", samples=2, warmup=0),
    ):
        report = run_probe(cfg)
        assert [r.error_kind for r in report.results] == ["tls", "tls"], report.to_dict()["error_samples"]
        assert "CERTIFICATE_VERIFY_FAILED" in report.results[0].error
    ok = run_probe(_cfg(tls_fake, ca_pem=pki["ca_pem"], tls_server_name="localhost", samples=1, warmup=0))
    assert ok.results[0].ok


def test_insecure_skip_verify_only_when_asked_and_reported(tls_fake):
    report = run_probe(_cfg(tls_fake, insecure_skip_verify=True, samples=2))
    assert len(report.ok_results) == 2 and report.insecure_skip_verify
    assert "VERIFICATION DISABLED" in report.tls
    text = render_text(report, GENEROUS)
    assert "WARNING: TLS certificate verification was DISABLED" in text


def test_provider_over_tls_with_ca_pem(tls_fake, pki):
    props = {"endpoint": tls_fake.url, "api_key": KEY, "model": MODEL, "trigger": "t",
             "ca_pem": pki["ca_pem"], "thresholds": {"ttft_p99_ms": 5000}, "samples": 3,
             "warmup": 1}
    outs = FimSlaCheckProvider().create(props).outs
    assert outs["passed"] and outs["report"]["tls"] == "https, verified against ca_pem (PEM text)"


# ---------------------------------------------------------------- CLI and benchmark


def _run(args, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "FIMFLEET_KEY"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_pass_fail_and_usage_errors(fake):
    base = ["-m", "components.sla", "--endpoint", fake.url, "--model", MODEL,
            "--samples", "4", "--warmup", "1", "--max-tokens", "4"]
    ok = _run(base + ["--ttft-p99-ms", "5000"], {"FIMFLEET_KEY": KEY})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SLA PASSED" in ok.stdout and "TTFT histogram:" in ok.stdout
    assert KEY not in ok.stdout
    bad = _run(base + ["--ttft-p99-ms", "1"], {"FIMFLEET_KEY": KEY})
    assert bad.returncode == 1 and "SLA MISSED" in bad.stdout and "ttft_p99_ms" in bad.stdout
    js = _run(base + ["--json", "--key-env", "MY_KEY", "--ttft-p99-ms", "1"], {"MY_KEY": KEY})
    assert js.returncode == 1
    data = json.loads(js.stdout)
    assert data["passed"] is False and data["violations"][0]["metric"] == "ttft_p99_ms"
    missing = _run(base)
    assert missing.returncode == 2 and "FIMFLEET_KEY" in missing.stderr
    invalid = _run(base + ["--concurrency", "0"], {"FIMFLEET_KEY": KEY})
    assert invalid.returncode == 2 and "concurrency" in invalid.stderr
    # decode against the ceiling: 1 B/s over 1 B per token is 1 tok/s, which the fake beats; 1 PB/s is unreachable
    for bandwidth, code in (("1", 0), ("1e15", 1)):
        frac = _run(base + ["--min-decode-fraction", "0.5", "--bandwidth-bytes-per-s", bandwidth,
                            "--weight-bytes-per-token", "1"], {"FIMFLEET_KEY": KEY})
        assert frac.returncode == code and "decode ceiling" in frac.stdout, frac.stdout + frac.stderr


def test_cli_over_tls_with_ca_file(tls_fake, pki):
    out = _run(["-m", "components.sla", "--endpoint", tls_fake.url, "--model", MODEL, "--ca",
                pki["ca_file"], "--samples", "2", "--warmup", "1"], {"FIMFLEET_KEY": KEY})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified against ca_pem file" in out.stdout


def test_metrics_parser_and_quantile():
    text = "\n".join([
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.2",model_name="m"} 4.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="other"} 9.0',
        'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 4.0',
    ])
    snap = bench.parse_histogram(text, model="m")
    assert (snap.count, snap.sum) == (4.0, 0.5) and snap.mean == 0.125
    assert snap.quantile(0.5) == pytest.approx(0.1)
    assert snap.quantile(0.75) == pytest.approx(0.15)
    assert bench.parse_histogram(text).count == 13.0


def test_benchmark_probe_vs_server_ttft(fake):
    fake.config.ttft_s = 0.03
    out = _run([str(ROOT / "benchmarks" / "probe_vs_server_ttft.py"), "--endpoint", fake.url,
                "--model", MODEL, "--samples", "6", "--warmup", "2", "--max-tokens", "4", "--json"],
               {"FIMFLEET_KEY": KEY})
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["probe_requests_sent"] == 6 and data["server_ttft_count"] == 6
    assert data["warnings"] == []
    assert data["server_ttft_mean_ms"] >= 30.0
    # the probe sees at least what the server measured, plus a small transport cost
    assert -1.0 <= data["gap_mean_ms"] < 50.0, data
    text = _run([str(ROOT / "benchmarks" / "probe_vs_server_ttft.py"), "--endpoint", fake.url,
                 "--model", MODEL, "--samples", "2", "--warmup", "0"], {"FIMFLEET_KEY": KEY})
    assert text.returncode == 0 and "gap (probe - server)" in text.stdout


def test_benchmark_compare_function_in_process(fake):
    cfg = _cfg(fake, samples=4, warmup=1, max_tokens=4)
    result = bench.compare(dataclasses.replace(cfg), metrics_model=MODEL)
    assert result["server_ttft_count"] == 4 and result["probe_ttft_samples"] == 4
