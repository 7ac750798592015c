"""Sizing arithmetic reproduces the worked examples exactly."""

import dataclasses

import pytest

from components import models, sizing
from components.models import CATALOG, GIB, QUANTIZATIONS

Q7 = CATALOG["Qwen/Qwen2.5-Coder-7B"]
Q14 = CATALOG["Qwen/Qwen2.5-Coder-14B"]


def test_kv_bytes_per_token_worked_examples():
    assert sizing.kv_bytes_per_token(Q7) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert sizing.kv_bytes_per_token(Q14) == 2 * 48 * 8 * 128 * 2 == 196_608
    assert sizing.kv_bytes_per_token(Q7, kv_dtype_bytes=1) == 28_672


def test_weights_per_quantization():
    assert sizing.weight_bytes(Q7, QUANTIZATIONS["bf16"]) == 7_615_616_512 * 2
    embed = 151_936 * 3_584 * 2  # untied input embedding + LM head stay 16-bit
    assert Q7.embedding_params == embed
    body = 7_615_616_512 - embed
    assert sizing.weight_bytes(Q7, QUANTIZATIONS["int8"]) == int(body * (1 + 4 / 128) + embed * 2)
    assert sizing.weight_bytes(Q7, QUANTIZATIONS["gptq-int4"]) == int(body * (0.5 + 4 / 128) + embed * 2)
    assert sizing.weight_bytes(Q7, QUANTIZATIONS["fp32"]) == 7_615_616_512 * 4


def test_cpu_plan_fits_and_explains_numbers():
    plan = sizing.plan_cpu(Q7, QUANTIZATIONS["bf16"], ram_bytes=64 * GIB, kv_cache_bytes=16 * GIB,
                           max_model_len=8192, max_num_seqs=16)
    assert plan.kv_needed == 57_344 * 8192 * 16
    assert plan.total == 15_231_233_024 + 16 * GIB + sizing.CPU_RUNTIME_OVERHEAD
    assert plan.fits
    assert "14.2 GiB" in plan.explain() and "62.0 GiB available" in plan.explain()


def test_cpu_plan_that_does_not_fit():
    plan = sizing.plan_cpu(Q14, QUANTIZATIONS["bf16"], ram_bytes=32 * GIB, kv_cache_bytes=8 * GIB,
                           max_model_len=8192, max_num_seqs=8)
    assert not plan.fits and plan.total > plan.capacity


def test_kv_budget_must_hold_one_full_context_sequence():
    plan = sizing.plan_cpu(Q14, QUANTIZATIONS["int8"], ram_bytes=128 * GIB, kv_cache_bytes=1 * GIB,
                           max_model_len=32768, max_num_seqs=1)
    assert plan.total <= plan.capacity
    assert not plan.fits  # 196,608 B x 32,768 tokens = 6 GiB > 1 GiB


def test_gpu_plan_kv_is_what_is_left():
    plan = sizing.plan_gpu(Q14, QUANTIZATIONS["bf16"], vram_bytes_per_gpu=48 * GIB, gpus=1, utilization=0.9,
                           max_model_len=16384, max_num_seqs=32)
    assert plan.kv_budget == int(48 * GIB * 0.9) - plan.weights - sizing.GPU_ACTIVATION_OVERHEAD
    assert plan.fits


def test_decode_ceiling():
    # 460 GB/s over 15.23 GB of BF16 weights: about 30 tokens/s for one stream.
    assert sizing.decode_ceiling_tokens_per_s(Q7, QUANTIZATIONS["bf16"], 460e9) == pytest.approx(460e9 / 15_231_233_024)
    assert round(sizing.decode_ceiling_tokens_per_s(Q7, QUANTIZATIONS["bf16"], 460e9), 1) == 30.2


def test_params_derived_from_hf_config_match_published_count():
    cfg = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
    spec = models.spec_from_hf_config("q7", cfg)
    # Qwen2.5-7B's config vocab is padded to 152064; counted without biases it is within 0.5%.
    assert spec.params == pytest.approx(7_615_616_512, rel=0.005)
    assert sizing.kv_bytes_per_token(spec) == 57_344


@pytest.mark.parametrize("kv_cache_dtype, dtype, tokens_per_gib", [
    # vLLM 0.32's own "KV cache size" for the tiny model (2 layers, 1 KV head of 64) at 1 GiB,
    # recorded by benchmarks/kv_sizing_vs_vllm.py: float32 keeps the cache in 4-byte elements
    ("auto", "bfloat16", 2_097_152), ("auto", "float32", 1_048_576), ("auto", "auto", 2_097_152),
    ("fp8", "float32", 4_194_304),
])
def test_kv_cache_takes_the_models_dtype_unless_fp8(kv_cache_dtype, dtype, tokens_per_gib):
    tiny = dataclasses.replace(Q7, layers=2, kv_heads=1, head_dim=64)
    per_token = sizing.kv_bytes_per_token(tiny, sizing.kv_dtype_bytes(kv_cache_dtype, dtype))
    assert GIB // per_token == tokens_per_gib


def test_the_kv_report_puts_the_plan_beside_vllms_count():
    plan = sizing.MemoryPlan(weights=1, kv_per_token=512, kv_needed=0, kv_budget=1 << 30, overhead=0, capacity=1 << 40,
                             min_tokens=1)
    assert sizing.kv_capacity_report(plan, 2_097_152) == {"predicted_tokens": 2_097_152, "vllm_tokens": 2_097_152,
                                                         "error_pct": 0.0}
    assert sizing.kv_capacity_report(plan, 1_048_576)["error_pct"] == 100.0  # a plan twice what vLLM gave
    assert sizing.kv_capacity_report(None, 5)["predicted_tokens"] is None
    assert sizing.kv_capacity_report(plan, None)["error_pct"] is None
