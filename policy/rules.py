"""fimfleet's policy rules as pure functions: facts in, violation messages out.

Every message names the stack config key to change. The CrossGuard wiring lives in
policy/__main__.py; the facts come from the stack config that the engine hands to the
policy pack (policy/server.py) and from the resources of the preview.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from components.config import NAMESPACE, SlaConfig
from components.tiers import TIERS

SECRET_SIG_KEY = "4dabf18193072939515e22adb298388d"
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"

# Config keys (any namespace: fimfleet:sshPrivateKey, hcloud:token, aws:secretKey, ...)
# whose value is key material or a credential.
CREDENTIAL_KEY = re.compile(r"(?i)(private_?key|api_?keys?|tls_?key|token|secret_?key|password|passphrase)$")
PRIVATE_KEY_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
MIN_SECRET_CHARS = 16
"""Shorter config values are not searched for in resource inputs (too many false hits)."""

SLA_LIMITS = {"ttft_p50_ms": ("ttftP50Ms", "max"), "ttft_p95_ms": ("ttftP95Ms", "max"),
              "ttft_p99_ms": ("ttftP99Ms", "max"), "min_decode_tokens_per_s": ("minDecodeTokensPerS", "min"),
              "min_decode_ceiling_fraction": ("minDecodeCeilingFraction", "min"), "max_errors": ("maxErrors", "max")}
"""FimSlaCheck threshold -> (fimfleet:sla config key, which side is stricter)."""

WORLD = {4: ipaddress.ip_network("0.0.0.0/0"), 6: ipaddress.ip_network("::/0")}
V4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")


def decode(value: str) -> Any:
    """A config value as the engine sends it: JSON for maps, lists, numbers and booleans."""
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


@dataclass(frozen=True)
class StackFacts:
    """The stack the engine is previewing: its name and its decrypted config."""

    stack: str
    config: Mapping[str, Any]
    """Full config keys ("fimfleet:ingress") -> decoded values."""
    secret_keys: frozenset[str]
    """Keys the engine reports as secret; a map counts as secret when any one of its values is."""
    plain_in_file: frozenset[str] = frozenset()
    """Paths ("fimfleet:apiKeys.bob") stored in plain text in the stack's file in the repository."""

    @classmethod
    def from_engine(cls, stack: str, config: Mapping[str, str], secret_keys: Iterable[str],
                    project_dir: Path | None = None) -> StackFacts:
        plain = plain_values_in_stack_file(project_dir, stack) if project_dir and stack else frozenset()
        return cls(stack, {k: decode(v) for k, v in config.items()}, frozenset(secret_keys), plain)

    def get(self, key: str) -> Any:
        """A fimfleet value by dotted path ("ingress.tls"), or None."""
        head, *rest = key.split(".")
        value = self.config.get(f"{NAMESPACE}:{head}")
        for part in rest:
            value = value.get(part) if isinstance(value, dict) else None
        return value

    @property
    def tier(self) -> str:
        return str(self.get("tier") or "")

    @property
    def is_prod(self) -> bool:
        return self.stack.endswith("-prod")

    @property
    def is_local(self) -> bool:
        """The local test VM stacks (local, local-fleet, ...) or any stack on the local-vm tier/host kind."""
        return (self.stack == "local" or self.stack.startswith("local-") or self.tier == "local-vm"
                or self.get("host.kind") == "local-vm")

    def find(self, name: str) -> list[tuple[str, Any]]:
        """Every (config key path, value) whose last key is `name`, at any depth of the fimfleet config
        (so per-node and gateway settings are found as well as the top-level ones)."""
        found: list[tuple[str, Any]] = []

        def walk(path: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    sub = f"{path}.{k}"
                    if k == name:
                        found.append((sub, v))
                    walk(sub, v)

        for key, value in self.config.items():
            if key.startswith(NAMESPACE + ":"):
                if key.split(":", 1)[1] == name:
                    found.append((key, value))
                walk(key, value)
        return found

    def credentials(self) -> dict[str, str]:
        """Credential values from the config (secret or not) -> the config key they came from."""
        out: dict[str, str] = {}

        def leaves(key: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    leaves(f"{key}.{k}", v)
            elif isinstance(value, str) and len(value) >= MIN_SECRET_CHARS:
                out[value] = key

        for key, value in self.config.items():
            if CREDENTIAL_KEY.search(key.split(":", 1)[-1]):
                leaves(key, value)
        return out


# --- secrets --------------------------------------------------------------------------

def plain_values_in_stack_file(project_dir: Path, stack: str) -> frozenset[str]:
    """Paths of the plain-text values under credential keys in stacks' Pulumi.<stack>.yaml.

    The engine marks a whole map secret when one value in it is (`apiKeys.alice` secret,
    `apiKeys.bob` not), so the file in the repository is read to find the plain ones."""
    try:
        project = yaml.safe_load((project_dir / "Pulumi.yaml").read_text()) or {}
        path = project_dir / str(project.get("stackConfigDir") or ".") / f"Pulumi.{stack}.yaml"
        config = (yaml.safe_load(path.read_text()) or {}).get("config") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return frozenset()
    out: set[str] = set()

    def walk(p: str, v: Any) -> None:
        if isinstance(v, dict) and set(v) != {"secure"}:
            for k, sub in v.items():
                walk(f"{p}.{k}", sub)
        elif isinstance(v, list):
            for i, sub in enumerate(v):
                walk(f"{p}[{i}]", sub)
        elif not isinstance(v, dict) and v not in (None, ""):
            out.add(p)

    for key, value in config.items() if isinstance(config, dict) else ():
        if CREDENTIAL_KEY.search(str(key).split(":", 1)[-1]):
            walk(str(key), value)
    return frozenset(out)


def plaintext_credentials_in_config(facts: StackFacts) -> list[str]:
    """Credential config keys (or values of a credential map) stored in plain text in the stack config."""
    out = []
    for key, value in sorted(facts.config.items()):
        if not CREDENTIAL_KEY.search(key.split(":", 1)[-1]) or value in (None, "", {}):
            continue
        plain = sorted(p for p in facts.plain_in_file if p == key or p.startswith(key + "."))
        if key in facts.secret_keys and not plain:
            continue
        for p in plain or [key]:
            how = (f"pulumi config set --secret --path '{p if p != key else key + '.<name>'}' <value>"
                   if isinstance(value, dict) else f"pulumi config set --secret {key} < FILE")
            out.append(f"{p} is stored in plain text in the stack config: store it as a secret ({how}).")
    return out


def plaintext_leaves(props: Any, path: str = "") -> Iterable[tuple[str, str]]:
    """(path, string) for every string in raw engine properties that is not inside a secret."""
    if isinstance(props, dict):
        if props.get(SECRET_SIG_KEY) == SECRET_SIG:
            return
        for k, v in props.items():
            yield from plaintext_leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(props, list):
        for i, v in enumerate(props):
            yield from plaintext_leaves(v, f"{path}[{i}]")
    elif isinstance(props, str):
        yield path, props


def plaintext_credentials_in_inputs(name: str, raw_props: Mapping[str, Any], facts: StackFacts) -> list[str]:
    """Inputs of one resource that carry a private key or a configured credential outside a Pulumi secret."""
    creds = facts.credentials()
    out = []
    for path, text in plaintext_leaves(dict(raw_props)):
        if PRIVATE_KEY_PEM.search(text):
            key = next((k for v, k in creds.items() if v in text), f"{NAMESPACE}:sshPrivateKey / {NAMESPACE}:tlsKey")
            out.append(f"{name}: input {path} holds a private key in plain text: {key} must reach "
                       "resources as a Pulumi secret (pulumi.Output.secret).")
            continue
        for value, key in creds.items():
            if value in text:
                out.append(f"{name}: input {path} holds the value of {key} in plain text: it must reach "
                           "resources as a Pulumi secret (pulumi.Output.secret).")
                break
    return out


# --- TLS ------------------------------------------------------------------------------

def self_signed_tls(facts: StackFacts) -> list[str]:
    """A non-local stack may serve a self-signed certificate only when it says so explicitly."""
    if facts.is_local:
        return []
    mode = facts.get("ingress.tls") or "self-signed"
    if mode != "self-signed" or facts.get("ingress.allowSelfSigned") is True:
        return []
    return [f"stack {facts.stack} serves a self-signed certificate ({NAMESPACE}:ingress.tls = self-signed, the "
            f"default): set {NAMESPACE}:ingress.tls to acme (with ingress.domain and ingress.acmeEmail) or "
            f"provided (with the tlsCert/tlsKey secrets), or accept it explicitly with "
            f"{NAMESPACE}:ingress.allowSelfSigned: true (editors then pin the exported caPem)."]


# --- /metrics -------------------------------------------------------------------------

def _network(text: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if isinstance(text, str) and text.strip().lower() in ("all", "any", "0/0"):
        return WORLD[4]
    try:
        return ipaddress.ip_network(str(text).strip(), strict=False)
    except ValueError:
        return None


def world_open(cidrs: Iterable[Any]) -> list[str]:
    """Which of 0.0.0.0/0 and ::/0 the networks cover together (0.0.0.0/1 + 128.0.0.0/1 count,
    and so does the IPv4-mapped IPv6 range)."""
    nets = [n for n in map(_network, cidrs) if n is not None]
    v4 = [n for n in nets if n.version == 4]
    v6 = [n for n in nets if n.version == 6]
    for n in v6:
        if V4_MAPPED.subnet_of(n):
            v4.append(WORLD[4])
        elif n.subnet_of(V4_MAPPED):
            v4.append(ipaddress.IPv4Network((int(n.network_address) & 0xFFFFFFFF, n.prefixlen - 96)))
    return [str(WORLD[f]) for f, group in ((4, v4), (6, v6))
            if any(n.prefixlen == 0 for n in ipaddress.collapse_addresses(group))]


def metrics_open_to_world(facts: StackFacts) -> list[str]:
    out = []
    for key, cidrs in facts.find("metricsAllowCidrs"):
        if isinstance(cidrs, str):
            cidrs = [cidrs]
        if isinstance(cidrs, list) and (world := world_open(cidrs)):
            out.append(f"{key} = {json.dumps(cidrs)} opens /metrics to {' and '.join(world)}: list only the "
                       f"networks of your Prometheus servers in {key}.")
    return out


# --- SLA gate -------------------------------------------------------------------------

def tier_limits(tier: str) -> dict[str, float]:
    """The tier's SLA limits by FimSlaCheck threshold name (the one source: components/tiers.py and
    the config defaults in components/config.py)."""
    defaults = {"maxErrors": {f.name: f.default for f in fields(SlaConfig)}["max_errors"]}
    defaults.update(TIERS[tier].sla if tier in TIERS else {})
    return {field: defaults[key] for field, (key, _) in SLA_LIMITS.items() if defaults.get(key) is not None}


def sla_gate(facts: StackFacts, checks: list[tuple[str, Mapping[str, Any] | None]], nodes: int) -> list[str]:
    """On *-prod stacks every node is gated by an SLA check whose limits are no looser than the tier's.

    `checks` are (resource name, thresholds input) of the FimSlaCheck resources."""
    if not facts.is_prod:
        return []
    if len(checks) < max(nodes, 1):
        return [f"stack {facts.stack} is a production stack, but {len(checks)} SLA check(s) gate {max(nodes, 1)} "
                f"node(s) ({NAMESPACE}:sla.enabled = {json.dumps(facts.get('sla.enabled'))}): set "
                f"{NAMESPACE}:sla.enabled to true."]
    limits = tier_limits(facts.tier)
    out = []
    for name, thresholds in checks:
        thresholds = thresholds if isinstance(thresholds, Mapping) else {}
        for field, want in limits.items():
            key, stricter = SLA_LIMITS[field]
            got = thresholds.get(field)
            looser = got is None if field != "max_errors" else False
            if isinstance(got, (int, float)):
                looser = got > want if stricter == "max" else got < want
            if looser:
                bound = "at most" if stricter == "max" else "at least"
                shown = "no limit" if got is None else f"{got:g}"
                out.append(f"{name}: {NAMESPACE}:sla.{key} = {shown} is looser than the {facts.tier} tier's "
                           f"{want:g}: set {NAMESPACE}:sla.{key} to {bound} {want:g}.")
    return out


# --- SSH on provisioned instances -----------------------------------------------------

@dataclass(frozen=True)
class IngressRule:
    protocol: str
    """tcp, udp, icmp, ... or "all"."""
    ports: tuple[int, int] | None
    """Inclusive port range; None means every port."""
    sources: tuple[str, ...]


def _port_range(text: Any) -> tuple[int, int] | None:
    text = str(text).strip().lower()
    if text in ("", "any", "all", "none", "-1", "0-65535", "1-65535"):
        return None
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _aws_protocol(p: Any) -> str:
    p = str(p).lower()
    return {"-1": "all", "6": "tcp", "17": "udp"}.get(p, p)


def ingress_rules(rtype: str, props: Mapping[str, Any]) -> list[IngressRule] | None:
    """Inbound rules of a cloud firewall resource, from the inputs of pulumi-hcloud, pulumi-aws and
    pulumi-digitalocean (camelCase wire names). None for any other resource type."""
    def lst(v: Any) -> list:  # the SDK hands lists and maps over as read-only proxies
        return list(v) if isinstance(v, Sequence) and not isinstance(v, str) else []

    if rtype == "hcloud:index/firewall:Firewall":
        return [IngressRule(str(r.get("protocol", "")).lower(),
                            _port_range(r.get("port")) if str(r.get("protocol", "")).lower() in ("tcp", "udp") else None,
                            tuple(lst(r.get("sourceIps"))))
                for r in lst(props.get("rules")) if str(r.get("direction", "in")).lower() == "in"]
    if rtype == "digitalocean:index/firewall:Firewall":
        return [IngressRule(str(r.get("protocol", "")).lower(), _port_range(r.get("portRange")),
                            tuple(lst(r.get("sourceAddresses")))) for r in lst(props.get("inboundRules"))]
    if rtype == "aws:ec2/securityGroup:SecurityGroup":
        rules = lst(props.get("ingress"))
    elif rtype == "aws:ec2/securityGroupRule:SecurityGroupRule":
        rules = [props] if str(props.get("type", "")).lower() == "ingress" else []
    elif rtype == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
        rules = [{"protocol": props.get("ipProtocol"), "fromPort": props.get("fromPort"), "toPort": props.get("toPort"),
                  "cidrBlocks": [props["cidrIpv4"]] if props.get("cidrIpv4") else [],
                  "ipv6CidrBlocks": [props["cidrIpv6"]] if props.get("cidrIpv6") else []}]
    else:
        return None
    out = []
    for r in rules:
        proto = _aws_protocol(r.get("protocol", "all"))
        lo, hi = r.get("fromPort"), r.get("toPort")
        ports = None if proto == "all" or lo is None else _port_range(f"{int(lo)}-{int(hi if hi is not None else lo)}")
        out.append(IngressRule(proto, ports, tuple(lst(r.get("cidrBlocks")) + lst(r.get("ipv6CidrBlocks")))))
    return out


def ssh_beyond_admin_cidrs(facts: StackFacts, name: str, rtype: str, props: Mapping[str, Any]) -> list[str]:
    """Port 22/tcp of a provisioned instance is reachable only from the networks in host.adminCidrs."""
    rules = ingress_rules(rtype, props)
    if not rules:
        return []
    admin = [n for _, cidrs in facts.find("adminCidrs") for n in map(_network, cidrs if isinstance(cidrs, list) else [cidrs])
             if n is not None]
    out = []
    for rule in rules:
        if rule.protocol not in ("tcp", "all") or (rule.ports and not rule.ports[0] <= 22 <= rule.ports[1]):
            continue
        for src in rule.sources:
            net = _network(src)
            if net is None or not any(net.version == a.version and net.subnet_of(a) for a in admin):
                out.append(f"{name}: SSH (22/tcp) is open to {src}, outside {NAMESPACE}:host.adminCidrs = "
                           f"{json.dumps([str(a) for a in admin])}: add your admin network to "
                           f"{NAMESPACE}:host.adminCidrs (the firewall opens 22 to those networks only).")
    return out


# --- advisory -------------------------------------------------------------------------

def prod_hardening(facts: StackFacts, types: list[str], nodes: int) -> list[str]:
    """Advisory for *-prod: kernel tuning and the monitor are deployed, and there is more than one node."""
    if not facts.is_prod:
        return []
    out = []
    if not any(t.startswith(f"{NAMESPACE}:kernel:") for t in types):
        out.append(f"stack {facts.stack} deploys no kernel tuning: enable it under {NAMESPACE}:kernel.")
    monitors = sum(t.startswith(f"{NAMESPACE}:monitor:") for t in types)
    if monitors < nodes:
        out.append(f"stack {facts.stack}: {nodes - monitors} of {nodes} node(s) have no FIM monitor: enable it "
                   f"under {NAMESPACE}:monitor.")
    if nodes <= 1:
        out.append(f"stack {facts.stack} runs {nodes} node: a production stack wants a second node for failover "
                   f"and rolling updates; add one under {NAMESPACE}:nodes.")
    return out
