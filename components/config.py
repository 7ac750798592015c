"""Typed stack config: `pulumi.Config("fimfleet")` -> validated dataclasses.

Every problem is reported at once, each with its key path, the bad value and the fix.
Unknown keys are errors, so a typo never passes silently. Defaults come from the
tier (components/tiers.py), never from literals scattered over the components.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from components import models, sizing
from components.tiers import TIERS, Tier

NAMESPACE = "fimfleet"
SECRET_KEYS = ("sshPrivateKey", "apiKeys", "hfToken", "tlsCert", "tlsKey")


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    fix: str

    def __str__(self) -> str:
        shown = "<secret>" if self.key.split(".")[0].split("[")[0] in SECRET_KEYS else json.dumps(self.value, default=str)
        return f"{NAMESPACE}:{self.key} = {shown}: {self.fix}"


class ConfigError(ValueError):
    """All problems of one stack config; str() lists them one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid stack config:\n" + "\n".join(f"  - {p}" for p in problems))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def key(**kw):
    """A config field: `check(value) -> fix text or None`, plus the allowed `choices`."""
    default = kw.pop("default", None)
    return field(default=default, metadata=kw)


def _range(lo, hi):
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


PORT = _range(1, 65535)
POSITIVE = _range(1, 10**9)


@dataclass(frozen=True)
class HostConfig:
    kind: str = key(choices=("ssh", "local-vm"), default="ssh")
    address: str = key(default="")
    port: int = key(check=PORT, default=22)
    user: str = key(default="root")
    bastion: dict = key(default=None, subkeys=("address", "port", "user"))
    testbed_state: str = key(default="")
    """local-vm: the testbed's state directory (holds info.json, written by toolchain/testbed/vm.py)."""
    cpus: int = key(check=POSITIVE)
    memory_gib: int = key(check=POSITIVE)
    memory_bandwidth_gbs: float = key(check=_range(0.1, 100000))
    numa_nodes: int = key(check=_range(1, 64))
    cpu_flags: list = key()
    max_steal_percent: float = key(check=_range(0, 100))
    gpu_model: str = key()
    gpu_count: int = key(check=_range(0, 16))
    gpu_memory_gib: int = key(check=_range(0, 1024))


@dataclass(frozen=True)
class ModelConfig:
    id: str = key()
    quantization: str = key(choices=tuple(models.QUANTIZATIONS))
    source: str = key(choices=("hf", "local"), default="hf")
    local_path: str = key(default="")
    served_name: str = key(default="")
    revision: str = key(default="")


@dataclass(frozen=True)
class EngineConfig:
    port: int = key(check=PORT, default=8000)
    max_model_len: int = key(check=_range(256, 1 << 20))
    max_num_seqs: int = key(check=_range(1, 4096))
    max_num_batched_tokens: int = key(check=_range(256, 1 << 22))
    dtype: str = key(choices=("auto", "bfloat16", "float16", "float32"))
    kv_cache_gib: int = key(check=_range(1, 4096))
    kv_cache_dtype: str = key(choices=("auto", "fp8"), default="auto")
    threads_bind: str = key(default="auto")
    reserved_cpus: int = key(check=_range(0, 64), default=1)
    gpu_memory_utilization: float = key(check=_range(0.1, 0.98))
    tensor_parallel_size: int = key(check=_range(1, 16), default=1)
    enforce_eager: bool = key(default=False)
    enable_prefix_caching: bool = key(default=True)
    enable_chunked_prefill: bool = key(default=True)
    extra_args: list = key(default=())
    env: dict = key(default=None)


@dataclass(frozen=True)
class RuntimeConfig:
    kind: str = key(choices=("systemd", "docker"))
    vllm_version: str = key(default="0.32.0")
    image: str = key(default="")
    pip_spec: str = key(default="")
    index_url: str = key(default="")
    wheelhouse_url: str = key(default="")
    venv_path: str = key(default="/opt/fimfleet/vllm")
    start_timeout_s: int = key(check=_range(30, 7200))
    allocator: str = key(choices=("jemalloc", "tcmalloc", "none"), default="jemalloc")


@dataclass(frozen=True)
class IngressConfig:
    domain: str = key(default="")
    tls: str = key(choices=("self-signed", "provided", "acme"), default="self-signed")
    acme_email: str = key(default="")
    https_port: int = key(check=PORT, default=443)
    http_port: int = key(check=PORT, default=80)
    rate_per_second: int = key(check=_range(1, 10000), default=10)
    burst: int = key(check=_range(0, 100000), default=40)
    metrics_allow_cidrs: list = key(default=())
    read_timeout_s: int = key(check=_range(10, 86400), default=600)


