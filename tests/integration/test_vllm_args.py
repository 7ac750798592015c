"""Rendered engine arguments go through the parser of the pinned vLLM, and the classic
runbook mistakes are rejected by it with vLLM's own words."""

from __future__ import annotations

import json

import pytest

from components import config, engine, runtime
from components.tiers import TIERS
from tests.helpers import TINY_CONFIG, raw_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python():
    python = engine.vllm_python()
    assert python, "FIMFLEET_VLLM_PYTHON must point at the pinned vLLM venv (./fimfleet test sets it)"
    return python


def rendered(tier, tmp_path):
    sections = {}
    if tier == "local-vm":  # a model directory's config.json is all the sizing and the arguments need
        (tmp_path / "tiny").mkdir(exist_ok=True)
        (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
        sections = {"host": {"kind": "local-vm", "testbedState": "/x"},
                    "model": {"source": "local", "localPath": str(tmp_path / "tiny"), "servedName": "tiny-qwen2-fim"}}
    raw, secret = raw_config(tier, **sections)
    cfg = config.parse(raw, secret)
    # vLLM validates a --model path on this machine: point a local model at its local copy.
    return engine.render(cfg, cfg.model.local_path if cfg.model.source == "local" else runtime.model_path(cfg))


BASE = ["--model", "Qwen/Qwen2.5-Coder-7B", "--dtype", "bfloat16"]
RUNBOOK_MISTAKES = {
    "--device openvino": (BASE + ["--device", "openvino"], {}, "--device"),
    "--swap-space 4": (BASE + ["--swap-space", "4"], {}, "--swap-space"),
    "--model-format auto": (BASE + ["--model-format", "auto"], {}, "--model-format"),
    "VLLM_OPENVINO_KVCACHE_SPACE": (BASE, {"VLLM_OPENVINO_KVCACHE_SPACE": "8"}, "VLLM_OPENVINO_KVCACHE_SPACE"),
}
CONTROL = "the same base without a mistake"


@pytest.fixture(scope="module")
def parsed(vllm_python, tmp_path_factory) -> dict[str, dict]:
    """Every tier's rendered launch, the runbook mistakes and their control, parsed in ONE vLLM
    interpreter (each import of vLLM takes seconds)."""
    tmp = tmp_path_factory.mktemp("tiers")
    cases = {f"tier {t}": (list(launch.args), launch.env) for t in sorted(TIERS) for launch in [rendered(t, tmp)]}
    cases.update({name: (args, env) for name, (args, env, _) in RUNBOOK_MISTAKES.items()})
    cases[CONTROL] = (BASE, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    return dict(zip(cases, engine.check_many_with_vllm(list(cases.values()), vllm_python)))


def test_every_tier_renders_arguments_vllm_accepts(parsed):
    tiers = {name: r for name, r in parsed.items() if name.startswith("tier ")}
    assert len(tiers) == len(TIERS)
    bad = {t: r["error"] for t, r in tiers.items() if not r["ok"]}
    assert not bad, bad


def test_runbook_mistakes_are_rejected_by_vllm(parsed):
    for name, (_, _, word) in RUNBOOK_MISTAKES.items():
        assert not parsed[name]["ok"], f"{name} was accepted"
        assert word in parsed[name]["error"], parsed[name]["error"]
    assert parsed[CONTROL]["ok"], parsed[CONTROL]  # the control: the same base is fine without the mistake


def test_check_with_vllm_raises_with_vllms_message(vllm_python):
    with pytest.raises(engine.VllmRejected, match="unrecognized arguments: --swap-space"):
        engine.check_with_vllm(BASE + ["--swap-space", "4"], {}, vllm_python)
