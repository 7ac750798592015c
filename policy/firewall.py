"""The SSH rule: cloud firewalls of provisioned instances open 22/tcp only to host.adminCidrs.

Firewall inputs are read as pulumi-hcloud, pulumi-aws and pulumi-digitalocean read them
(camelCase wire names). They arrive as JSON, where every number is a float (a port 22 is 22.0,
an AWS protocol -1 is -1.0), so whole numbers are accepted in any spelling. A value that cannot
be read is reported as a violation naming it: the rule fails closed, and never with a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from components.problems import NAMESPACE
from policy.networks import network, world_open

if TYPE_CHECKING:
    from policy.rules import StackFacts

HCLOUD = "hcloud:index/firewall:Firewall"
DIGITALOCEAN = "digitalocean:index/firewall:Firewall"
AWS_GROUPS = ("aws:ec2/securityGroup:SecurityGroup", "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup")
AWS_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
AWS_INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"

PROTOCOL_NUMBERS = {-1: "all", 1: "icmp", 6: "tcp", 17: "udp", 47: "gre", 50: "esp", 58: "icmpv6"}
"""IANA protocol numbers (AWS takes them for names; -1 = every protocol)."""
PROTOCOL_NAMES = {**{name: name for name in PROTOCOL_NUMBERS.values()}, "any": "all"}
"""The protocol names the three providers take; any other name is unreadable, not taken for "not TCP"."""
ALL_PORTS = ("", "any", "all", "0", "-1")
"""Port texts meaning every port (DigitalOcean sends "0" or "all" when all ports are open)."""
PORT_FIX = 'give the port as a whole number ("22") or a range ("20-30")'
PROTOCOL_FIX = "give tcp, udp, icmp, ... or an IANA protocol number (-1 = all)"
SOURCES_FIX = "give the sources as a list of CIDRs"


class Unreadable(ValueError):
    """A firewall input the rule cannot read."""

    def __init__(self, field: str, value: Any, fix: str) -> None:
        super().__init__(field)
        self.field, self.value, self.fix = field, value, fix


@dataclass(frozen=True)
class IngressRule:
    protocol: str
    """tcp, udp, icmp, ... or "all"."""
    ports: tuple[int, int] | None
    """Inclusive port range; None means every port."""
    sources: tuple[str, ...]
    problem: Unreadable | None = None
    """Set when the rule could not be read; it then counts as SSH from anywhere."""

    @property
    def carries_ssh(self) -> bool:
        return self.protocol in ("tcp", "all") and (self.ports is None or self.ports[0] <= 22 <= self.ports[1])


def _whole(value: Any, field: str, fix: str) -> int:
    """A whole number in any wire spelling: 22, 22.0, "22", " 22.0 "."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
        if number is not None and number.is_integer():
            return int(number)
    raise Unreadable(field, value, fix)


def _protocol(value: Any, field: str) -> str:
    """tcp, udp, ... or "all", from a name in any case or an IANA number in any spelling (6, 6.0, "6.0")."""
    if isinstance(value, str) and value.strip().lower() in PROTOCOL_NAMES:
        return PROTOCOL_NAMES[value.strip().lower()]
    number = _whole(value, field, PROTOCOL_FIX)
    if not -1 <= number <= 255:
        raise Unreadable(field, value, PROTOCOL_FIX)
    return PROTOCOL_NUMBERS.get(number, str(number))


