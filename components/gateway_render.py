"""Pure rendering of the fleet gateway's moving parts: which nodes it proxies to, and the
drain and enable steps of a rolling update. No Pulumi imports: tests run the real scripts.

The gateway itself is an nginx site like a node's (ingress_render.site_files with a
FleetUpstream). Its upstream holds one loopback member server per node, each of which
proxies to that node's ingress only while the node's marker exists on the gateway host, and
answers 404 otherwise: the gateway then tries the next node, and nginx never counts a 404
as a failed attempt. So a drain or an enable changes one file and reloads nothing. A reload
would close every idle keep-alive connection of the old workers, and an editor that sent on
one at that moment would get no answer (benchmarks/roll_capacity.py measured it).

A roll removes the marker (drain), waits for the node's streams, updates the node, checks
its SLA, and puts the marker back (enable), so a node that failed its check stays out of
rotation and a rerun of the gateway's own step never puts it back. The servers file lists
every member, drained or not, so that no reload (a key change, a new node) can leave a node
out of rotation that its enable put back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from components import grammar, templates
from components.nginx_base import LOCK, STATE_DIR, NginxBase, address_port, check_int, check_path, fail

FLEET_TLS_NAME = "fimfleet-node.internal"
"""The name every node's certificate carries beside its own, which the gateway verifies: one
upstream group has one proxy_ssl_name. Each node's CA signed only that node's certificate."""
FLEET_PROBE_KEY_NAME = "fimfleet_fleet_probe"
"""The fleet's SLA gate through the gateway: every node's ingress accepts it too, and the
gateway spreads its requests over the nodes instead of keeping them on one (site.conf.j2)."""
GATEWAY = "gateway"
"""The gateway's site name on its host (nodes_config.RESERVED keeps nodes off it)."""
MEMBER_PORT = 17443
"""The default port of the member servers, each on a loopback address of its own (member_listens)."""
DRAINED_RETRY_AFTER_S = 5
"""Retry-After of the answer when no node is in rotation (a one-node fleet while it rolls)."""


@dataclass(frozen=True)
class GatewayPaths:
    """Where the gateway's rotation lives on its host (tests point it into a temporary directory)."""

    servers: str
    """The upstream's servers file, generated; its site includes it inside the upstream block."""
    state_dir: str = f"{STATE_DIR}/gateway"
    lock: str = LOCK
    """The host's nginx lock: the rotation changes one nginx change at a time with the sites."""

    @property
    def enabled_dir(self) -> str:
        return f"{self.state_dir}/enabled"

    @property
    def generator(self) -> str:
        return f"{self.state_dir}/servers.sh"

    def __post_init__(self) -> None:
        check_path("GatewayPaths", "servers", self.servers)
        check_path("GatewayPaths", "state_dir", self.state_dir)
        check_path("GatewayPaths", "lock", self.lock)


@dataclass(frozen=True)
class Member:
    name: str
    address: str
    port: int

    @property
    def server(self) -> str:
        return address_port(self.address, self.port)


def _loopback(name: str, salt: int) -> str:
    h = int.from_bytes(hashlib.sha256(f"{name}#{salt}".encode()).digest()[:4], "big")
    return f"127.{1 + h % 254}.{(h >> 8) % 256}.{1 + (h >> 16) % 254}"


def member_listens(names, port: int = MEMBER_PORT) -> dict[str, str]:
    """Where each node's member server listens on the gateway host: a loopback address derived
    from the node's name. nginx places the servers on its hash ring by that address, so adding
    or removing a node moves only the keys of that node, never the others'. Names are taken in
    sorted order, so the rare clash (about one fleet of 10 nodes in 370,000) resolves the same way
    whatever order the stack lists them in."""
    taken: dict[str, str] = {}
    for name in sorted(names):
        salt = 0
        while (addr := _loopback(name, salt)) in taken.values():
            salt += 1
        taken[name] = addr
    return {n: f"{taken[n]}:{port}" for n in names}