@dataclass(frozen=True)
class MonitorConfig:
    interval_s: int = key(check=_range(5, 3600), default=15)
    failure_threshold: int = key(check=_range(1, 100), default=3)
    probe_timeout_s: int = key(check=_range(1, 600), default=30)
    watchdog: bool = key(default=False)


@dataclass(frozen=True)
class SlaConfig:
    enabled: bool = key(default=True)
    ttft_p50_ms: float = key(check=_range(0.001, 10**6))
    ttft_p95_ms: float = key(check=_range(0.001, 10**6))
    ttft_p99_ms: float = key(check=_range(0.001, 10**6))
    min_decode_tokens_per_s: float = key(check=_range(0, 10**6))
    samples: int = key(check=_range(1, 10000), default=20)
    warmup: int = key(check=_range(0, 1000), default=3)
    concurrency: int = key(check=_range(1, 256), default=1)
    max_tokens: int = key(check=_range(1, 4096), default=16)
    max_errors: int = key(check=_range(0, 10000), default=0)


@dataclass(frozen=True)
class KernelConfig:
    sysctl: dict = key(default=None)
    """Overrides of the tuned sysctl values (components/kernel.py), by sysctl name."""


@dataclass(frozen=True)
class Secrets:
    """Secret config values (plain strings here; components wrap them as Pulumi secrets)."""

    ssh_private_key: str = ""
    api_keys: dict = field(default_factory=dict)
    hf_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""


@dataclass(frozen=True)
class StackConfig:
    tier: Tier
    host: HostConfig
    model: ModelConfig
    engine: EngineConfig
    runtime: RuntimeConfig
    ingress: IngressConfig
    monitor: MonitorConfig
    sla: SlaConfig
    kernel: KernelConfig
    secrets: Secrets
    model_spec: models.ModelSpec
    memory: sizing.MemoryPlan


SECTIONS = {
    "host": HostConfig, "model": ModelConfig, "engine": EngineConfig, "runtime": RuntimeConfig,
    "ingress": IngressConfig, "monitor": MonitorConfig, "sla": SlaConfig, "kernel": KernelConfig,
}
TOP_LEVEL = ("tier", *SECTIONS, *SECRET_KEYS)
PY_TYPES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "a map"}


def _tier_defaults(tier: Tier) -> dict[str, dict[str, Any]]:
    """The tier's values for each section, in config-key spelling."""
    return {
        "host": {"cpus": tier.cpus, "memoryGiB": tier.memory_gib, "memoryBandwidthGBs": tier.memory_bandwidth_gbs,
                 "numaNodes": tier.numa_nodes, "cpuFlags": list(tier.required_cpu_flags),
                 "maxStealPercent": tier.max_steal_percent, "gpuModel": tier.gpu_model,
                 "gpuCount": tier.gpu_count, "gpuMemoryGiB": tier.gpu_memory_gib},
        "model": {"id": tier.model, "quantization": tier.quantization},
        "engine": {"maxModelLen": tier.max_model_len, "maxNumSeqs": tier.max_num_seqs,
                   "maxNumBatchedTokens": tier.max_num_batched_tokens, "dtype": tier.dtype,
                   "kvCacheGiB": tier.kv_cache_gib, "gpuMemoryUtilization": tier.gpu_memory_utilization},
        "runtime": {"kind": tier.runtime, "startTimeoutS": tier.start_timeout_s},
        "sla": dict(tier.sla),
    }


def _config_key(f) -> str:
    # memoryGiB / memoryBandwidthGBs / gpuMemoryGiB / kvCacheGiB keep their unit's capitals.
    return {"memory_gib": "memoryGiB", "gpu_memory_gib": "gpuMemoryGiB", "kv_cache_gib": "kvCacheGiB",
            "memory_bandwidth_gbs": "memoryBandwidthGBs"}.get(f.name, _camel(f.name))


