"""Cloud instance types fimfleet knows, and the config rules that tie a type to a tier.

Pure data and functions, no provider SDK: config validation runs them before any plugin
is needed. A cloud host's hardware facts (vCPUs, RAM, GPUs, NUMA nodes) come from its
instance type, never from the tier, so the sizing check at preview and the preflight on
the instance both judge the machine that is actually rented.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from components.ssh import load_private_key, private_key_problem

PROVIDERS = ("ssh", "local-vm", "hcloud", "aws")
"""How fimfleet gets its host: an existing VPS over SSH, the local test VM, or a cloud instance it creates."""
CLOUD_PROVIDERS = ("hcloud", "aws")
"""Providers whose stacks need the provider's Pulumi plugin (downloaded by the official CLI on first use)."""


@dataclass(frozen=True)
class CloudType:
    """One instance type as the provider sells it."""

    vcpus: int
    memory_gib: int
    gpu_model: str = ""
    gpu_count: int = 0
    gpu_memory_gib: int = 0
    """Nominal memory of one GPU in GB, as tiers.py counts it."""
    numa_nodes: int = 1


_L40S = {"gpu_model": "L40S", "gpu_count": 1, "gpu_memory_gib": 48}
_H100 = {"gpu_model": "H100", "gpu_memory_gib": 80}

TYPES: dict[str, dict[str, CloudType]] = {
    # Hetzner Cloud CCX: dedicated AMD EPYC vCPUs (the CPU runbook's "EPYC KVM VPS with dedicated vCPUs").
    "hcloud": {
        "ccx13": CloudType(2, 8), "ccx23": CloudType(4, 16), "ccx33": CloudType(8, 32),
        "ccx43": CloudType(16, 64), "ccx53": CloudType(32, 128), "ccx63": CloudType(48, 192),
    },
    "aws": {
        # M7a: AMD EPYC 4th gen (Zen 4, AVX-512 with VNNI and BF16), one vCPU per physical core.
        "m7a.2xlarge": CloudType(8, 32), "m7a.4xlarge": CloudType(16, 64), "m7a.8xlarge": CloudType(32, 128),
        "m7a.16xlarge": CloudType(64, 256),
        # G6e: one NVIDIA L40S 48 GB per instance up to 16xlarge.
        "g6e.xlarge": CloudType(4, 32, **_L40S), "g6e.2xlarge": CloudType(8, 64, **_L40S),
        "g6e.4xlarge": CloudType(16, 128, **_L40S), "g6e.8xlarge": CloudType(32, 256, **_L40S),
        "g6e.16xlarge": CloudType(64, 512, **_L40S),
        # P5: NVIDIA H100 80 GB (SXM); p5.4xlarge is the single-GPU size.
        "p5.4xlarge": CloudType(16, 256, gpu_count=1, **_H100),
        "p5.48xlarge": CloudType(192, 2048, gpu_count=8, numa_nodes=2, **_H100),
    },
}

HCLOUD_LOCATIONS = ("fsn1", "nbg1", "hel1", "ash", "hil", "sin")
DEFAULT_REGION = {"hcloud": "fsn1", "aws": "us-east-1"}
AWS_REGION = re.compile(r"[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]")
HCLOUD_IMAGE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
AMI_ID = re.compile(r"ami-(?:[0-9a-f]{8}|[0-9a-f]{17})")  # the old 8-hex form, or today's 17

HARDWARE_KEYS = ("cpus", "memoryGiB", "gpuModel", "gpuCount", "gpuMemoryGiB", "numaNodes")
"""host.* keys a cloud host takes from its instance type."""
CLOUD_KEYS = ("region", "instanceType", "image", "adminCidrs", "dnsZone")
"""host.* keys that only mean something for a cloud provider."""
CREDENTIALS = {"hcloud:token": "HCLOUD_TOKEN", "aws:secretKey": "AWS_SECRET_ACCESS_KEY", "aws:token": "AWS_SESSION_TOKEN"}
"""Provider config keys that hold a credential, with the environment variable that can replace them."""


def _fits(t: CloudType, tier) -> bool:
    if tier.device == "gpu":
        return t.gpu_model == tier.gpu_model and t.gpu_count >= tier.gpu_count and t.memory_gib >= tier.memory_gib
    return not t.gpu_count and t.vcpus >= tier.cpus and t.memory_gib >= tier.memory_gib


def default_type(provider: str, tier) -> str | None:
    """The cheapest known type that carries the tier: its GPU and host RAM for GPU tiers (vLLM's
    host side needs few cores), its vCPUs and RAM for CPU tiers. None when no type fits."""
    fitting = [(t.gpu_count, t.vcpus, t.memory_gib, name) for name, t in TYPES[provider].items() if _fits(t, tier)]
    return min(fitting)[-1] if fitting else None


