"""fimfleet:nodes: the stack's nodes, each on its own host, by name.

A node entry holds only what differs between machines (where SSH reaches it, and its hardware
facts); everything else comes from the tier and the stack, `host.*` included, so shared
settings (provider, user, bastion) are written once. A stack without `nodes` is one node
named `node` on `host`: the single-node shorthand, kept so those stacks upgrade unchanged.
"""

from __future__ import annotations

from components import grammar
from components.config import Problem, camel
from components.gateway_render import MEMBER_PORT

NODE_KEYS = ("address", "port", "user", "bastion", "hostKey", "testbedState", "gone", "cpus", "memoryGiB",
             "memoryBandwidthGBs", "numaNodes", "cpuFlags", "maxStealPercent", "gpuModel", "gpuCount", "gpuMemoryGiB")
"""host.* keys a node may set for itself."""
OWN_KEYS = ("address", "hostKey", "testbedState")
"""Keys that name one machine: in the `nodes` form they belong to a node, never to host.*."""
DEFAULT_NODE = "node"
RESERVED = ("gateway",)
"""Names the fleet's own parts use on a host (the gateway's nginx site)."""
EXAMPLE = "nodes: {epyc1: {address: 203.0.113.10}, epyc2: {address: 203.0.113.11}}"


def entries(raw_nodes, raw_host, problems: list[Problem]) -> dict[str, dict] | None:
    """Node name -> its own host.* overrides, in rollout order (the first is the canary); None
    when fimfleet:nodes was refused and names no usable node."""
    if raw_nodes is None:
        return {DEFAULT_NODE: {}}
    if not isinstance(raw_nodes, dict) or not raw_nodes:
        problems.append(Problem("nodes", raw_nodes, f"must map node names to their hosts, e.g. {EXAMPLE}"))
        return None
    host = raw_host if isinstance(raw_host, dict) else {}
    for k in OWN_KEYS:
        if host.get(k) not in (None, ""):  # 0 or false is set, and refused as any value
            problems.append(Problem(f"host.{k}", host[k], f"names one machine: with fimfleet:nodes set it per node, "
                                    f"as nodes.{next(iter(raw_nodes))}.{k}"))
    out: dict[str, dict] = {}
    for name, entry in raw_nodes.items():
        name = str(name)
        if msg := grammar.dns_label(name):
            problems.append(Problem(f"nodes.{name}", entry, f"node name {msg}"))
            continue
        if name in RESERVED:
            problems.append(Problem(f"nodes.{name}", entry, f"{name!r} is reserved for the fleet's own parts; "
                                    f"rename the node (e.g. {name}1)"))
            continue
        entry = {} if entry is None else entry
        if not isinstance(entry, dict):
            problems.append(Problem(f"nodes.{name}", entry, f"must be a map of this node's settings: {', '.join(NODE_KEYS)}"))
            continue
        for k in entry:
            if k not in NODE_KEYS:
                close = [c for c in NODE_KEYS if c.lower() == str(k).lower()]
                hint = f"did you mean {close[0]!r}? " if close else ""
                problems.append(Problem(f"nodes.{name}.{k}", entry[k], f"unknown key; {hint}a node sets only: "
                                        f"{', '.join(NODE_KEYS)} (the rest is stack-wide: host.*, engine.*, ...)"))
        out[name] = {k: v for k, v in entry.items() if k in NODE_KEYS}
    return out or None


def parsed(node_entries: dict[str, dict] | None, parse, problems: list[Problem]) -> dict:
    """Each node through parse(name, entry, problems). When fimfleet:nodes was refused, one
    stand-in node still lets the other sections be checked; its own problems are dropped, as
    they would name a node that is not in the stack."""
    if node_entries is None:
        return {DEFAULT_NODE: parse(DEFAULT_NODE, {}, [])}
    return {name: parse(name, entry, problems) for name, entry in node_entries.items()}


def merged_host(raw_host, entry: dict, named: bool) -> dict:
    """A node's host.* as the section parser reads it: the stack's values (less those that name
    one machine, already refused there), the node's on top."""
    shared = {k: v for k, v in (raw_host if isinstance(raw_host, dict) else {}).items() if not (named and k in OWN_KEYS)}
    return {**shared, **entry}


def locate(found: list[Problem], name: str, entry: dict, named: bool) -> list[Problem]:
    """Report a node's host problems at the key the user set: nodes.<name>.<key> when the node
    set it (or, in the `nodes` form, when it names one machine), else host.<key>."""
    out = []
    for p in found:
        parts = p.key.split(".")
        sub = parts[1].split("[")[0] if parts[0] == "host" and len(parts) > 1 else None
        if named and sub in NODE_KEYS and (sub in entry or sub in OWN_KEYS):
            key = ".".join(["nodes", name, *parts[1:]])
            out.append(Problem(key, p.value, p.fix.replace(f"fimfleet:host.{sub}", f"fimfleet:nodes.{name}.{sub}")))
        else:
            out.append(p)
    return out


def unique(problems: list[Problem]) -> list[Problem]:
    """Stack-wide problems show once, however many nodes found them."""
    seen, out = set(), []
    for p in problems:
        mark = (p.key, repr(p.value), p.fix)
        if mark not in seen:
            seen.add(mark)
            out.append(p)
    return out


