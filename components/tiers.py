"""Hardware tiers: every default that depends on the box lives here, once.

A stack picks a tier with `fimfleet:tier`; its config only states what differs.
Sizes follow the sizing matrix in docs/sizing.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ZEN4_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")


@dataclass(frozen=True)
class Tier:
    name: str
    device: str
    """cpu or gpu."""
    model: str
    quantization: str
    cpus: int
    memory_gib: int
    memory_bandwidth_gbs: float
    """Sustained memory bandwidth (DRAM for CPU, HBM/GDDR for GPU), for the decode ceiling."""
    required_cpu_flags: tuple[str, ...]
    numa_nodes: int = 1
    max_steal_percent: float = 5.0
    gpu_model: str = ""
    gpu_count: int = 0
    gpu_memory_gib: int = 0
    max_model_len: int = 8192
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    kv_cache_gib: int = 8
    gpu_memory_utilization: float = 0.90
    dtype: str = "bfloat16"
    runtime: str = "systemd"
    start_timeout_s: int = 900
    sla: dict = field(default_factory=dict)


def _cpu(name, model, quant, cpus, mem, bw, **kw):
    sla = kw.pop("sla", {})
    return Tier(name, "cpu", model, quant, cpus, mem, bw, ZEN4_FLAGS, sla=sla, **kw)


QWEN7 = "Qwen/Qwen2.5-Coder-7B"
QWEN14 = "Qwen/Qwen2.5-Coder-14B"
QWEN32 = "Qwen/Qwen2.5-Coder-32B"

TIERS: dict[str, Tier] = {
    t.name: t
    for t in (
        _cpu("cpu-epyc-7b-int4", QWEN7, "gptq-int4", 8, 16, 115, kv_cache_gib=4, max_num_seqs=4,
             sla={"ttftP50Ms": 600, "ttftP95Ms": 1200, "ttftP99Ms": 2000, "minDecodeTokensPerS": 8}),
        _cpu("cpu-epyc-7b-int8", QWEN7, "int8", 16, 32, 230, kv_cache_gib=8,
             sla={"ttftP50Ms": 500, "ttftP95Ms": 1000, "ttftP99Ms": 1500, "minDecodeTokensPerS": 10}),
        _cpu("cpu-epyc-prod", QWEN7, "bf16", 32, 64, 460, kv_cache_gib=16, max_num_seqs=16,
             sla={"ttftP50Ms": 400, "ttftP95Ms": 800, "ttftP99Ms": 1200, "minDecodeTokensPerS": 12}),
        _cpu("cpu-epyc-14b-int4", QWEN14, "gptq-int4", 16, 32, 230, kv_cache_gib=8, max_num_seqs=4,
             sla={"ttftP50Ms": 900, "ttftP95Ms": 1800, "ttftP99Ms": 2500, "minDecodeTokensPerS": 6}),
        _cpu("cpu-epyc-14b-int8", QWEN14, "int8", 32, 64, 460, kv_cache_gib=16,
             sla={"ttftP50Ms": 800, "ttftP95Ms": 1500, "ttftP99Ms": 2200, "minDecodeTokensPerS": 8}),
        _cpu("cpu-epyc-14b-bf16", QWEN14, "bf16", 64, 128, 920, kv_cache_gib=32, numa_nodes=2, max_num_seqs=16,
             sla={"ttftP50Ms": 700, "ttftP95Ms": 1400, "ttftP99Ms": 2000, "minDecodeTokensPerS": 8}),
        Tier("gpu-l40s", "gpu", QWEN14, "bf16", 16, 64, 864, ("avx2",), gpu_model="L40S", gpu_count=1,
             gpu_memory_gib=48, max_model_len=16384, max_num_seqs=32, max_num_batched_tokens=16384,
             runtime="docker", start_timeout_s=1200,
             sla={"ttftP50Ms": 120, "ttftP95Ms": 250, "ttftP99Ms": 400, "minDecodeTokensPerS": 40}),
        Tier("gpu-h100", "gpu", QWEN32, "fp8", 26, 200, 3350, ("avx2",), gpu_model="H100", gpu_count=1,
             gpu_memory_gib=80, max_model_len=32768, max_num_seqs=64, max_num_batched_tokens=16384,
             gpu_memory_utilization=0.92, runtime="docker", start_timeout_s=1800,
             sla={"ttftP50Ms": 100, "ttftP95Ms": 200, "ttftP99Ms": 350, "minDecodeTokensPerS": 45}),
        # The emulated test VM (QEMU TCG): AVX2 only, float32, tiny random model; slow by nature.
        Tier("local-vm", "cpu", "tiny-qwen2-fim", "fp32", 2, 8, 5, ("avx2",), max_steal_percent=100.0,
             max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=1024, kv_cache_gib=1, dtype="float32",
             start_timeout_s=1500,
             sla={"ttftP50Ms": 3000, "ttftP95Ms": 6000, "ttftP99Ms": 8000, "minDecodeTokensPerS": 1,
                  "samples": 6, "warmup": 2, "maxTokens": 8}),
    )
}