@dataclass(frozen=True)
class FleetUpstream:
    """The gateway's side of the fleet: the nodes' ingresses it proxies to, over verified TLS."""

    members: tuple[Member, ...]
    paths: GatewayPaths
    ca_path: str
    """PEM bundle of the nodes' CAs, the only ones the gateway trusts upstream."""
    max_fails: int = 2
    fail_timeout_s: int = 10
    tries: int = 2
    """Attempts per request, the first included; only before any byte reached the client. One
    more than the nodes a roll drains at once, so a request finds a node in rotation."""
    affinity: bool = True
    """Keep True: each key on one node. False is round robin, the baseline of
    benchmarks/gateway_affinity.py."""
    member_port: int = MEMBER_PORT
    """The member servers' port (tests give each gateway on one machine its own)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            fail("FleetUpstream", "members", (), "give at least one node")
        seen = set()
        for m in self.members:
            if msg := grammar.dns_label(m.name):
                fail("FleetUpstream", "members", m.name, msg)
            if msg := grammar.address(m.address):
                fail("FleetUpstream", "members", m.address, msg)
            check_int("FleetUpstream", "members", m.port, 1, 65535)
            if m.name in seen:
                fail("FleetUpstream", "members", m.name, "list each node once")
            seen.add(m.name)
        if not isinstance(self.paths, GatewayPaths):
            fail("FleetUpstream", "paths", self.paths, "give a GatewayPaths")
        check_path("FleetUpstream", "ca_path", self.ca_path)
        check_int("FleetUpstream", "max_fails", self.max_fails, 1, 100)
        check_int("FleetUpstream", "fail_timeout_s", self.fail_timeout_s, 1, 3600)
        check_int("FleetUpstream", "tries", self.tries, 1, len(self.members) + 1)
        check_int("FleetUpstream", "member_port", self.member_port, 1, 65535)
        if not isinstance(self.affinity, bool):
            fail("FleetUpstream", "affinity", self.affinity, "use True (False is the benchmark's round robin)")

    @property
    def listens(self) -> dict[str, str]:
        """Node name -> where its member server listens."""
        return member_listens([m.name for m in self.members], self.member_port)


def servers_script(fleet: FleetUpstream) -> str:
    """The generator installed at paths.generator: writes the servers file from the member list."""
    return templates.render("gateway/servers.sh.j2", fleet=fleet, paths=fleet.paths, listens=fleet.listens)


def member_script(node: str, enabled: bool, nginx: NginxBase, paths: GatewayPaths, drain_timeout_s: int = 60) -> str:
    """Put node `node` into rotation (enable) or take it out and wait for its streams (drain),
    with no reload. It reads only the paths, never the member list, so adding a node leaves
    the others' steps alone; the servers file tells it where the node's member server is."""
    if msg := grammar.dns_label(node):
        fail("member_script", "node", node, msg)
    check_int("member_script", "drain_timeout_s", drain_timeout_s, 1, 3600)
    return templates.render("gateway/member.sh.j2", node=node, enabled=enabled, main=nginx.main_path,
                            paths=paths, drain_timeout_s=drain_timeout_s)


def member_check(node: str, paths: GatewayPaths) -> str:
    """Refresh: an enabled node whose marker is gone (gateway host wiped) is drift."""
    return templates.render("gateway/member-check.sh.j2", node=node, paths=paths)


OUT_OF_ROTATION = "out of rotation: "
"""How rotation.sh.j2 names each node out of rotation, one per line."""


def rotation_script(paths: GatewayPaths, nodes: list[str]) -> str:
    """Lists the nodes of `nodes` that are out of rotation: the output stays short (a step keeps
    only its tail) whatever the fleet's size, as long as most nodes serve."""
    for node in nodes:
        if msg := grammar.dns_label(node):
            fail("rotation_script", "nodes", node, msg)
    return templates.render("gateway/rotation.sh.j2", paths=paths, nodes=nodes)


def out_of_rotation(stdout: str | None) -> set[str]:
    """The nodes rotation_script's output names."""
    return {line[len(OUT_OF_ROTATION):] for line in (stdout or "").splitlines() if line.startswith(OUT_OF_ROTATION)}
