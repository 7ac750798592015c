"""Model catalog: the architecture facts that memory sizing needs.

Numbers come from each checkpoint's config.json (num_hidden_layers,
num_key_value_heads, head_dim = hidden_size / num_attention_heads, vocab_size,
tie_word_embeddings) and its published parameter count. A local model directory is
read the same way, so the sizing of the test model is not a guess either.

The FIM format (prompt tokens and stop strings) lives here too, once: the SLA probe, the
engine's readiness check, the monitor's probe and the editor configs all take it from
the model spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GIB = 1024**3

MAX_STOP_WORDS = 4
"""vLLM's OpenAI schema refuses a 5th stop string with HTTP 400 (so does OpenAI's)."""


@dataclass(frozen=True)
class FimFormat:
    """How a base code model is prompted for Fill-in-the-Middle, and where its answer ends.

    The stop strings fire only for tokens the tokenizer does not mark `special`: vLLM
    detokenizes with skip_special_tokens=True, so a special token never reaches the text
    that stop strings are matched against. Qwen2.5-Coder marks its FIM and file tokens
    not special (only <|endoftext|>, its EOS, is), so these stop where an editor expects.
    """

    prefix_token: str
    suffix_token: str
    middle_token: str
    stop: tuple[str, ...]
    """Sent with every FIM request (probe, readiness, editors), in priority order."""

    def __post_init__(self):
        if not 0 < len(self.stop) <= MAX_STOP_WORDS:
            raise ValueError(f"a FIM format needs 1-{MAX_STOP_WORDS} stop strings, got {self.stop!r}")

    def prompt(self, prefix: str, suffix: str) -> str:
        """The prompt for /v1/completions (vLLM rejects the OpenAI `suffix` field for these models)."""
        return f"{self.prefix_token}{prefix}{self.suffix_token}{suffix}{self.middle_token}"

    def handlebars(self) -> str:
        """The same prompt as a Continue.dev autocomplete template (triple braces: no HTML escaping)."""
        return self.prompt("{{{prefix}}}", "{{{suffix}}}")

    def tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.prefix_token, self.suffix_token, self.middle_token, *self.stop)))


QWEN_FIM = FimFormat(
    prefix_token="<|fim_prefix|>", suffix_token="<|fim_suffix|>", middle_token="<|fim_middle|>",
    # End of text, or the model starting another file or FIM frame (Continue's Qwen template
    # lists these first too). <|endoftext|> is also the EOS token, so vLLM stops on it anyway.
    stop=("<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>"),
)
"""Qwen2.5-Coder (base) FIM: https://github.com/QwenLM/Qwen2.5-Coder (FIM tokens 151659-151661)."""


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
    fim: FimFormat | None = QWEN_FIM
    """Its FIM format (None: no FIM tokens, so no autocomplete)."""
    chat: bool = False
    """Has a chat template (an -Instruct model): only then can editors use it for chat."""
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
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
              "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = config.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"config.json's {k} is {v!r}, not a positive whole number")
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    tied = bool(config.get("tie_word_embeddings", False))
    if params is None:
        inter = config["intermediate_size"]
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        attn = hidden * heads * head_dim + 2 * hidden * kv * head_dim + heads * head_dim * hidden
        mlp = 3 * hidden * inter
        params = layers * (attn + mlp + 2 * hidden) + vocab * hidden * (1 if tied else 2) + hidden
    return ModelSpec(
        name=name,
        layers=layers,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        params=params,
        embedding_params=vocab * hidden * (1 if tied else 2),
        max_context=config.get("max_position_embeddings") or 32768,
        attention_heads=heads,
    )


def load_local_spec(name: str, model_dir: str | Path) -> ModelSpec:
    """Read a model directory's config.json (raises FileNotFoundError naming the path) and
    its tokenizer_config.json: FIM only if it defines the FIM tokens, chat only with a chat template."""
    path = Path(model_dir) / "config.json"
    spec = spec_from_hf_config(name, json.loads(path.read_text()))
    tok_path = Path(model_dir) / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text()) if tok_path.is_file() else {}
    tok = tok if isinstance(tok, dict) else {}
    decoder = tok.get("added_tokens_decoder")
    added = {t.get("content") for t in decoder.values() if isinstance(t, dict)} if isinstance(decoder, dict) else set()
    fim = QWEN_FIM if set(QWEN_FIM.tokens()) <= added else None
    chat = bool(tok.get("chat_template")) or (Path(model_dir) / "chat_template.jinja").is_file()
    return replace(spec, fim=fim, chat=chat)


def fim_body(fim: FimFormat | None, served_name: str, prefix: str = "def f(x):\n    return ", suffix: str = "\n",
             max_tokens: int = 1) -> str:
    """JSON body of a short /v1/completions request in a FIM format (readiness and liveness
    probes); without a FIM format, the plain prefix."""
    body = {"model": served_name, "prompt": fim.prompt(prefix, suffix) if fim else prefix,
            "max_tokens": max_tokens, "temperature": 0}
    if fim:
        body["stop"] = list(fim.stop)
    return json.dumps(body)


def readiness_body(spec: ModelSpec, served_name: str, prefix: str = "def f(x):\n    return ", suffix: str = "\n",
                   max_tokens: int = 1) -> str:
    """fim_body in the served model's own FIM format."""
    return fim_body(spec.fim, served_name, prefix, suffix, max_tokens)
