"""The preview's vLLM argument check remembers what vLLM accepted (importing vLLM takes seconds
per preview), and never a refusal. A fake interpreter stands in for vLLM and counts its runs;
tests/integration/test_vllm_args.py runs the real parser, uncached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components import engine

ARGS = ["--model", "/m", "--max-model-len", "1024"]


def fake_vllm(tmp_path: Path, ok: bool) -> tuple[str, Path]:
    calls = tmp_path / "calls"
    py = tmp_path / "python"
    reply = json.dumps({"results": [{"name": "0", "ok": ok, "errors": [] if ok else ["unrecognized arguments: --x"]}]})
    py.write_text(f"#!/bin/sh\ncat >/dev/null\necho run >> {calls}\necho '{reply}'\n")
    py.chmod(0o755)
    return str(py), calls


def runs(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_an_accepted_set_is_parsed_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    py, calls = fake_vllm(tmp_path, ok=True)
    engine.check_with_vllm(ARGS, {"VLLM_CPU_KVCACHE_SPACE": "1"}, py)
    engine.check_with_vllm(ARGS, {"VLLM_CPU_KVCACHE_SPACE": "1"}, py)
    assert runs(calls) == 1
    engine.check_with_vllm(ARGS + ["--enforce-eager"], {"VLLM_CPU_KVCACHE_SPACE": "1"}, py)
    engine.check_with_vllm(ARGS, {"VLLM_CPU_KVCACHE_SPACE": "2"}, py)
    assert runs(calls) == 3, "other arguments or another environment must be parsed again"
    engine.check_many_with_vllm([(ARGS, {"VLLM_CPU_KVCACHE_SPACE": "1"})], py)
    assert runs(calls) == 4, "check_many_with_vllm (the tests' path) always parses"


def test_a_refusal_is_never_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("FIMFLEET_CACHE", str(tmp_path / "cache"))
    py, calls = fake_vllm(tmp_path, ok=False)
    for _ in range(2):
        with pytest.raises(engine.VllmRejected, match="unrecognized arguments"):
            engine.check_with_vllm(ARGS, {}, py)
    assert runs(calls) == 2
    assert not list((tmp_path / "cache").glob("**/*.ok"))


def test_without_a_cache_dir_every_check_parses(tmp_path, monkeypatch):
    monkeypatch.delenv("FIMFLEET_CACHE", raising=False)
    py, calls = fake_vllm(tmp_path, ok=True)
    engine.check_with_vllm(ARGS, {}, py)
    engine.check_with_vllm(ARGS, {}, py)
    assert runs(calls) == 2
