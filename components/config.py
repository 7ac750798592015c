"""Typed stack config: `pulumi.Config("fimfleet")` -> validated dataclasses.

Every problem is reported at once, each with its key path, the bad value and the fix.
Unknown keys are errors, so a typo never passes silently. Defaults come from the
tier (components/tiers.py), never from literals scattered over the components.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from components import gateway_render, grammar, ingress_render, models, sizing
from components.cloud_types import PROVIDERS, plain_credentials
from components.problems import NAMESPACE, SECRET_KEYS, ConfigError, Problem, beneath_own, masked  # noqa: F401 - the types config's users import
from components.tiers import TIERS, Tier

OTHER_NAMESPACES = ("pulumi", "hcloud", "aws", "digitalocean")
"""Config namespaces that belong to Pulumi itself or to the cloud providers fimfleet uses."""
STRING_SECRETS = tuple(k for k in SECRET_KEYS if k != "apiKeys")


def camel(name: str) -> str:
    """The stack YAML's key for a field name: error messages name the key a user types."""
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def snake(key: str) -> str:
    """camel's inverse: the field that holds a stack key's value (hfToken -> hf_token)."""
    return re.sub("([A-Z])", r"_\1", key).lower()


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
    provider: str = key(choices=PROVIDERS)
    """How the host is obtained (components/cloud_types.py); unset: host.kind, else ssh."""
    kind: str = key(choices=PROVIDERS)
    """Older name of host.provider, still accepted; after parsing both hold the provider."""
    address: str = key(default="")
    port: int = key(check=PORT, default=22)
    user: str = key(default="root")
    bastion: dict = key(default=None, subkeys=("address", "port", "user", "hostKey"))
    testbed_state: str = key(default="")
    """local-vm: the testbed's state directory (holds info.json, written by toolchain/testbed/vm.py)."""
    host_key: str = key(default="")
    """The host's SSH public key (`ssh-ed25519 AAAA...`); unset: trusted on first contact and pinned in state."""
    gone: bool = key(default=False)
    """The host no longer exists: destroy and refresh skip it instead of retrying."""
    cpus: int = key(check=POSITIVE)
    memory_gib: int = key(check=POSITIVE)
    memory_bandwidth_gbs: float = key(check=_range(0.1, 100000))
    numa_nodes: int = key(check=_range(1, 64))
    cpu_flags: list = key()
    max_steal_percent: float = key(check=_range(0, 100))
    gpu_model: str = key(check=grammar.gpu_model)
    gpu_count: int = key(check=_range(0, 16))
    gpu_memory_gib: int = key(check=_range(0, 1024))
    region: str = key(default="")
    """Cloud providers: Hetzner location (fsn1) or AWS region (us-east-1); unset: the provider's default."""
    instance_type: str = key(default="")
    """Cloud providers: a type from cloud_types.TYPES; unset: the cheapest that carries the tier."""
    image: str = key(default="")
    """Cloud providers: a Hetzner image name or an AMI ID; unset: looked up (GPU: NVIDIA driver + container toolkit)."""
    admin_cidrs: list = key(default=())
    """Cloud providers: the only networks allowed to SSH in (fimfleet connects from one of them)."""
    dns_zone: str = key(default="")
    """Cloud providers: DNS zone on the same provider that gets an A record for ingress.domain."""


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
    port: int = key(check=_range(1024, 65535), default=8000)  # the engine's user has no capabilities
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
    registry_user: str = key(default="")
    """docker: the login for the image's registry; its password is the secret registryPassword."""


@dataclass(frozen=True)
class IngressConfig:
    domain: str = key(default="")
    tls: str = key(choices=("self-signed", "provided", "acme"), default="self-signed")
    allow_self_signed: bool = key(default=False)
    """Accept tls=self-signed on a non-local stack: policy/ blocks it otherwise; editors then pin caPem."""
    acme_email: str = key(default="")
    https_port: int = key(check=PORT, default=443)
    http_port: int = key(check=PORT, default=80)
    rate_per_second: int = key(check=ingress_render.rule("rate_per_second"), default=10)
    burst: int = key(check=ingress_render.rule("burst"), default=40)
    metrics_allow_cidrs: list = key(default=())
    read_timeout_s: int = key(check=ingress_render.rule("read_timeout_s"), default=600)
    max_conns_per_address: int = key(check=ingress_render.rule("max_conns_per_address"), default=32)
    """Requests in progress per client address (nginx limit_conn); more get 429."""
    client_max_body_size: str = key(check=ingress_render.rule("client_max_body_size", allow_empty=True), default="")
    """Largest request body in nginx syntax (e.g. 256k); empty: derived from engine.maxModelLen."""
    cert_validity_days: int = key(check=_range(1, 365), default=365)
    """Life of the self-signed certificate (tls.MAX_VALIDITY_DAYS at most; reissued under 30 days left)."""


