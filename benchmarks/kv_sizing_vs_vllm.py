#!/usr/bin/env python3
"""components/sizing.py's KV-cache arithmetic against what vLLM really allocates (issue 13, item 3).

Why: preview-time sizing (components/checks.py check_memory -> sizing.plan_cpu) decides
whether a stack fits and how many full-context sequences the KV cache holds. If
``kv_bytes_per_token`` were wrong, a stack could pass preview and then have a KV cache
that holds fewer tokens than planned. This script starts native vLLM CPU with the tiny FIM
model (as tests/integration/conftest.py's ``vllm_server`` fixture does) at several
``VLLM_CPU_KVCACHE_SPACE`` values (and dtypes), one at a time, and captures what the engine
reports:

  * the engine log line ``CPU KV cache size: N tokens, Maximum concurrency for L tokens per
    request: Cx`` and ``Explicitly set (G/T) GiB for KV cache``;
  * ``vllm:cache_config_info`` from /metrics (num_gpu_blocks x block_size, cache_dtype).

Prediction, exactly as check_memory does it: the spec from ``models.load_local_spec`` (the
tiny model's config.json), ``sizing.kv_dtype_bytes(kv_cache_dtype, dtype)`` (fp8 when asked
for, else the model's dtype: 4 bytes for ``--dtype float32``), predicted tokens =
``sizing.plan_cpu``'s KV budget / ``kv_bytes_per_token``. Error % = (predicted - vLLM) / vLLM.

    .venv/bin/python benchmarks/kv_sizing_vs_vllm.py [--settings 1:bfloat16,2:bfloat16,1:float32] \\
        [--out benchmarks/results/kv_sizing_vs_vllm.json]

Progress on stderr; every engine is stopped (its own process group) in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks._engine import (MAX_MODEL_LEN, SERVED, Engine, arm_sigterm, make_log, tiny_model,  # noqa: E402
                                vllm_python, vllm_versions)
from components import models, sizing  # noqa: E402

_SIZE_RE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_SET_RE = re.compile(r"(?:Explicitly|Auto) set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
_INFO_RE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
log = make_log("kv-sizing")


def _cache_config_info(base: str) -> Optional[dict[str, str]]:
    """Labels of /metrics' ``vllm:cache_config_info``, or None while the API server is not up yet."""
    try:
        r = httpx.get(base + "/metrics", timeout=3)
    except httpx.HTTPError:
        return None
    info = _INFO_RE.search(r.text) if r.status_code == 200 else None
    return dict(_LABEL_RE.findall(info.group("labels"))) if info else None


def measure(engine: Engine, timeout_s: float, want_metrics: bool) -> dict[str, Any]:
    """Start one engine, read what it says about its KV cache, stop it."""
    out: dict[str, Any] = {"kv_cache_gib": engine.kv_gib, "dtype": engine.dtype}
    engine.start()
    try:
        while time.monotonic() - engine.t0 < timeout_s:
            text = engine.log_text()
            engine.check_alive()
            m = _SIZE_RE.search(text)
            if m and "log_tokens" not in out:
                out["log_tokens"] = int(m.group(1).replace(",", ""))
                out["log_max_concurrency"] = float(m.group(3))
                out["log_line"] = m.group(0)
                s = _SET_RE.search(text)
                if s:
                    out["log_kv_gib_set"] = float(s.group(1))
                log(f"  engine: {m.group(0)}")
                if not want_metrics:
                    break
            labels = _cache_config_info(engine.base) if "log_tokens" in out else None
            if labels:
                out["metrics_cache_config_info"] = {k: labels[k] for k in sorted(labels) if k in (
                    "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype", "kv_cache_memory_bytes",
                    "cpu_kvcache_space_bytes", "enable_prefix_caching")}
                nb, bs = labels.get("num_gpu_blocks"), labels.get("block_size")
                if nb not in (None, "", "None") and bs not in (None, "", "None"):
                    out["metrics_tokens"] = int(nb) * int(bs)
                log(f"  /metrics cache_config_info: {out['metrics_cache_config_info']}")
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"no KV cache report within {timeout_s:g}s:\n{engine.log_text()[-3000:]}")
        out["seconds_to_report"] = round(time.monotonic() - engine.t0, 1)
    finally:
        engine.stop()
    engine.discard_log()
    return out


