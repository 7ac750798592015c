"""The RENDERED host preflight, run by bash against a fake host: /proc and /sys files from a
temp dir (FIMFLEET_PREFLIGHT_PROC/_SYS), a fake `nvidia-smi` printing exactly what the real
one prints (`NVIDIA H200, 143771`: a comma, then a space), and a PATH holding only the
tools the script needs, so nothing depends on this machine's CPU, RAM or GPU.

The script is rendered from a stack config parsed by components/config.py, as in production,
and run the way RemoteStep runs it (`bash -s` with `set -euo pipefail` first).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from components import config, host, tiers
from tests.helpers import raw_config

TOOLS = ("awk", "cut", "grep", "head", "hostname", "mktemp", "rm", "sleep", "tr")
GPU_TIERS = sorted(n for n, t in tiers.TIERS.items() if t.device == "gpu")
CPU_TIERS = sorted(n for n, t in tiers.TIERS.items() if t.device == "cpu" and not t.test_only)
# What `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` prints for
# one real GPU of each tier's model.
REAL_GPU = {"H100": "NVIDIA H100 80GB HBM3, 81559", "L40S": "NVIDIA L40S, 46068"}
H200 = "NVIDIA H200, 143771"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")
ZEN3_FLAGS = ("fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")  # Zen 2/3: no AVX-512


@dataclass
class FakeHost:
    cpus: int
    memory_gib: int
    flags: tuple[str, ...]
    numa_nodes: int = 1
    smi: str | None = None
    """Stdout of the fake nvidia-smi; None: no nvidia-smi on PATH."""
    smi_exit: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_tier(cls, name: str, **kw) -> FakeHost:
        t = tiers.TIERS[name]
        return cls(cpus=t.cpus, memory_gib=t.memory_gib, flags=("fpu", *t.required_cpu_flags),
                   numa_nodes=t.numa_nodes, **kw)

    def build(self, root: Path) -> dict[str, str]:
        proc, sys_, fake, tools = (root / d for d in ("proc", "sys", "fake-bin", "tools"))
        for d in (proc, sys_, fake, tools):
            d.mkdir(parents=True)
        cpu = f"vendor_id\t: AuthenticAMD\nflags\t\t: {' '.join(self.flags)}\n\n"
        (proc / "cpuinfo").write_text("".join(f"processor\t: {i}\n{cpu}" for i in range(self.cpus)))
        (proc / "meminfo").write_text(f"MemTotal:       {self.memory_gib * 1048576 + 2048} kB\nMemFree: 1 kB\n")
        (proc / "stat").write_text("cpu  100 0 50 1000 0 0 0 0 0 0\ncpu0 100 0 50 1000 0 0 0 0 0 0\n")
        for i in range(self.numa_nodes):
            (sys_ / "devices" / "system" / "node" / f"node{i}").mkdir(parents=True)
        for tool in TOOLS:
            path = shutil.which(tool)
            assert path, f"{tool} is needed to run the preflight"
            (tools / tool).symlink_to(path)
        script(fake / "systemctl", "exit 0\n")
        if self.smi is not None:
            want = "--query-gpu=name,memory.total --format=csv,noheader,nounits"
            script(fake / "nvidia-smi",
                   f'[ "$*" = "{want}" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}\n'
                   f'printf "%s\\n" {shlex.quote(self.smi)}\nexit {self.smi_exit}\n')
        return {"PATH": f"{fake}:{tools}", "FIMFLEET_PREFLIGHT_PROC": str(proc), "FIMFLEET_PREFLIGHT_SYS": str(sys_),
                "FIMFLEET_PREFLIGHT_STEAL_S": "0", "LC_ALL": "C", **self.extra}


def script(path: Path, body: str) -> None:
    path.write_text(f"#!{shutil.which('bash')}\n{body}")
    path.chmod(0o755)


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def facts(self) -> dict:
        return json.loads(self.out.strip().splitlines()[-1])


def preflight(tier: str, fake: FakeHost, tmp_path: Path, host_override: dict | None = None,
              runtime_override: dict | None = None, **sections) -> Result:
    """Render for `tier` (+ config `sections`), run against `fake`; `host_override` and
    `runtime_override` set parsed fields directly, past config validation (to test the template's
    quoting alone, or to point a path into the test's temp dir)."""
    raw, secret = raw_config(tier, **sections)
    cfg = config.parse(raw, secret)
    if host_override:
        cfg = dataclasses.replace(cfg, host=dataclasses.replace(cfg.host, **host_override))
    if runtime_override:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **runtime_override))
    body = host.preflight_script(cfg)
    env = fake.build(tmp_path)
    proc = subprocess.run([shutil.which("bash"), "-s"], input="set -euo pipefail\n" + body, env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "command not found" not in proc.stderr and "expression expected" not in proc.stderr, proc.stderr
    return Result(proc.returncode, proc.stdout, proc.stderr)


def passes(r: Result) -> dict:
    assert r.code == 0, r.err
    return r.facts


def fails(r: Result, *words: str) -> str:
    assert r.code == 1, (r.code, r.out, r.err)
    assert "fimfleet preflight failed" in r.err
    for w in words:
        assert w in r.err, f"{w!r} not in:\n{r.err}"
    return r.err


# ------------------------------------------------------------------------ GPU tiers


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_each_gpu_tier_accepts_its_real_gpu(tier, tmp_path):
    smi = REAL_GPU[tiers.TIERS[tier].gpu_model]
    facts = passes(preflight(tier, FakeHost.for_tier(tier, smi=smi), tmp_path))
    assert facts["gpus"] == 1 and facts["cpus"] == tiers.TIERS[tier].cpus


def test_h200_serves_the_h100_tier(tmp_path):
    """The output that the old parser turned into `integer expression expected`."""
    assert passes(preflight("gpu-h100", FakeHost.for_tier("gpu-h100", smi=H200), tmp_path))["gpus"] == 1


def test_h200_serves_an_h100_tier_only_with_the_memory(tmp_path):
    # An H100 tier asking for more memory than an H200 has: the H200 is refused for memory.
    err = fails(preflight("gpu-h100", FakeHost.for_tier("gpu-h100", smi=H200), tmp_path,
                          host={"address": "203.0.113.10", "gpuMemoryGiB": 160}),
                "'NVIDIA H200' has 143771 MiB", "fimfleet:host.gpuMemoryGiB")
    assert "152587 MiB" in err  # 160e9 bytes


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_two_gpus(tier, tmp_path):
    smi = REAL_GPU[tiers.TIERS[tier].gpu_model]
    assert passes(preflight(tier, FakeHost.for_tier(tier, smi=f"{smi}\n{smi}"), tmp_path))["gpus"] == 2


def test_two_gpus_wanted_one_found(tmp_path):
    fails(preflight("gpu-h100", FakeHost.for_tier("gpu-h100", smi=REAL_GPU["H100"]), tmp_path,
                    host={"address": "203.0.113.10", "gpuCount": 2}),
          "found 1 usable GPU(s) of 1", "needs 2 x H100", "gpuCount")


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_missing_nvidia_smi(tier, tmp_path):
    fails(preflight(tier, FakeHost.for_tier(tier, smi=None), tmp_path), "nvidia-smi not found",
          "install the NVIDIA driver", f"fimfleet:host.gpuModel = {tiers.TIERS[tier].gpu_model}")


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_driver_not_loaded(tier, tmp_path):
    fails(preflight(tier, FakeHost.for_tier(tier, smi=NO_DRIVER, smi_exit=9), tmp_path),
          "nvidia-smi failed", "couldn't communicate with the NVIDIA driver", "install the NVIDIA driver")


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_smaller_gpu_is_refused_at_the_boundary(tier, tmp_path):
    t = tiers.TIERS[tier]
    _, min_mib = tiers.gpu_requirement(t.gpu_model, t.gpu_memory_gib)
    name = REAL_GPU[t.gpu_model].split(",")[0]
    fails(preflight(tier, FakeHost.for_tier(tier, smi=f"{name}, {min_mib - 1}"), tmp_path / "small"),
          f"has {min_mib - 1} MiB, less than the {min_mib} MiB", "fimfleet:host.gpuMemoryGiB")
    passes(preflight(tier, FakeHost.for_tier(tier, smi=f"{name}, {min_mib}"), tmp_path / "exact"))


@pytest.mark.parametrize("tier,smi", [("gpu-l40s", "NVIDIA L40, 46068"), ("gpu-l40s", "NVIDIA L4, 23034"),
                                      ("gpu-l40s", H200), ("gpu-h100", "NVIDIA A100-SXM4-80GB, 81920")])
def test_other_gpu_models_are_refused(tier, smi, tmp_path):
    fails(preflight(tier, FakeHost.for_tier(tier, smi=smi), tmp_path),
          f"GPU 1 is '{smi.split(',')[0]}'", "not one of", "found 0 usable GPU(s) of 1")


def test_unreadable_memory_is_a_problem_not_a_crash(tmp_path):
    fails(preflight("gpu-h100", FakeHost.for_tier("gpu-h100", smi="NVIDIA H100 80GB HBM3, [N/A]"), tmp_path),
          "reports memory '[N/A]', not a number of MiB")


def test_gpu_model_from_config_reaches_bash_as_data(tmp_path):
    """Config values are quoted (`| q`): a hostile gpuModel is printed, never run."""
    hostile = "H100 $(touch pwned) `touch pwned2`"
    fails(preflight("gpu-h100", FakeHost.for_tier("gpu-h100", smi=REAL_GPU["H100"]), tmp_path,
                    host_override={"gpu_model": hostile}), f"needs 1 x {hostile} with 80 GB")
    assert not list(tmp_path.glob("pwned*"))


def test_multi_word_gpu_model_from_config(tmp_path):
    raw_smi = "NVIDIA GeForce RTX 4090, 24564"
    passes(preflight("gpu-l40s", FakeHost.for_tier("gpu-l40s", smi=raw_smi), tmp_path,
                     host={"address": "203.0.113.10", "gpuModel": "RTX 4090", "gpuMemoryGiB": 24},
                     model={"id": "Qwen/Qwen2.5-Coder-7B"}))


# ------------------------------------------------------------------------ CPU tiers


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_each_cpu_tier_accepts_a_host_of_its_size(tier, tmp_path):
    facts = passes(preflight(tier, FakeHost.for_tier(tier), tmp_path))
    t = tiers.TIERS[tier]
    assert facts == {"cpus": t.cpus, "memoryGiB": t.memory_gib, "numaNodes": t.numa_nodes,
                     "stealPercent": 0.0, "gpus": 0}


def test_avx2_only_cpu_is_told_the_avx2_tiers(tmp_path):
    err = fails(preflight("cpu-epyc-7b-int4", FakeHost(cpus=8, memory_gib=16, flags=ZEN3_FLAGS), tmp_path),
                "CPU flag avx512f missing", "tier cpu-epyc-7b-int4")
    named = [t.name for t in tiers.TIERS.values()
             if t.device == "cpu" and not t.test_only and set(t.required_cpu_flags) <= set(ZEN3_FLAGS)]
    assert named, "there must be CPU tiers for an AVX2-only EPYC"
    for name in named:
        assert name in err
    for name in set(CPU_TIERS) - set(named):  # AVX-512 tiers are not offered to this CPU
        assert f"{name} (" not in err
    # and every tier it names accepts that CPU
    for name in named:
        t = tiers.TIERS[name]
        passes(preflight(name, FakeHost(cpus=t.cpus, memory_gib=t.memory_gib, flags=ZEN3_FLAGS), tmp_path / name))


def test_cpu_without_avx2_is_told_no_tier_fits(tmp_path):
    fails(preflight("cpu-epyc-7b-int4", FakeHost(cpus=8, memory_gib=16, flags=("fpu", "sse4_2")), tmp_path),
          "CPU flag avx2 missing", "no fimfleet CPU tier runs on this CPU")


def test_small_host_lists_every_problem(tmp_path):
    fake = FakeHost(cpus=4, memory_gib=8, flags=tiers.ZEN4_FLAGS, numa_nodes=2)
    err = fails(preflight("cpu-epyc-prod", fake, tmp_path), "host has 8 GiB RAM", "host has 4 CPUs, the stack expects 32",
                "host has 2 NUMA nodes, the stack expects 1", "fimfleet:host.memoryGiB", "fimfleet:host.numaNodes")
    assert "nvidia-smi" not in err


def test_a_venv_path_holding_something_else_stops_before_anything_changes(tmp_path):
    """The install replaces runtime.venvPath and destroy deletes it: a directory there that
    fimfleet did not install (no stamp) is refused by the read-only preflight."""
    tier = "cpu-epyc-prod"
    theirs = tmp_path / "srv" / "app"
    (theirs / "data").mkdir(parents=True)
    fails(preflight(tier, FakeHost.for_tier(tier), tmp_path / "a", runtime_override={"venv_path": str(theirs)}),
          f"{theirs} is there and is not a venv fimfleet installed", "fimfleet:runtime.venvPath")
    assert (theirs / "data").is_dir()
    (theirs / ".fimfleet-lock").write_text("0123456789abcdef\n")  # one fimfleet installed: replaced, as always
    passes(preflight(tier, FakeHost.for_tier(tier), tmp_path / "b", runtime_override={"venv_path": str(theirs)}))
    passes(preflight(tier, FakeHost.for_tier(tier), tmp_path / "c", runtime_override={"venv_path": str(tmp_path / "new")}))
    # the docker runtime installs no venv: the path is not its concern
    passes(preflight(tier, FakeHost.for_tier(tier), tmp_path / "d",
                     runtime={"kind": "docker", "image": "vllm/vllm-openai-cpu:v0.32.0"},
                     runtime_override={"venv_path": str(theirs / "data")}))


def test_avx2_tier_decode_sla_sits_under_its_ceiling():
    """The AVX2 tiers' decode floor is 40 % of bandwidth / weight bytes, as the Zen 4 tiers'."""
    from components import models, sizing

    avx2 = [t for t in tiers.TIERS.values() if t.required_cpu_flags == tiers.AVX2_FLAGS]
    assert {t.quantization for t in avx2} == {"int8", "bf16"}  # no W4A16 kernel in the AVX2 build
    for t in avx2:
        ceiling = sizing.decode_ceiling_tokens_per_s(models.CATALOG[t.model], models.QUANTIZATIONS[t.quantization],
                                                     t.memory_bandwidth_gbs * 1e9)
        assert t.sla["minDecodeTokensPerS"] == int(0.4 * ceiling), (t.name, ceiling)