def _port_range(value: Any, field: str) -> tuple[int, int] | None:
    """A port ("22", 22.0) or range ("20-30") of hcloud and DigitalOcean; None = every port."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ALL_PORTS:
        return None
    if isinstance(value, str) and "-" in value.strip()[1:]:
        lo, hi = value.strip().split("-", 1)
        try:
            a, b = _whole(lo, field, PORT_FIX), _whole(hi, field, PORT_FIX)
        except Unreadable:
            raise Unreadable(field, value, PORT_FIX) from None
        return min(a, b), max(a, b)
    port = _whole(value, field, PORT_FIX)
    return None if port in (0, -1) else (port, port)


def _aws_ports(rule: Mapping[str, Any], path: str) -> tuple[int, int] | None:
    """fromPort..toPort of an AWS rule (-1 or none given: every port)."""
    lo, hi = (None if rule.get(k) is None else _whole(rule.get(k), f"{path}{k}", PORT_FIX)
              for k in ("fromPort", "toPort"))
    if lo is None and hi is None:
        return None
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    return None if -1 in (lo, hi) else (min(lo, hi), max(lo, hi))


def _sources(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else _list(value, field, SOURCES_FIX)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise Unreadable(f"{field}[{i}]" if not isinstance(value, str) else field, item, SOURCES_FIX)
    return tuple(items)


def _list(value: Any, field: str, fix: str) -> list:
    """A list input (the SDK hands lists over as read-only proxies); None is an empty one."""
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    raise Unreadable(field, value, fix)


def _rules(props: Mapping[str, Any], field: str, read) -> list[IngressRule]:
    """Each entry of list input `field` read by `read(entry, path)`; what cannot be read becomes a problem."""
    try:
        entries = _list(props.get(field), field, f"give {field} as a list of rules")
    except Unreadable as exc:
        return [IngressRule("all", None, (), exc)]
    out = []
    for i, entry in enumerate(entries):
        try:
            if not isinstance(entry, Mapping):
                raise Unreadable(f"{field}[{i}]", entry, "give each rule as a map, or drop the empty entry")
            rule = read(entry, f"{field}[{i}].")
        except Unreadable as exc:
            rule = IngressRule("all", None, (), exc)
        if rule is not None:
            out.append(rule)
    return out


def _hcloud(r: Mapping[str, Any], path: str) -> IngressRule | None:
    if str(r.get("direction") or "in").strip().lower() == "out":
        return None
    proto = _protocol(r.get("protocol"), f"{path}protocol")
    ports = _port_range(r.get("port"), f"{path}port") if proto == "tcp" else None
    return IngressRule(proto, ports, _sources(r.get("sourceIps"), f"{path}sourceIps"))


def _digitalocean(r: Mapping[str, Any], path: str) -> IngressRule:
    proto = _protocol(r.get("protocol"), f"{path}protocol")
    ports = _port_range(r.get("portRange"), f"{path}portRange") if proto == "tcp" else None
    return IngressRule(proto, ports, _sources(r.get("sourceAddresses"), f"{path}sourceAddresses"))


def _aws(r: Mapping[str, Any], path: str) -> IngressRule:
    proto = "all" if r.get("protocol") is None else _protocol(r.get("protocol"), f"{path}protocol")
    ports = _aws_ports(r, path) if proto == "tcp" else None
    return IngressRule(proto, ports, _sources(r.get("cidrBlocks"), f"{path}cidrBlocks")
                       + _sources(r.get("ipv6CidrBlocks"), f"{path}ipv6CidrBlocks"))


def _aws_ingress_rule(r: Mapping[str, Any], path: str) -> IngressRule:
    """aws.vpc.SecurityGroupIngressRule: one rule, one CIDR, `ipProtocol`."""
    proto = "all" if r.get("ipProtocol") is None else _protocol(r.get("ipProtocol"), "ipProtocol")
    ports = _aws_ports(r, path) if proto == "tcp" else None
    return IngressRule(proto, ports, _sources(r.get("cidrIpv4"), "cidrIpv4") + _sources(r.get("cidrIpv6"), "cidrIpv6"))


def _one(read, props: Mapping[str, Any]) -> list[IngressRule]:
    try:
        return [read(props, "")]
    except Unreadable as exc:
        return [IngressRule("all", None, (), exc)]


def ingress_rules(rtype: str, props: Mapping[str, Any]) -> list[IngressRule] | None:
    """Inbound rules of a cloud firewall resource; None for any other resource type."""
    if rtype == HCLOUD:
        return _rules(props, "rules", _hcloud)
    if rtype == DIGITALOCEAN:
        return _rules(props, "inboundRules", _digitalocean)
    if rtype in AWS_GROUPS:
        return _rules(props, "ingress", _aws)
    if rtype == AWS_RULE:
        return [] if str(props.get("type") or "").strip().lower() == "egress" else _one(_aws, props)
    if rtype == AWS_INGRESS_RULE:
        return _one(_aws_ingress_rule, props)
    return None


def shown(value: Any) -> str:
    """An input value for a message, as JSON (the SDK's read-only proxies as the maps and lists they hold)."""
    def plain(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {str(k): plain(v[k]) for k in v}
        return [plain(x) for x in v] if isinstance(v, Sequence) and not isinstance(v, str) else v

    try:
        return json.dumps(plain(value))
    except (TypeError, ValueError):
        return repr(value)


def ssh_beyond_admin_cidrs(facts: StackFacts, name: str, rtype: str, props: Mapping[str, Any]) -> list[str]:
    """Port 22/tcp of a provisioned instance is reachable only from the networks in host.adminCidrs,
    and those together are not the whole internet (0.0.0.0/1 + 128.0.0.0/1 is 0.0.0.0/0)."""
    rules = ingress_rules(rtype, props)
    if not rules:
        return []
    admin = [n for _, cidrs in facts.find("adminCidrs")
             for n in map(network, cidrs if isinstance(cidrs, list) else [cidrs]) if n is not None]
    fix = f"add your admin network to {NAMESPACE}:host.adminCidrs (the firewall opens 22 to those networks only)."
    out, inside = [], []
    for rule in rules:
        if rule.problem:
            p = rule.problem
            out.append(f"{name}: input {p.field} = {shown(p.value)} cannot be read, so it may open SSH (22/tcp) "
                       f"to anyone: {p.fix}.")
            continue
        if not rule.carries_ssh:
            continue
        for src in rule.sources:
            net = network(src)
            if net is not None and any(net.version == a.version and net.subnet_of(a) for a in admin):
                inside.append(src)
                continue
            out.append(f"{name}: SSH (22/tcp) is open to {src}, outside {NAMESPACE}:host.adminCidrs = "
                       f"{json.dumps([str(a) for a in admin])}: {fix}")
    for world in world_open(inside):
        out.append(f"{name}: SSH (22/tcp) is open to {world}, the whole internet: its sources "
                   f"{json.dumps(sorted(set(inside)))} in {NAMESPACE}:host.adminCidrs cover it together: list only "
                   f"your admin networks in {NAMESPACE}:host.adminCidrs.")
    return out