def _parse_section(name, cls, raw, defaults, problems):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(Problem(name, raw, f"must be a map of settings: {', '.join(_config_key(f) for f in fields(cls))}"))
        raw = {}
    known = {_config_key(f): f for f in fields(cls)}
    for k in raw:
        if k not in known:
            close = [c for c in known if c.lower() == str(k).lower()]
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(f"{name}.{k}", raw[k], f"unknown key; {hint}known keys: {', '.join(known)}"))
    values = {}
    for ck, f in known.items():
        v = raw.get(ck, defaults.get(ck, f.default))
        want = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str, "bool": bool,
                                                         "list": list, "dict": dict}.get(str(f.type))
        if v is None:
            values[f.name] = None
            continue
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if want is list and isinstance(v, tuple):
            v = list(v)
        if want and not (isinstance(v, want) and not (want in (int, float) and isinstance(v, bool))):
            problems.append(Problem(f"{name}.{ck}", v, f"must be {PY_TYPES.get(want, want.__name__)}"))
            continue
        md = f.metadata
        if "choices" in md and v not in md["choices"]:
            problems.append(Problem(f"{name}.{ck}", v, f"must be one of: {', '.join(md['choices'])}"))
            continue
        if "check" in md and (msg := md["check"](v)):
            problems.append(Problem(f"{name}.{ck}", v, msg))
            continue
        if "subkeys" in md:
            for sk in v:
                if sk not in md["subkeys"]:
                    problems.append(Problem(f"{name}.{ck}.{sk}", v[sk], f"unknown key; known keys: {', '.join(md['subkeys'])}"))
        values[f.name] = v
    return cls(**values)


IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
CPU_LIST = re.compile(r"^(auto|nobind|all|\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*)$")


def parse(raw: dict[str, Any], secret_keys: frozenset[str] = frozenset()) -> StackConfig:
    """Validate a stack's fimfleet config. `raw` maps short keys (no namespace) to parsed values."""
    problems: list[Problem] = []
    for k in raw:
        if k not in TOP_LEVEL:
            close = [c for c in TOP_LEVEL if c.lower() == k.lower()]
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(k, raw[k], f"unknown key; {hint}known keys: {', '.join(TOP_LEVEL)}"))
    tier_name = raw.get("tier")
    if tier_name not in TIERS:
        problems.append(Problem("tier", tier_name, f"set a known tier: {', '.join(TIERS)}"))
        raise ConfigError(problems)
    tier = TIERS[tier_name]
    defaults = _tier_defaults(tier)
    sec = {name: _parse_section(name, cls, raw.get(name), defaults.get(name, {}), problems)
           for name, cls in SECTIONS.items()}

    for sk in SECRET_KEYS:
        if sk in raw and sk not in secret_keys:
            problems.append(Problem(sk, "<plain text>", f"store it as a secret: pulumi config set --secret {NAMESPACE}:{sk} ..."))
    api_keys = raw.get("apiKeys") or {}
    if not isinstance(api_keys, dict) or not api_keys:
        problems.append(Problem("apiKeys", "<secret>", "set at least one named key: pulumi config set --secret --path 'apiKeys.alice' <key of 32+ chars>"))
        api_keys = {}
    for name, val in api_keys.items():
        if not IDENT.match(str(name)):
            problems.append(Problem(f"apiKeys.{name}", "<secret>", "key names are identifiers: letters, digits and _ (1-63 chars, not starting with a digit)"))
        if not isinstance(val, str) or len(val) < 24 or not re.fullmatch(r"[A-Za-z0-9._~+/=-]+", val):
            problems.append(Problem(f"apiKeys.{name}", "<secret>", "each key must be 24+ URL-safe characters without spaces or quotes (e.g. openssl rand -hex 24)"))
    secrets = Secrets(ssh_private_key=raw.get("sshPrivateKey", ""), api_keys=dict(api_keys),
                      hf_token=raw.get("hfToken", ""), tls_cert=raw.get("tlsCert", ""), tls_key=raw.get("tlsKey", ""))

    host, model, engine, runtime, ingress = sec["host"], sec["model"], sec["engine"], sec["runtime"], sec["ingress"]
    _check_host(host, secrets, problems)
    model_spec = _check_model(model, tier, problems)
    _check_engine(engine, host, tier, problems)
    _check_runtime(runtime, tier, problems)
    _check_ingress(ingress, secrets, problems)
    sla = sec["sla"]
    if None not in (sla.ttft_p50_ms, sla.ttft_p95_ms, sla.ttft_p99_ms) and not sla.ttft_p50_ms <= sla.ttft_p95_ms <= sla.ttft_p99_ms:
        problems.append(Problem("sla", {"ttftP50Ms": sla.ttft_p50_ms, "ttftP95Ms": sla.ttft_p95_ms, "ttftP99Ms": sla.ttft_p99_ms},
                                "percentile limits must not decrease: ttftP50Ms <= ttftP95Ms <= ttftP99Ms"))
    for k, v in (sec["kernel"].sysctl or {}).items():
        if not re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+)+", str(k)):
            problems.append(Problem(f"kernel.sysctl.{k}", v, "not a sysctl name (dotted, e.g. vm.swappiness)"))

    memory = None
    needed = (host.memory_gib, host.gpu_memory_gib, engine.kv_cache_gib, engine.max_model_len, engine.max_num_seqs,
              engine.gpu_memory_utilization, engine.tensor_parallel_size)
    if model_spec is not None and model.quantization in models.QUANTIZATIONS and None not in needed:
        memory = _check_memory(model_spec, model, engine, host, tier, problems)
    if problems:
        raise ConfigError(problems)
    return StackConfig(tier=tier, secrets=secrets, model_spec=model_spec, memory=memory, **sec)