def _type_problems(provider: str, name: str, t: CloudType, tier) -> str | None:
    """Why type `name` cannot carry `tier` (None when it can); the memory fit is the sizing check's job."""
    if tier.device == "gpu":
        if not t.gpu_count:
            return f"{name} has no GPU; tier {tier.name} serves on {tier.gpu_model}: use {default_type(provider, tier) or 'a GPU type'}"
        if t.gpu_model != tier.gpu_model:
            return (f"{name} has {t.gpu_model} GPUs; tier {tier.name} is sized for {tier.gpu_model}: "
                    f"use {default_type(provider, tier) or 'a ' + tier.gpu_model + ' type'} or a {t.gpu_model} tier")
        if t.gpu_count < tier.gpu_count:
            return f"{name} has {t.gpu_count} GPUs; tier {tier.name} needs {tier.gpu_count}"
        return None
    if t.gpu_count:
        return f"{name} is a GPU type; tier {tier.name} runs on CPUs: use {default_type(provider, tier) or 'a CPU type'} (the GPU would sit idle)"
    if t.vcpus < tier.cpus:
        return (f"{name} has {t.vcpus} vCPUs; tier {tier.name} is sized (threads, SLA) for {tier.cpus}: "
                f"use {default_type(provider, tier) or 'a bigger type'} or a smaller tier")
    return None


def public_key(private_key: str) -> str:
    """The OpenSSH public key of a PEM or OpenSSH private key (what the cloud installs for root)."""
    from cryptography.hazmat.primitives import serialization

    key = load_private_key(private_key)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def check(host, raw_host: dict, tier, ingress, secrets) -> tuple:
    """(host with the provider resolved and, for a cloud, the type's hardware facts; problems).

    `host.kind` is the older name of `host.provider`: both end up holding the same value, so
    code that reads either keeps working and existing stacks stay valid.
    """
    from components import grammar
    from components.config import Problem

    problems: list = []
    raw_host = raw_host if isinstance(raw_host, dict) else {}
    if host.kind and host.provider and host.kind != host.provider:
        problems.append(Problem("host.kind", host.kind, f"host.kind is the older name of host.provider "
                                f"(= {host.provider}); keep only host.provider"))
    provider = host.provider or host.kind or "ssh"
    host = replace(host, provider=provider, kind=provider)
    if provider not in CLOUD_PROVIDERS:
        for k in CLOUD_KEYS:
            if raw_host.get(k):
                problems.append(Problem(f"host.{k}", raw_host[k], f"only used when fimfleet creates the instance "
                                        f"(host.provider {' or '.join(CLOUD_PROVIDERS)}); remove it"))
        return host, problems

    p = f"host.provider {provider}"
    if host.address:
        problems.append(Problem("host.address", host.address, f"{p} creates the instance and its address; remove host.address"))
    if host.port != 22:
        problems.append(Problem("host.port", host.port, f"{p} instances run sshd on 22; remove host.port"))
    if host.user != "root":
        problems.append(Problem("host.user", host.user, f"{p} instances let root in with fimfleet:sshPrivateKey "
                                "(files/cloud/cloud-init.yaml.j2), and fimfleet's steps run as root; remove host.user"))
    for k in ("bastion", "testbedState"):
        if raw_host.get(k):
            why = ("fimfleet reaches the instance it creates directly, through its firewall's host.adminCidrs"
                   if k == "bastion" else "it names a local test VM")
            problems.append(Problem(f"host.{k}", raw_host[k], f"{p}: {why}; remove host.{k}"))
    for k in HARDWARE_KEYS:
        if k in raw_host:
            problems.append(Problem(f"host.{k}", raw_host[k], f"comes from host.instanceType with {p}; remove it"))

    key = secrets.ssh_private_key
    if not key:
        problems.append(Problem("sshPrivateKey", "<unset>", "set the key the instance trusts for root: "
                                "pulumi config set --secret fimfleet:sshPrivateKey < ~/.ssh/id_ed25519"))
    else:
        if fix := private_key_problem(key):
            problems.append(Problem("sshPrivateKey", "<secret>", fix))
        else:
            pub = public_key(key)
            if provider == "aws" and not pub.startswith(("ssh-ed25519 ", "ssh-rsa ")):
                problems.append(Problem("sshPrivateKey", "<secret>", "EC2 key pairs take ed25519 or RSA keys: "
                                        "ssh-keygen -t ed25519 -f fimfleet-key"))

    region = host.region or DEFAULT_REGION[provider]
    if provider == "hcloud" and region not in HCLOUD_LOCATIONS:
        problems.append(Problem("host.region", host.region, f"must be a Hetzner location: {', '.join(HCLOUD_LOCATIONS)}"))
    if provider == "aws" and not AWS_REGION.fullmatch(region):
        problems.append(Problem("host.region", host.region, "must be an AWS region like us-east-1"))

    known = TYPES[provider]
    name = host.instance_type or default_type(provider, tier)
    facts = {}
    if name is None:
        problems.append(Problem("host.instanceType", "", f"no {provider} type fimfleet knows carries tier {tier.name} "
                                f"({tier.cpus} vCPUs, {tier.memory_gib} GiB{', ' + tier.gpu_model if tier.gpu_count else ''}); "
                                f"choose another tier or provider"))
    elif name not in known:
        problems.append(Problem("host.instanceType", name, f"not a {provider} type fimfleet knows; use one of: {', '.join(known)}"))
    elif msg := _type_problems(provider, name, known[name], tier):
        problems.append(Problem("host.instanceType", name, msg))
    else:
        t = known[name]
        facts = dict(cpus=t.vcpus, memory_gib=t.memory_gib, gpu_model=t.gpu_model, gpu_count=t.gpu_count,
                     gpu_memory_gib=t.gpu_memory_gib, numa_nodes=t.numa_nodes)

    if host.image and not (AMI_ID if provider == "aws" else HCLOUD_IMAGE).fullmatch(str(host.image)):
        problems.append(Problem("host.image", host.image, "must be an AMI ID like ami-0123456789abcdef0" if provider == "aws"
                                else "must be a Hetzner image name like debian-12 or ubuntu-24.04"))
    cidrs = host.admin_cidrs or []
    if not cidrs:
        problems.append(Problem("host.adminCidrs", [], "list the networks allowed to SSH in (fimfleet itself connects from "
                                "them): pulumi config set --path 'fimfleet:host.adminCidrs[0]' 198.51.100.7/32"))
    for at, value, msg in grammar.cidr_set(cidrs, "SSH"):
        problems.append(Problem(f"host.adminCidrs{at}", value, msg))
    if host.dns_zone:
        domain = (ingress.domain or "").rstrip(".").lower()
        zone = str(host.dns_zone).rstrip(".").lower()
        if msg := grammar.hostname(host.dns_zone):
            problems.append(Problem("host.dnsZone", host.dns_zone, msg))
        elif not domain:
            problems.append(Problem("host.dnsZone", host.dns_zone, "a DNS record needs a name: set ingress.domain"))
        elif domain != zone and not domain.endswith("." + zone):
            problems.append(Problem("host.dnsZone", host.dns_zone, f"ingress.domain {domain} is not inside this zone"))
    return replace(host, region=region, instance_type=name or "", admin_cidrs=list(cidrs), **facts), problems