def check_distinct(hosts: dict, problems: list[Problem]) -> None:
    """Each node needs its own machine (two nodes on one SSH endpoint would fight over its units),
    and only one of them can own the stack's DNS name."""
    seen: dict[tuple, str] = {}
    for name, h in hosts.items():
        where = (grammar.same_host(h.address), h.port) if h.address else (("testbed", h.testbed_state) if h.testbed_state else None)
        if where is None:
            continue  # a cloud node: fimfleet creates its own instance
        if where in seen:
            key = "address" if h.address else "testbedState"
            problems.append(Problem(f"nodes.{name}.{key}", where[1] if key == "testbedState" else h.address,
                                    f"is also nodes.{seen[where]}'s host: each node needs its own machine"))
        else:
            seen[where] = name
    zoned = [n for n, h in hosts.items() if h.dns_zone]
    if len(hosts) > 1 and zoned:
        problems.append(Problem("host.dnsZone", hosts[zoned[0]].dns_zone, "would point ingress.domain at every node "
                                "of the fleet: leave it unset with several nodes and point the name at the gateway"))


def gateway_host(gw, ingress, hosts: dict, raw_host, problems: list[Problem], parse_host):
    """The gateway's own machine, when gateway.host is an address rather than a node: host.*
    with that address and gateway.hostKey on top, parsed by `parse_host(merged, problems)`.
    Checks the gateway either way; returns None when it runs beside a node (or is off)."""
    own = None
    if gw.host and gw.host not in hosts and ("." in gw.host or ":" in gw.host):
        found: list[Problem] = []
        own = parse_host(merged_host(raw_host, {"address": gw.host, "hostKey": gw.host_key}, True), found)
        at = {"host.address": "gateway.host", "host.hostKey": "gateway.hostKey"}
        for p in found:
            fix = p.fix
            for mine, theirs in at.items():
                fix = fix.replace(f"fimfleet:{mine}", f"fimfleet:{theirs}")
            problems.append(Problem(at.get(p.key, p.key), p.value, fix))
    check_gateway(gw, ingress, hosts, own, problems)
    return own


def check_gateway(gw, ingress, hosts: dict, own, problems: list[Problem]) -> None:
    """The gateway runs beside a node or on its own SSH host, and connects to every node's
    ingress by its address."""
    if not gw.host:
        if gw.host_key:
            problems.append(Problem("gateway.hostKey", gw.host_key, "is for a gateway on its own machine, and "
                                    "gateway.host is unset (no gateway): remove it, or set gateway.host"))
        return
    if ingress.tls != "self-signed":
        problems.append(Problem("ingress.tls", ingress.tls, "behind a gateway each node serves fimfleet's self-signed "
                                "certificate, whose CA the gateway trusts and whose fleet name it checks; ACME or "
                                "your own certificate on the gateway is not supported yet: use self-signed"))
    if gw.host_key and own is None:
        problems.append(Problem("gateway.hostKey", gw.host_key, "is for a gateway on its own machine (gateway.host an "
                                "address); beside a node, the node's hostKey is used: remove it"))
    if own is not None:
        if own.kind != "ssh":
            problems.append(Problem("gateway.host", gw.host, f"a gateway on its own machine is reached over SSH, but "
                                    f"host.provider is {own.kind}: run it beside a node (gateway.host: {next(iter(hosts))})"))
        for name, h in hosts.items():
            if h.address and grammar.same_host(h.address) == grammar.same_host(gw.host):
                problems.append(Problem("gateway.host", gw.host, f"is nodes.{name}'s address: to run the gateway "
                                        f"beside that node, name it (gateway.host: {name})"))
    elif gw.host not in hosts:
        problems.append(Problem("gateway.host", gw.host, f"must name a node of fimfleet:nodes, beside which the gateway "
                                f"runs ({', '.join(hosts)}), or be its own machine's address, e.g. 203.0.113.5"))
        return
    if None in (gw.https_port, gw.http_port, ingress.https_port, ingress.http_port):
        return  # already reported
    if gw.https_port == gw.http_port:
        problems.append(Problem("gateway.httpPort", gw.http_port, "must differ from gateway.httpsPort; e.g. 80"))
    # nginx on the gateway's host listens on all of these: the member servers need a port of their own
    taken = {f"gateway.{camel(k)}": getattr(gw, k) for k in ("https_port", "http_port")}
    if own is None:
        taken.update({f"ingress.{camel(k)}": getattr(ingress, k) for k in ("https_port", "http_port")})
    taken["SSH"] = (own or hosts[gw.host]).port
    free = next(p for p in range(MEMBER_PORT, 65536) if p not in taken.values())
    for where, port in taken.items():
        if gw.member_port == port:
            problems.append(Problem("gateway.memberPort", gw.member_port, f"is taken by {where} on the gateway's host: "
                                    f"give the member servers a free port, e.g. {free}"))
    for mine in ("https_port", "http_port") if own is None else ():
        for other in ("https_port", "http_port"):
            if getattr(gw, mine) == getattr(ingress, other):
                problems.append(Problem(f"ingress.{camel(other)}", getattr(ingress, other),
                                        f"is also gateway.{camel(mine)} on node {gw.host}'s host: give the nodes' ingress "
                                        f"other ports, e.g. ingress.httpsPort: 8443 and ingress.httpPort: 8080"))
    for name, h in hosts.items():
        if h.kind == "local-vm":
            continue  # a test VM: the gateway beside a node (own machines are ssh, above) reaches it via gateway.member
        if h.kind != "ssh" or not h.address:
            problems.append(Problem(f"nodes.{name}.address", h.address or "", "the gateway connects to each node at "
                                    "its address: set it (cloud nodes behind a gateway: not supported yet)"))