@dataclass(frozen=True)
class MonitorConfig:
    interval_s: int = key(check=_range(5, 3600), default=5)
    failure_threshold: int = key(check=_range(1, 100), default=2)
    probe_timeout_s: int = key(check=_range(1, 600))
    """Unset: derived from sla.ttftP99Ms (components/monitor.py settings)."""
    stall_s: int = key(check=_range(10, 3600), default=30)
    """Seconds of unchanged vLLM /metrics before a failing engine counts as hung (> a full-batch prefill)."""
    watchdog: bool = key(default=False)
    probe_key_rotation: str = key(default="")
    """Change to any new value to rotate the node's own probe key (components/keys.py)."""


@dataclass(frozen=True)
class SlaConfig:
    enabled: bool = key(default=True)
    ttft_p50_ms: float = key(check=_range(0.001, 10**6))
    ttft_p95_ms: float = key(check=_range(0.001, 10**6))
    ttft_p99_ms: float = key(check=_range(0.001, 10**6))
    min_decode_tokens_per_s: float = key(check=lambda v: None if v == 0 or 0.01 <= v <= 10**6 else
                                         "must be 0 (not checked) or a rate between 0.01 and 1000000 tokens/s")
    min_decode_ceiling_fraction: float = key(check=lambda v: None if 0 < v <= 1 else "must be a fraction in (0, 1], e.g. 0.7")
    """The median decode rate as a fraction of the node's decode ceiling (systemd runtime only:
    its bandwidth probe measures the ceiling). Unset: not checked."""
    samples: int = key(check=_range(1, 10000), default=20)
    warmup: int = key(check=_range(0, 1000), default=3)
    concurrency: int = key(check=_range(1, 256), default=1)
    max_tokens: int = key(check=_range(1, 4096), default=16)
    max_errors: int = key(check=_range(0, 10000), default=0)


@dataclass(frozen=True)
class MonitoringConfig:
    """Prometheus and node_exporter on the node (components/monitoring.py): loopback only,
    reached through the SSH tunnel in the output prometheusTunnel. Value rules live there."""

    enabled: bool = key(default=True)
    scrape_interval_s: int = key(default=15)
    retention: str = key(default="15d")
    alertmanager_webhook_url: str = key(default="")
    """Off when empty; else Debian's Alertmanager sends every alert to this http(s) webhook."""


@dataclass(frozen=True)
class GatewayConfig:
    """The fleet's one endpoint (components/gateway.py): nginx in front of every node."""

    host: str = key(default="")
    """A node, beside which the gateway runs, or its own machine's address; empty: no gateway."""
    host_key: str = key(default="")
    """The SSH host key of the gateway's own machine (like nodes.<name>.hostKey)."""
    https_port: int = key(check=PORT, default=443)
    http_port: int = key(check=PORT, default=80)
    max_fails: int = key(check=_range(1, 100), default=2)
    """Failed attempts within failTimeoutS after which a node gets no requests for failTimeoutS."""
    fail_timeout_s: int = key(check=_range(1, 3600), default=10)
    member_port: int = key(check=PORT, default=gateway_render.MEMBER_PORT)
    """Port of the gateway's loopback member servers, one per node; change it if the host uses it."""


@dataclass(frozen=True)
class RolloutConfig:
    """How a change rolls over the nodes behind the gateway: the first node alone, then waves."""

    max_unavailable: int = key(check=_range(1, 1000), default=1)
    drain_timeout_s: int = key(check=_range(1, 3600), default=60)
    """Longest wait for a drained node's streams to finish before its engine restarts."""


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
    registry_password: str = ""


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
    monitoring: MonitoringConfig
    gateway: GatewayConfig
    rollout: RolloutConfig
    secrets: Secrets
    model_spec: models.ModelSpec
    memory: sizing.MemoryPlan
    nodes: dict = field(default_factory=dict)
    """Node name -> NodeConfig, in rollout order; `host` and `memory` are the first node's."""
    node_key: str = "host"
    """Where this view's host facts are set: `host`, or `nodes.<name>` in the fimfleet:nodes form."""
    gateway_host: HostConfig | None = None
    """The gateway's own machine (host.* with gateway.host as its address), when it has one."""

    def node_names(self) -> list[str]:
        return list(self.nodes) or ["node"]

    def for_node(self, name: str) -> "StackConfig":
        """This stack as node `name` sees it: its own host facts and memory plan."""
        if not self.nodes:
            return self
        n = self.nodes[name]
        return replace(self, host=n.host, memory=n.memory, node_key=n.key)

    def for_gateway(self) -> "StackConfig":
        """This stack as the gateway's own machine sees it (it runs no engine: no memory plan)."""
        return replace(self, host=self.gateway_host, memory=None, node_key="gateway")


