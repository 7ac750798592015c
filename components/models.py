"""Model catalog: the architecture facts that memory sizing needs.

Numbers come from each checkpoint's config.json (num_hidden_layers,
num_key_value_heads, head_dim = hidden_size / num_attention_heads, vocab_size,
tie_word_embeddings) and its published parameter count. A local model directory is
read the same way, so the sizing of the test model is not a guess either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one causal LM checkpoint."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: int
    """Total parameter count, embeddings included."""
    embedding_params: int
    """Input embedding plus LM head (once if tied); they stay 16-bit when the rest is quantized."""
    max_context: int
    supports_fim: bool = True
    attention_heads: int = 0
    """Query heads: tensor parallelism must divide them (0 = unknown)."""


def _qwen2(name, layers, hidden, heads, kv_heads, params, vocab=151936, tied=False, max_context=32768):
    return ModelSpec(
        name=name,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        params=params,
        embedding_params=vocab * hidden * (1 if tied else 2),
        max_context=max_context,
        attention_heads=heads,
    )


CATALOG: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _qwen2("Qwen/Qwen2.5-Coder-1.5B", 28, 1536, 12, 2, 1_543_714_304, tied=True),
        _qwen2("Qwen/Qwen2.5-Coder-7B", 28, 3584, 28, 4, 7_615_616_512),
        _qwen2("Qwen/Qwen2.5-Coder-14B", 48, 5120, 40, 8, 14_770_033_664),
        _qwen2("Qwen/Qwen2.5-Coder-32B", 64, 5120, 40, 8, 32_763_876_352),
    )
}


@dataclass(frozen=True)
class Quantization:
    """How weights are stored: bytes per parameter, and the vLLM `--quantization` value (None = auto/unquantized)."""

    name: str
    bytes_per_param: float
    vllm_method: str | None
    devices: frozenset[str]


# INT4 counts 0.5 byte plus one 16-bit scale and zero point per 128-weight group.
QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        Quantization("fp32", 4.0, None, frozenset({"cpu"})),
        Quantization("bf16", 2.0, None, frozenset({"cpu", "gpu"})),
        Quantization("fp8", 1.0, "fp8", frozenset({"gpu"})),
        Quantization("int8", 1.0 + 4 / 128, None, frozenset({"cpu", "gpu"})),
        Quantization("awq-int4", 0.5 + 4 / 128, "awq", frozenset({"cpu", "gpu"})),
        Quantization("gptq-int4", 0.5 + 4 / 128, "gptq", frozenset({"cpu", "gpu"})),
    )
}


def spec_from_hf_config(name: str, config: dict, params: int | None = None) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config.json (used for local model directories)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    tied = bool(config.get("tie_word_embeddings", False))
    if params is None:
        inter = config["intermediate_size"]
        kv = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim", hidden // heads)
        attn = hidden * heads * head_dim + 2 * hidden * kv * head_dim + heads * head_dim * hidden
        mlp = 3 * hidden * inter
        params = layers * (attn + mlp + 2 * hidden) + vocab * hidden * (1 if tied else 2) + hidden
    return ModelSpec(
        name=name,
        layers=layers,
        kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim", hidden // heads),
        params=params,
        embedding_params=vocab * hidden * (1 if tied else 2),
        max_context=config.get("max_position_embeddings", 32768),
        attention_heads=heads,
    )


def load_local_spec(name: str, model_dir: str | Path) -> ModelSpec:
    """Read a model directory's config.json; raises FileNotFoundError naming the path."""
    path = Path(model_dir) / "config.json"
    return spec_from_hf_config(name, json.loads(path.read_text()))
