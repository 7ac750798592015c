"""Integration smoke test against a REAL vLLM CPU engine on 127.0.0.1.

Session fixtures run ``toolchain/vllm/install.sh`` (cached venv outside the repo; reused
from FIMFLEET_VLLM_PYTHON when set) and ``toolchain/tinymodel/make_tiny_model.py``
(cached tiny random Qwen2 with a FIM tokenizer), then start the OpenAI server with an
API key, stop it by its own process group in teardown, and check:

* one streaming FIM completion: several chunks, usage from ``stream_options``, exactly
  max_tokens tokens (the tiny model never emits ``<|endoftext|>``), same text twice at
  temperature 0;
* ``--api-key`` guards /v1/*, while /health and /metrics stay open;
* vLLM's own parser (``toolchain/vllm/check_args.py``) rejects the classic runbook
  mistakes with vLLM's own messages.

Print the measured numbers with ``pytest -s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK_ARGS = REPO / "toolchain" / "vllm" / "check_args.py"
FIM_PROMPT = "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>"
MAX_TOKENS = 16

from tests.integration.conftest import API_KEY, SERVED  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(2400)]


def _stream_fim(base: str, key: str | None = API_KEY) -> dict:
    body = {
        "model": SERVED, "prompt": FIM_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    first = None
    chunks: list[str] = []
    usage = None
    with httpx.Client(timeout=120) as c, c.stream("POST", base + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    if first is None:
                        first = time.perf_counter()
                    chunks.append(ch["text"])
    return {"chunks": chunks, "usage": usage, "ttft_s": (first - t0) if first else None,
            "total_s": time.perf_counter() - t0}


def test_streaming_fim_completion(vllm_server):
    base = vllm_server["base"]
    warm = _stream_fim(base)  # the first request after a start is slower
    runs = [_stream_fim(base) for _ in range(3)]
    for r in [warm, *runs]:
        assert r["usage"] is not None, "no usage chunk despite stream_options.include_usage"
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        assert r["usage"]["prompt_tokens"] > 3
        assert len(r["chunks"]) >= 2, "completion did not stream"
    texts = {"".join(r["chunks"]) for r in [warm, *runs]}
    assert len(texts) == 1, f"temperature 0 gave different texts: {texts}"
    ttfts = sorted(r["ttft_s"] for r in runs)
    print(f"TTFT warm-up {warm['ttft_s'] * 1000:.0f} ms, then median {ttfts[1] * 1000:.0f} ms; "
          f"text {texts.pop()!r}")


def test_api_key_and_open_endpoints(vllm_server):
    base = vllm_server["base"]
    body = {"model": SERVED, "prompt": FIM_PROMPT, "max_tokens": 1}
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.post(base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
    models = httpx.get(base + "/v1/models", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == SERVED
    # /health and /metrics are NOT behind --api-key (design: ingress ACLs must guard them)
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    metrics = httpx.get(base + "/metrics", timeout=30)
    assert metrics.status_code == 200
    assert "vllm:time_to_first_token_seconds" in metrics.text


def test_vllm_parser_rejects_runbook_mistakes(vllm_python: str, tiny_model: Path):
    m = str(tiny_model)
    cases = [
        {"name": "good", "args": ["--model", m, "--served-model-name", SERVED, "--enforce-eager",
                                  "--dtype", "bfloat16", "--max-model-len", "2048", "--api-key", "k",
                                  "--enable-prefix-caching", "--enable-chunked-prefill",
                                  "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
                                  "--uvicorn-log-level", "warning"],
         "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "deep": True},
        {"name": "device", "args": ["--model", m, "--device", "openvino"]},
        {"name": "swap", "args": ["--model", m, "--swap-space", "4"]},
        {"name": "format", "args": ["--model", m, "--model-format", "auto"]},
        {"name": "openvino-env", "args": ["--model", m], "env": {"VLLM_OPENVINO_KVCACHE_SPACE": "4"}},
        {"name": "bnb", "args": ["--model", m, "--quantization", "bitsandbytes"], "deep": True},
    ]
    r = subprocess.run([vllm_python, str(CHECK_ARGS), "--batch"], input=json.dumps(cases),
                       capture_output=True, text=True, timeout=600)
    out = json.loads(r.stdout)
    res = {c["name"]: c for c in out["results"]}
    print(f"\nvLLM {out['vllm_version']}: parser import {out['import_seconds']} s")
    assert res["good"]["ok"], res["good"]["errors"]
    assert "ambiguous option: --device" in res["device"]["errors"][0]
    assert "unrecognized arguments: --swap-space" in res["swap"]["errors"][0]
    assert "unrecognized arguments: --model-format" in res["format"]["errors"][0]
    assert res["openvino-env"]["errors"] == ["unknown vLLM environment variable: VLLM_OPENVINO_KVCACHE_SPACE"]
    assert "Unknown quantization method: bitsandbytes" in res["bnb"]["errors"][0]
    assert r.returncode == 1  # some cases are bad


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
