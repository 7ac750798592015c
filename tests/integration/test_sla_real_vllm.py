"""The SLA gate against a REAL vLLM engine behind the REAL nginx ingress.

The FimSlaCheck provider's create runs the streaming FIM probe through TLS with a named key:
a generous SLA passes, an impossible one (p99 TTFT under 1 ms) fails with the report, and a
stalled engine (SIGSTOP) fails within the bounded timeouts instead of hanging.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from components.sla.probe import ProbeConfig, check_sla
from components.sla.provider import FimSlaCheckProvider
from components.sla.report import SlaViolationError
from components.sla.thresholds import SlaThresholds
from tests.integration.conftest import API_KEY, SERVED
from tests.integration.nginx_harness import vllm_behind_nginx

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

KEY = "sk-fimfleet-sla-probe-key-0123456789"


@pytest.fixture(scope="module")
def ingress(vllm_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("sla-ingress")
    with vllm_behind_nginx(root, vllm_server, {"probe": KEY}, API_KEY) as ing:
        yield {**ing, "pid": vllm_server["pid"]}


def props(ingress, **thresholds):
    return {"endpoint": ingress["endpoint"], "api_key": KEY, "ca_pem": ingress["ca"], "model": SERVED,
            "trigger": "t1", "thresholds": thresholds, "samples": 8, "warmup": 2, "max_tokens": 8}


def test_generous_sla_passes_through_nginx(ingress):
    out = FimSlaCheckProvider().create(props(ingress, ttft_p99_ms=5000, min_decode_tokens_per_s=1)).outs
    report = out["report"]
    assert out["passed"] is True
    assert report["ttft_ms"]["p50"] > 0 and report["error_rate"] == 0
    assert report["decode_tokens_per_s"]["p50"] > 1
    assert KEY not in repr(out)
    print(f"\nreal vLLM through nginx: {out['summary']}")


def test_impossible_sla_fails_with_the_report(ingress):
    with pytest.raises(SlaViolationError) as err:
        FimSlaCheckProvider().create(props(ingress, ttft_p50_ms=0.001, ttft_p95_ms=0.001, ttft_p99_ms=0.001))
    text = str(err.value)
    assert "ttft_p99_ms" in text and "0.001" in text and "FAIL" in text
    assert KEY not in text


def test_stalled_engine_fails_within_bounds(ingress):
    cfg = ProbeConfig(endpoint=ingress["endpoint"], model=SERVED, api_key=KEY, ca_pem=ingress["ca"], samples=3,
                      warmup=0, max_tokens=8, request_timeout_s=4, read_timeout_s=3, max_consecutive_errors=2)
    os.killpg(ingress["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        result = check_sla(cfg, SlaThresholds(ttft_p99_ms=5000))
    finally:
        os.killpg(ingress["pid"], signal.SIGCONT)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"a stalled engine held the probe for {elapsed:.0f}s"
    assert not result.passed and result.report.to_dict()["ok"] == 0
    assert "aborted after 2 consecutive errors" in result.summary
