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
rotation and a rerun of the gateway's own step never puts it back. The generated servers
file also marks such a node down, for whenever nginx next reloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from components import grammar, templates
from components.nginx_base import LOCK, STATE_DIR, NginxBase, address_port, check_int, check_path, fail

FLEET_TLS_NAME = "fimfleet-node.internal"
"""The name every node's certificate carries beside its own, which the gateway verifies: one
upstream group has one proxy_ssl_name. Each node's CA signed only that node's certificate."""
GATEWAY = "gateway"
"""The gateway's site name on its host (nodes_config.RESERVED keeps nodes off it)."""
MEMBER_PORT = 17443
"""The default port of the member servers, on 127.0.1.N of the gateway host (N: the node's place)."""
MAX_MEMBERS = 250


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


def member_listen(index: int, port: int = MEMBER_PORT) -> str:
    """Where the gateway's member server for the node at `index` listens: loopback only."""
    return f"127.0.1.{index + 1}:{port}"


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
    """Attempts per request, the first included; only before any byte reached the client."""
    affinity: bool = True
    """Keep True: each key on one node. False is round robin, the baseline of
    benchmarks/gateway_affinity.py."""
    member_port: int = MEMBER_PORT
    """The member servers' port on 127.0.1.N (tests give each gateway on one machine its own)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            fail("FleetUpstream", "members", (), "give at least one node")
        if len(self.members) > MAX_MEMBERS:
            fail("FleetUpstream", "members", len(self.members), f"give at most {MAX_MEMBERS} nodes per gateway")
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


def servers_script(fleet: FleetUpstream) -> str:
    """The generator installed at paths.generator: writes the servers file from the markers."""
    listens = [{"name": m.name, "listen": member_listen(i, fleet.member_port)} for i, m in enumerate(fleet.members)]
    return templates.render("gateway/servers.sh.j2", fleet=fleet, paths=fleet.paths, listens=listens)


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