def predict(model: Path, kv_gib: int, dtype: str, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """The product's own rule, as components/checks.py check_memory applies it."""
    spec = models.load_local_spec(SERVED, model)
    kv_bytes = sizing.kv_dtype_bytes(kv_cache_dtype, dtype)
    plan = sizing.plan_cpu(spec, models.QUANTIZATIONS["bf16"], ram_bytes=64 * models.GIB,
                           kv_cache_bytes=kv_gib * models.GIB, max_model_len=MAX_MODEL_LEN, max_num_seqs=1,
                           kv_dtype_bytes=kv_bytes)
    return {
        "spec": {"layers": spec.layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim},
        "kv_dtype_bytes_as_checks_py": kv_bytes,
        "kv_bytes_per_token": sizing.kv_bytes_per_token(spec, kv_bytes),
        "predicted_tokens": plan.kv_budget // plan.kv_per_token,
        "predicted_max_concurrency": plan.kv_budget / (plan.kv_per_token * MAX_MODEL_LEN),
    }


def _err(pred: Optional[int], real: Optional[int]) -> Optional[float]:
    return round(100.0 * (pred - real) / real, 3) if pred is not None and real else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="1:bfloat16,2:bfloat16,3:bfloat16,1:float32",
                   help="comma-separated GIB:DTYPE engine starts")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per engine start")
    p.add_argument("--no-metrics", action="store_true", help="stop at the log line, skip /metrics (quicker)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kv_sizing_vs_vllm.json"))
    p.add_argument("--no-out", action="store_true")
    p.add_argument("--append", action="store_true",
                   help="keep the other settings already in --out (one engine start per call on a busy machine)")
    a = p.parse_args()
    arm_sigterm()

    py = vllm_python()
    model = tiny_model(py)
    ver = vllm_versions(py)[0]
    rows = []
    if a.append and Path(a.out).is_file():
        asked = {tuple(i.split(":")) for i in a.settings.split(",")}
        rows = [r for r in json.loads(Path(a.out).read_text()).get("settings", [])
                if (str(r["kv_cache_gib"]), r["dtype"]) not in asked]
    for item in a.settings.split(","):
        gib, dtype = item.split(":")
        real = measure(Engine(py, model, kv_gib=int(gib), dtype=dtype, log=log), a.timeout, not a.no_metrics)
        pred = predict(model, int(gib), dtype)
        vllm_tokens = real.get("metrics_tokens") or real.get("log_tokens")
        row = {**real, **pred, "vllm_tokens": vllm_tokens,
               "error_pct": _err(pred["predicted_tokens"], vllm_tokens),
               "log_vs_metrics_tokens_agree": (real.get("metrics_tokens") in (None, real.get("log_tokens")))}
        row["within_5pct"] = row["error_pct"] is not None and abs(row["error_pct"]) <= 5
        rows.append(row)
        log(f"KVCACHE_SPACE={gib} {dtype}: vLLM {vllm_tokens:,} tokens, sizing.py {pred['predicted_tokens']:,} "
            f"({row['error_pct']}%)")
    result = {
        "benchmark": "kv_sizing_vs_vllm",
        "issue": "13 item 3: sizing.py's KV token capacity within 5% of vLLM's",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"nproc": os.cpu_count(), "vllm": ver, "mem_total_gib":
                    round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / models.GIB, 1)},
        "model": str(model),
        "max_model_len": MAX_MODEL_LEN,
        "formula": "predicted tokens = VLLM_CPU_KVCACHE_SPACE GiB / (2 x layers x kv_heads x head_dim x kv_dtype_bytes)",
        "settings": sorted(rows, key=lambda r: (r["dtype"], r["kv_cache_gib"])),
        "all_within_5pct_as_checks_py": all(r["within_5pct"] for r in rows),
    }
    if not a.no_out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.out}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