@dataclass(frozen=True)
class NodeConfig:
    """One node of fimfleet:nodes: its host (host.* with the node's keys on top) and memory plan."""

    host: HostConfig
    memory: sizing.MemoryPlan | None
    key: str = "host"


SECTIONS = {
    "host": HostConfig, "model": ModelConfig, "engine": EngineConfig, "runtime": RuntimeConfig,
    "ingress": IngressConfig, "monitor": MonitorConfig, "sla": SlaConfig, "kernel": KernelConfig,
    "monitoring": MonitoringConfig, "gateway": GatewayConfig, "rollout": RolloutConfig,
}
TOP_LEVEL = ("tier", *SECTIONS, "nodes", *SECRET_KEYS)


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
        "monitor": dict(tier.monitor),
    }


def config_key(f) -> str:
    # memoryGiB / memoryBandwidthGBs / gpuMemoryGiB / kvCacheGiB keep their unit's capitals.
    return {"memory_gib": "memoryGiB", "gpu_memory_gib": "gpuMemoryGiB", "kv_cache_gib": "kvCacheGiB",
            "memory_bandwidth_gbs": "memoryBandwidthGBs"}.get(f.name, camel(f.name))


def _parse_section(name, cls, raw, defaults, problems):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(Problem(name, raw, f"must be a map of settings: {', '.join(config_key(f) for f in fields(cls))}"))
        raw = {}
    known = {config_key(f): f for f in fields(cls)}
    for k in raw:
        if k not in known:
            close = [c for c in known if c.lower() == str(k).lower()]
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(Problem(f"{name}.{k}", raw[k], f"unknown key; {hint}known keys: {', '.join(known)}"))
    values = {}
    for ck, f in known.items():
        v = raw[ck] if raw.get(ck) is not None else defaults.get(ck, f.default)  # null: not set, as a missing key
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
            problems.append(Problem(f"{name}.{ck}", v, grammar.wrong_type(want, v)))
            continue
        # kept: the key's own grammar, here or in checks.py, names the better fix (beneath_own)
        problems.extend(Problem(f"{name}.{ck}{where}", s, fix) for where, s, fix in grammar.text(v))
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


def parse(raw: dict[str, Any], secret_keys: frozenset[str] = frozenset()) -> StackConfig:
    """Validate a stack's fimfleet config. `raw` maps short keys (no namespace) to parsed values."""
    try:
        return _parse(raw, secret_keys)
    except ConfigError as err:
        raise ConfigError(masked(err.problems, secret_keys)) from None


def _parse(raw: dict[str, Any], secret_keys: frozenset[str]) -> StackConfig:
    from components import checks, nodes_config  # they read this module's types: import them late, not circularly

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
           for name, cls in SECTIONS.items() if name != "host"}
    if raw.get("host") is not None and not isinstance(raw["host"], dict):
        problems.append(Problem("host", raw["host"], "must be a map of settings: " + ", ".join(config_key(f) for f in fields(HostConfig))))
    node_entries = nodes_config.entries(raw.get("nodes"), raw.get("host"), problems)

    for sk in SECRET_KEYS:
        if sk in raw and sk not in secret_keys:
            problems.append(Problem(sk, "<plain text>", f"store it as a secret: pulumi config set --secret {NAMESPACE}:{sk} ..."))
    api_keys = checks.check_api_keys(raw.get("apiKeys"), problems)
    secrets = Secrets(api_keys=api_keys, **{snake(k): raw.get(k, "") for k in STRING_SECRETS})

    model, engine, runtime, ingress = sec["model"], sec["engine"], sec["runtime"], sec["ingress"]
    model_spec = checks.check_model(model, tier, problems)
    nodes = nodes_config.parsed(node_entries, lambda name, entry, found: _parse_node(
        name, entry, "nodes" in raw, raw.get("host"), defaults["host"], tier, model_spec, sec, secrets, found), problems)
    hosts = {n: c.host for n, c in nodes.items()}
    nodes_config.check_distinct(hosts, problems)
    gw_host = nodes_config.gateway_host(sec["gateway"], ingress, hosts, raw.get("host"), problems,
                                        lambda merged, found: _parse_host(merged, defaults["host"], tier, sec, secrets, found))
    problems[:] = nodes_config.unique(problems)
    first = next(iter(nodes.values()))
    checks.check_runtime(runtime, tier, problems, secrets)
    checks.check_secrets(secrets, problems)
    checks.check_ingress(ingress, secrets, problems)
    sla = sec["sla"]
    checks.check_sla_limits(sla, engine, problems)
    checks.check_kernel(sec["kernel"], problems)
    checks.check_ports(engine, ingress, hosts, sec["monitoring"], problems, sec["gateway"], gw_host)
    checks.check_sla_fits_the_ingress(sla, ingress, problems, len(nodes) if sec["gateway"].host else 1)
    checks.check_sla_ceiling(sla, runtime, model, model_spec, problems)

    texts = [p for p in problems if p.fix == grammar.TEXT_FIX]  # reported last (beneath_own)
    if len(problems) > len(texts):
        raise ConfigError(beneath_own(problems, grammar.TEXT_FIX))
    cfg = StackConfig(tier=tier, secrets=secrets, model_spec=model_spec, memory=first.memory, host=first.host,
                      nodes=nodes, gateway_host=gw_host, **sec)
    found = []
    if cfg.monitoring.enabled:
        from components import monitoring  # monitoring reads this module's types: import it late

        found = monitoring.problems(monitoring.args_for(cfg, "node"))
    if found or texts:
        raise ConfigError(beneath_own(found + texts, grammar.TEXT_FIX))
    return cfg


