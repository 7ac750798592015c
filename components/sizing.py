"""Memory sizing and the theoretical decode ceiling (pure functions).

The engine is OOM-killed at start when weights + KV cache + runtime overhead exceed
what the host can give it; this module does that arithmetic at preview time so a
stack that cannot fit fails before any host is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.models import GIB, ModelSpec, Quantization

KV_BYTES = {"auto": 2, "bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str) -> int:
    """Bytes per cached K or V element: fp8 when asked for, else vLLM keeps the cache in the
    model's dtype (auto: the checkpoint's 16 bits). benchmarks/kv_sizing_vs_vllm.py: 0.0 % off
    vLLM's own count for bfloat16 and float32 (float32 holds half the tokens of bfloat16)."""
    if kv_cache_dtype == "fp8":
        return KV_BYTES["fp8"]
    return KV_BYTES["fp32"] if dtype == "float32" else KV_BYTES["bf16"]


def kv_bytes_per_token(model: ModelSpec, kv_dtype_bytes: int = 2) -> int:
    """K and V for every layer: 2 x layers x KV heads x head dim x bytes."""
    return 2 * model.layers * model.kv_heads * model.head_dim * kv_dtype_bytes


def weight_bytes(model: ModelSpec, quant: Quantization) -> int:
    """Quantized body plus 16-bit embeddings (embeddings are not quantized by AWQ/GPTQ/INT8 checkpoints)."""
    if quant.bytes_per_param >= 2:
        return int(model.params * quant.bytes_per_param)
    body = model.params - model.embedding_params
    return int(body * quant.bytes_per_param + model.embedding_params * 2)


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine needs against what the host offers, in bytes."""

    weights: int
    kv_per_token: int
    kv_needed: int
    """KV for max_num_seqs sequences at full context."""
    kv_budget: int
    """KV space the engine will actually reserve (CPU: VLLM_CPU_KVCACHE_SPACE; GPU: what is left)."""
    overhead: int
    capacity: int
    """RAM (CPU, minus the OS reserve) or VRAM x utilization (GPU, summed over tensor-parallel ranks)."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_budget + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.kv_budget >= self.kv_per_token * self.min_tokens

    min_tokens: int = 0
    """At least one full-context sequence must fit in the KV budget."""

    def explain(self) -> str:
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        return (
            f"weights {g(self.weights)} + KV cache {g(self.kv_budget)} + overhead {g(self.overhead)} "
            f"= {g(self.total)} against {g(self.capacity)} available; "
            f"KV per token {self.kv_per_token:,} B, one full-context sequence needs "
            f"{g(self.kv_per_token * self.min_tokens)}, all sequences at full context {g(self.kv_needed)}"
        )


CPU_RUNTIME_OVERHEAD = 3 * GIB
"""vLLM CPU process: Python, torch, oneDNN scratch and the sampler (measured about 2-3 GB RSS with a tiny model)."""
CPU_OS_RESERVE = 2 * GIB
"""Left to the OS, nginx and sshd."""
GPU_ACTIVATION_OVERHEAD = 2 * GIB
"""Per GPU: CUDA context, activations and CUDA graphs."""


def plan_cpu(model, quant, *, ram_bytes, kv_cache_bytes, max_model_len, max_num_seqs, kv_dtype_bytes=2):
    kv_tok = kv_bytes_per_token(model, kv_dtype_bytes)
    return MemoryPlan(
        weights=weight_bytes(model, quant),
        kv_per_token=kv_tok,
        kv_needed=kv_tok * max_model_len * max_num_seqs,
        kv_budget=kv_cache_bytes,
        overhead=CPU_RUNTIME_OVERHEAD,
        capacity=ram_bytes - CPU_OS_RESERVE,
        min_tokens=max_model_len,
    )


def plan_gpu(model, quant, *, vram_bytes_per_gpu, gpus, utilization, max_model_len, max_num_seqs, kv_dtype_bytes=2):
    kv_tok = kv_bytes_per_token(model, kv_dtype_bytes)
    capacity = int(vram_bytes_per_gpu * utilization) * gpus
    weights = weight_bytes(model, quant)
    overhead = GPU_ACTIVATION_OVERHEAD * gpus
    return MemoryPlan(
        weights=weights,
        kv_per_token=kv_tok,
        kv_needed=kv_tok * max_model_len * max_num_seqs,
        kv_budget=max(capacity - weights - overhead, 0),
        overhead=overhead,
        capacity=capacity,
        min_tokens=max_model_len,
    )


def kv_capacity_report(plan: MemoryPlan | None, vllm_tokens: int | None) -> dict:
    """The plan's KV token capacity beside what vLLM allocated (its cache_config_info), and the error."""
    predicted = plan.kv_budget // plan.kv_per_token if plan and plan.kv_per_token else None
    error = round(100.0 * (predicted - vllm_tokens) / vllm_tokens, 2) if predicted and vllm_tokens else None
    return {"predicted_tokens": predicted, "vllm_tokens": int(vllm_tokens) if vllm_tokens else None, "error_pct": error}


def decode_weight_bytes(model: ModelSpec, quant: Quantization, dtype: str = "auto") -> int:
    """Weight bytes one decode step reads: all of them (these models are dense), an unquantized
    model in the engine's dtype (float32: 4 bytes a parameter, as the local test model runs)."""
    if quant.bytes_per_param >= 2 and dtype == "float32":
        return int(model.params * 4)
    return weight_bytes(model, quant)


def decode_ceiling_tokens_per_s(model: ModelSpec, quant: Quantization, bandwidth_bytes_per_s: float,
                                dtype: str = "auto") -> float:
    """Upper bound for single-stream decode: every token reads all weights once from memory."""
    return bandwidth_bytes_per_s / decode_weight_bytes(model, quant, dtype)
