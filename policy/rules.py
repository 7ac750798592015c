"""fimfleet's policy rules as pure functions: facts in, violation messages out.

Every message names the stack config key to change. The CrossGuard wiring lives in
policy/__main__.py; the facts come from the stack config that the engine hands to the
policy pack (policy/server.py) and from the resources of the preview. The SSH rule and its
reading of cloud firewall inputs live in policy/firewall.py, the CIDR helpers in policy/networks.py.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from components.config import NAMESPACE, SlaConfig
from components.problems import SECRET_KEYS
from components.sla.thresholds import SlaThresholds, judged_limits
from components.tiers import TIERS
from policy.firewall import IngressRule, ingress_rules, shown, ssh_beyond_admin_cidrs  # noqa: F401 - the SSH rule
from policy.networks import world_open

SECRET_SIG_KEY = "4dabf18193072939515e22adb298388d"
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"

# Config keys (any namespace: fimfleet:sshPrivateKey, hcloud:token, aws:secretKey, ...)
# whose value is key material or a credential.
CREDENTIAL_KEY = re.compile(r"(?i)(private_?key|api_?keys?|tls_?key|token|secret_?key|password|passphrase)$")
PRIVATE_KEY_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
MIN_SECRET_CHARS = 16
"""Shorter values of keys not known to hold a secret are not searched for in resource inputs (too many
false hits); those of known secret keys are, as whole words."""
BASE64_RUN = re.compile(r"[A-Za-z0-9+/]{12,}={0,2}")
"""A run of base64 in an input (docker's config.json holds auth = base64("user:password"))."""

SLA_LIMITS = {"ttft_p50_ms": ("ttftP50Ms", "max"), "ttft_p95_ms": ("ttftP95Ms", "max"),
              "ttft_p99_ms": ("ttftP99Ms", "max"), "min_decode_tokens_per_s": ("minDecodeTokensPerS", "min"),
              "min_decode_ceiling_fraction": ("minDecodeCeilingFraction", "min"), "max_errors": ("maxErrors", "max")}
"""FimSlaCheck threshold -> (fimfleet:sla config key, which side is stricter)."""

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
        """*-prod in any case (x-PROD too): a production stack gets the prod rules."""
        return self.stack.lower().endswith("-prod")

    @property
    def is_local(self) -> bool:
        """The local test VM stacks (local, local-fleet, ...) or any stack on the local-vm tier/host kind;
        never a *-prod stack (local-prod gets the prod rules, not the local exemptions)."""
        return not self.is_prod and (self.stack == "local" or self.stack.startswith("local-")
                                     or self.tier == "local-vm" or self.get("host.kind") == "local-vm")

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
        """Credential values from the config (secret or not) -> the config key they came from. A short
        value counts when its key is known to hold a secret (fimfleet's secret keys, or one the engine
        holds as secret): a 14-character registry password is still a password."""
        out: dict[str, str] = {}

        def leaves(key: str, value: Any, known: bool) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    leaves(f"{key}.{k}", v, known)
            elif isinstance(value, str) and value and (known or len(value) >= MIN_SECRET_CHARS):
                out[value] = key

        for key, value in self.config.items():
            short = key.split(":", 1)[-1]
            if CREDENTIAL_KEY.search(short):
                known = key in self.secret_keys or (key.startswith(NAMESPACE + ":") and short in SECRET_KEYS)
                leaves(key, value, known)
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


def base64_decoded(text: str) -> Iterable[str]:
    """The text of every base64 run in `text`, read from each of the 4 alignments (the run may start
    before the encoded part, as in "/etc/x/<base64>")."""
    for run in BASE64_RUN.findall(text):
        for skip in range(4):
            chunk = run[skip:]
            try:
                yield base64.b64decode(chunk[:len(chunk) - len(chunk) % 4], validate=True).decode("utf-8", "replace")
            except (binascii.Error, ValueError):
                pass


def _holds(text: str, value: str) -> bool:
    """`value` is in `text`; a short one only as a whole word (not a part of a longer token)."""
    if len(value) >= MIN_SECRET_CHARS:
        return value in text
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", text) is not None


def _credential_in(text: str, creds: Mapping[str, str]) -> tuple[str, str] | None:
    """("private key" or "value", config key) of what `text` leaks, if anything."""
    if PRIVATE_KEY_PEM.search(text):
        return "private key", next((k for v, k in creds.items() if v in text),
                                   f"{NAMESPACE}:sshPrivateKey / {NAMESPACE}:tlsKey")
    return next((("value", key) for value, key in creds.items() if _holds(text, value)), None)


def plaintext_credentials_in_inputs(name: str, raw_props: Mapping[str, Any], facts: StackFacts) -> list[str]:
    """Inputs of one resource that carry a private key or a configured credential outside a Pulumi secret,
    as it is or base64-encoded (base64 hides nothing)."""
    creds = facts.credentials()
    out = []
    for path, text in plaintext_leaves(dict(raw_props)):
        for how, body in (("", text), *((" base64-encoded", d) for d in base64_decoded(text))):
            if found := _credential_in(body, creds):
                what, key = found
                held = (f"holds a private key{how} in plain text: {key} must reach" if what == "private key" else
                        f"holds the value of {key}{how} in plain text: it must reach")
                out.append(f"{name}: input {path} {held} resources as a Pulumi secret (pulumi.Output.secret).")
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


def judged_thresholds(name: str, thresholds: Any) -> tuple[dict[str, Any], list[str]]:
    """The limits the FimSlaCheck provider judges by, read as it reads them (SlaThresholds.from_dict, so
    "90000" is 90000 ms, and judged_limits), or violations naming each threshold it cannot read."""
    if thresholds is None:
        thresholds = {}
    if not isinstance(thresholds, Mapping):
        return {}, [f"{name}: input thresholds = {shown(thresholds)} is not a map of SLA limits: set the limits "
                    f"under {NAMESPACE}:sla."]
    data = dict(thresholds)
    try:
        return judged_limits(SlaThresholds.from_dict(data)), []
    except (TypeError, ValueError) as exc:
        refused = str(exc)
    out = []
    for field, value in data.items():
        try:
            SlaThresholds.from_dict({field: value})
        except (TypeError, ValueError) as exc:
            fix = (f"set {NAMESPACE}:sla.{SLA_LIMITS[field][0]} to a number" if field in SLA_LIMITS else
                   f"leave {field} out (the program sets the thresholds from {NAMESPACE}:sla)")
            out.append(f"{name}: threshold {field} = {shown(value)} cannot be read ({exc}): {fix}.")
    return {}, out or [f"{name}: the SLA provider refuses the thresholds {shown(data)} ({refused}): fix them "
                       f"under {NAMESPACE}:sla."]


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
        judged, unreadable = judged_thresholds(name, thresholds)
        if unreadable:
            out += unreadable
            continue
        for field, want in limits.items():
            key, stricter = SLA_LIMITS[field]
            got = judged.get(field)
            rate = judged.get("max_error_rate")
            if field == "max_errors" and rate is not None and (rate == 0 or got is None):
                if rate != 0:  # judged_limits keeps max_errors or max_error_rate: the rate is the error limit
                    out.append(f"{name}: max_error_rate = {rate:g} without max_errors is looser than the "
                               f"{facts.tier} tier's {NAMESPACE}:sla.maxErrors = {want:g} (it lets {rate:.0%} of the "
                               f"probe's requests fail): set {NAMESPACE}:sla.maxErrors to at most {want:g} and leave "
                               f"max_error_rate out of the thresholds.")
                continue
            if got is None or (got > want if stricter == "max" else got < want):
                bound = "at most" if stricter == "max" else "at least"
                value = "no limit" if got is None else f"{got:g}"
                out.append(f"{name}: {NAMESPACE}:sla.{key} = {value} is looser than the {facts.tier} tier's "
                           f"{want:g}: set {NAMESPACE}:sla.{key} to {bound} {want:g}.")
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