def _check_host(host, secrets, problems):
    if host.kind == "ssh":
        if not host.address:
            problems.append(Problem("host.address", host.address, "set the VPS address: pulumi config set --path fimfleet:host.address 203.0.113.10"))
        else:
            try:
                ipaddress.ip_address(host.address)
            except ValueError:
                if not re.fullmatch(r"(?=.{1,253}$)([A-Za-z0-9-]{1,63}\.)*[A-Za-z0-9-]{1,63}", host.address):
                    problems.append(Problem("host.address", host.address, "must be an IP address or a DNS name"))
        if not secrets.ssh_private_key:
            problems.append(Problem("sshPrivateKey", "<unset>", "set the SSH key: pulumi config set --secret fimfleet:sshPrivateKey < ~/.ssh/id_ed25519"))
        elif "PRIVATE KEY" not in secrets.ssh_private_key:
            problems.append(Problem("sshPrivateKey", "<secret>", "must be a PEM/OpenSSH private key (-----BEGIN ... PRIVATE KEY-----)"))
    elif host.kind == "local-vm" and not host.testbed_state:
        problems.append(Problem("host.testbedState", host.testbed_state, "set the testbed state dir (./fimfleet demo does this)"))
    if host.bastion and not host.bastion.get("address"):
        problems.append(Problem("host.bastion.address", None, "a bastion needs an address"))


def _check_model(model, tier, problems):
    quant = models.QUANTIZATIONS.get(model.quantization)
    if quant and tier.device not in quant.devices:
        problems.append(Problem("model.quantization", model.quantization,
                                f"not runnable by vLLM on {tier.device}; choose one of: "
                                + ", ".join(q for q, v in models.QUANTIZATIONS.items() if tier.device in v.devices)))
    if model.source == "local":
        if not model.local_path:
            problems.append(Problem("model.localPath", model.local_path, "set the local model directory to copy to the host"))
            return None
        try:
            return models.load_local_spec(model.served_name or Path(model.local_path).name, model.local_path)
        except (OSError, KeyError, ValueError) as e:
            problems.append(Problem("model.localPath", model.local_path, f"must be a model directory with a readable config.json ({e})"))
            return None
    spec = models.CATALOG.get(model.id)
    if spec is None:
        problems.append(Problem("model.id", model.id, f"unknown model; use one of {', '.join(models.CATALOG)} or model.source=local"))
    elif model.id.lower().endswith("-instruct"):
        problems.append(Problem("model.id", model.id, "FIM needs the base checkpoint; drop -Instruct"))
    return spec


def _check_engine(engine, host, tier, problems):
    if not CPU_LIST.match(engine.threads_bind or ""):
        problems.append(Problem("engine.threadsBind", engine.threads_bind, "must be auto, nobind, or a CPU list like 0-31 (ranks separated by |)"))
    if tier.device == "gpu" and host.gpu_count and engine.tensor_parallel_size > host.gpu_count:
        problems.append(Problem("engine.tensorParallelSize", engine.tensor_parallel_size, f"cannot exceed host.gpuCount ({host.gpu_count})"))
    if tier.device == "cpu" and engine.dtype == "float16":
        problems.append(Problem("engine.dtype", engine.dtype, "vLLM on CPU runs bfloat16 or float32; use bfloat16"))
    if engine.max_num_batched_tokens and engine.max_model_len and engine.max_num_batched_tokens < engine.max_num_seqs:
        problems.append(Problem("engine.maxNumBatchedTokens", engine.max_num_batched_tokens, "must be at least engine.maxNumSeqs"))
    if tier.device == "cpu" and host.cpus and engine.reserved_cpus >= host.cpus:
        problems.append(Problem("engine.reservedCpus", engine.reserved_cpus, f"must leave CPUs for the engine (host.cpus = {host.cpus})"))
    for a in engine.extra_args or ():
        if not isinstance(a, str) or not a.startswith("--"):
            problems.append(Problem("engine.extraArgs", a, "each extra argument must be a string starting with -- (values go in their own item)"))
            break
    for k, v in (engine.env or {}).items():
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", str(k)) or not isinstance(v, (str, int, float)):
            problems.append(Problem(f"engine.env.{k}", v, "environment names are UPPER_CASE and values are strings"))