AWS_SETTINGS = {"aws:profile": "profile", "aws:accessKey": "access_key", "aws:secretKey": "secret_key",
                "aws:token": "token", "aws:sharedCredentialsFiles": "shared_credentials_files",
                "aws:sharedConfigFiles": "shared_config_files"}
"""The stack's aws:* settings that each instance's own aws provider gets (an explicit provider
reads no stack config): the account. The region is host.region, per instance."""


def plain_credentials(values: dict, secret_full_keys) -> list:
    """Problems for cloud credentials stored in plain text in the stack file, and for aws:* keys
    that no provider would read (the instances' providers are fimfleet's own)."""
    from components.config import Problem

    problems = [Problem(k, "<plain text>", f"store it as a secret: pulumi config set --secret {k} ... "
                                           f"(or leave it out and export {env})")
                for k, env in CREDENTIALS.items() if k in values and k not in secret_full_keys]
    for k in values:
        if k == "aws:region":
            problems.append(Problem(k, values[k], "each instance's region is fimfleet:host.region (default "
                                    f"{DEFAULT_REGION['aws']}): pulumi config set --path fimfleet:host.region "
                                    f"{values[k]}; then pulumi config rm aws:region"))
        elif k.startswith("aws:") and k not in AWS_SETTINGS:
            problems.append(Problem(k, "<ignored>", f"fimfleet's aws providers take only {', '.join(AWS_SETTINGS)}; "
                                    "remove it, or set it in your AWS CLI profile and name that as aws:profile"))
    return problems


def aws_settings() -> dict:
    """The stack's AWS_SETTINGS as aws.Provider arguments (credentials as secrets)."""
    import json

    import pulumi

    conf, out = pulumi.Config("aws"), {}
    for full, arg in AWS_SETTINGS.items():
        key = full.split(":", 1)[1]
        if conf.get(key) is None:
            continue
        if full in CREDENTIALS or full == "aws:accessKey":
            out[arg] = conf.get_secret(key)
        elif key.endswith("Files"):
            value = conf.get(key)
            out[arg] = json.loads(value) if value.startswith("[") else [value]
        else:
            out[arg] = conf.get(key)
    return out


def dns_record_name(domain: str, zone: str) -> str:
    """The record's name relative to its zone ("@" for the apex), as Hetzner's RRSets want it."""
    domain, zone = domain.rstrip(".").lower(), zone.rstrip(".").lower()
    return "@" if domain == zone else domain[: -len(zone) - 1]