def _parse_node(name, entry, named, raw_host, host_defaults, tier, model_spec, sec, secrets, problems) -> NodeConfig:
    """One node's host (stack-wide host.* with its own keys on top), checked against the tier's
    sizing; its problems name nodes.<name>.<key> where the node set the value."""
    from components import checks, nodes_config

    found: list[Problem] = []
    host = _parse_host(nodes_config.merged_host(raw_host, entry, named), host_defaults, tier, sec, secrets, found)
    model, engine = sec["model"], sec["engine"]
    checks.check_engine(engine, host, tier, model_spec, found)
    memory = None
    needed = (host.memory_gib, host.gpu_memory_gib, engine.kv_cache_gib, engine.max_model_len, engine.max_num_seqs,
              engine.gpu_memory_utilization, engine.tensor_parallel_size)
    if model_spec is not None and model.quantization in models.QUANTIZATIONS and None not in needed:
        memory = checks.check_memory(model_spec, model, engine, host, tier, found)
    problems.extend(nodes_config.locate(found, name, entry, named))
    return NodeConfig(host=host, memory=memory, key=f"nodes.{name}" if named else "host")


def _parse_host(merged, host_defaults, tier, sec, secrets, problems) -> HostConfig:
    """A host.* section, its provider resolved: a cloud host gets its hardware facts from its
    instance type (before the engine and sizing checks read them; components/cloud_types.py)."""
    from components import checks, cloud_types

    host = _parse_section("host", HostConfig, merged, host_defaults, problems)
    host, found = cloud_types.check(host, merged, tier, sec["ingress"], secrets)
    problems.extend(found)
    checks.check_host(host, secrets, problems)
    return host


def from_pulumi() -> StackConfig:
    """Read every key of the running stack (unknown keys and namespaces included, to reject them)."""
    from pulumi.runtime import config as rc

    values = rc.CONFIG.get()
    return from_mapping(values, frozenset(k for k in values if rc.is_config_secret(k)))


def from_mapping(values: dict[str, str], secret_full_keys: frozenset[str]) -> StackConfig:
    """Validate a stack's config as Pulumi hands it over: full `namespace:key` names, JSON-encoded values."""
    raw, secret, foreign, prefix = {}, set(), [], NAMESPACE + ":"
    for full, value in values.items():
        if not full.startswith(prefix):
            if full.split(":", 1)[0] not in OTHER_NAMESPACES:
                foreign.append(Problem(full, "<ignored>", f"unknown namespace; fimfleet reads only {prefix}* keys "
                                       f"(rename it to {prefix}{full.split(':', 1)[-1]})"))
            continue
        short = full[len(prefix):]
        try:
            raw[short] = json.loads(value)
        except (TypeError, json.JSONDecodeError):
            raw[short] = value
        if full in secret_full_keys:
            secret.add(short)
    # A plain string that happens to parse as JSON (e.g. "8000") stays a string only where a string is wanted.
    for k in (*STRING_SECRETS, "tier"):
        if k in raw and not isinstance(raw[k], str):
            raw[k] = values[prefix + k]
    foreign += plain_credentials(values, secret_full_keys)
    try:
        cfg = parse(raw, frozenset(secret))
    except ConfigError as err:
        raise ConfigError(masked(foreign, secret_full_keys) + err.problems) from None
    if foreign:
        raise ConfigError(masked(foreign, secret_full_keys))
    return cfg