def _check_runtime(runtime, tier, problems):
    if tier.device == "gpu" and runtime.kind == "systemd":
        problems.append(Problem("runtime.kind", runtime.kind, "GPU tiers run the vllm/vllm-openai container: use docker"))
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", runtime.vllm_version or ""):
        problems.append(Problem("runtime.vllmVersion", runtime.vllm_version, "must be an exact release like 0.32.0"))
    for k in ("index_url", "wheelhouse_url"):
        v = getattr(runtime, k)
        if v and not re.match(r"^https?://", v):
            problems.append(Problem(f"runtime.{_camel(k)}", v, "must be an http(s) URL"))


def _check_ingress(ingress, secrets, problems):
    for i, c in enumerate(ingress.metrics_allow_cidrs or ()):
        try:
            ipaddress.ip_network(c, strict=False)
        except (ValueError, TypeError):
            problems.append(Problem(f"ingress.metricsAllowCidrs[{i}]", c, "must be a CIDR like 10.0.0.0/8"))
    if ingress.https_port == ingress.http_port:
        problems.append(Problem("ingress.httpPort", ingress.http_port, "must differ from ingress.httpsPort"))
    if ingress.tls == "provided" and not (secrets.tls_cert and secrets.tls_key):
        problems.append(Problem("tlsCert", "<unset>", "tls=provided needs secrets fimfleet:tlsCert and fimfleet:tlsKey (PEM)"))
    if ingress.tls == "acme":
        if not ingress.domain:
            problems.append(Problem("ingress.domain", ingress.domain, "ACME needs a public DNS name pointing at the host"))
        if "@" not in (ingress.acme_email or ""):
            problems.append(Problem("ingress.acmeEmail", ingress.acme_email, "ACME needs a contact email"))


def _check_memory(spec, model, engine, host, tier, problems):
    quant = models.QUANTIZATIONS[model.quantization]
    if engine.max_model_len > spec.max_context:
        problems.append(Problem("engine.maxModelLen", engine.max_model_len, f"{spec.name} supports at most {spec.max_context} tokens"))
        return None
    kv_bytes = sizing.KV_BYTES["fp8" if engine.kv_cache_dtype == "fp8" else "bf16"]
    if tier.device == "cpu":
        plan = sizing.plan_cpu(spec, quant, ram_bytes=host.memory_gib * models.GIB,
                               kv_cache_bytes=engine.kv_cache_gib * models.GIB, max_model_len=engine.max_model_len,
                               max_num_seqs=engine.max_num_seqs, kv_dtype_bytes=kv_bytes)
        where = "host.memoryGiB"
    else:
        plan = sizing.plan_gpu(spec, quant, vram_bytes_per_gpu=host.gpu_memory_gib * models.GIB,
                               gpus=engine.tensor_parallel_size, utilization=engine.gpu_memory_utilization,
                               max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs, kv_dtype_bytes=kv_bytes)
        where = "host.gpuMemoryGiB"
    if not plan.fits:
        if plan.total > plan.capacity:
            problems.append(Problem(where, host.memory_gib if tier.device == "cpu" else host.gpu_memory_gib,
                                    f"{spec.name} ({model.quantization}) does not fit: {plan.explain()}. "
                                    "Use a smaller quantization, a smaller engine.kvCacheGiB, or a bigger tier"))
        else:
            problems.append(Problem("engine.kvCacheGiB" if tier.device == "cpu" else "engine.maxModelLen",
                                    engine.kv_cache_gib if tier.device == "cpu" else engine.max_model_len,
                                    f"the KV cache cannot hold one full-context sequence: {plan.explain()}. "
                                    "Raise the KV cache or lower engine.maxModelLen"))
    return plan


def from_pulumi() -> StackConfig:
    """Read every `fimfleet:*` key of the running stack (unknown keys included, to reject them)."""
    from pulumi.runtime import config as rc

    raw, secret = {}, set()
    prefix = NAMESPACE + ":"
    for full, value in rc.CONFIG.get().items():
        if not full.startswith(prefix):
            continue
        short = full[len(prefix):]
        try:
            raw[short] = json.loads(value)
        except (TypeError, json.JSONDecodeError):
            raw[short] = value
        if rc.is_config_secret(full):
            secret.add(short)
    # A plain string that happens to parse as JSON (e.g. "8000") stays a string only where a string is wanted.
    for k in ("sshPrivateKey", "hfToken", "tlsCert", "tlsKey", "tier"):
        if k in raw and not isinstance(raw[k], str):
            raw[k] = rc.CONFIG.get()[prefix + k]
    return parse(raw, frozenset(secret))
