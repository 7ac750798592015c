"""Pure rendering of the fleet gateway's moving parts: which nodes it proxies to, and the
drain and enable steps of a rolling update. No Pulumi imports: tests run the real scripts.

The gateway itself is an nginx site like a node's (ingress_render.site_files with a
FleetUpstream), whose upstream block includes a servers file. That file is generated on the
gateway host from the member list and one marker per node: a node is in rotation only while
its marker exists. A roll removes the marker (drain), updates the node, checks its SLA, and
puts the marker back (enable), so a node that failed its check stays out of rotation and a
rerun of the gateway's own step never puts it back.
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
        if not isinstance(self.affinity, bool):
            fail("FleetUpstream", "affinity", self.affinity, "use True (False is the benchmark's round robin)")


def servers_script(fleet: FleetUpstream) -> str:
    """The generator installed at paths.generator: writes the servers file from the markers."""
    return templates.render("gateway/servers.sh.j2", fleet=fleet, paths=fleet.paths)


def member_script(node: str, enabled: bool, nginx: NginxBase, paths: GatewayPaths, drain_timeout_s: int = 60) -> str:
    """Put node `node` into rotation (enable) or take it out and wait for its streams (drain).
    It reads only the paths, never the member list, so adding a node leaves the others' steps alone."""
    if msg := grammar.dns_label(node):
        fail("member_script", "node", node, msg)
    check_int("member_script", "drain_timeout_s", drain_timeout_s, 1, 3600)
    return templates.render("gateway/member.sh.j2", node=node, enabled=enabled, main=nginx.main_path,
                            pid_path=nginx.pid_path, paths=paths, drain_timeout_s=drain_timeout_s)


def member_check(node: str, paths: GatewayPaths) -> str:
    """Refresh: an enabled node whose marker is gone (gateway host wiped) is drift."""
    return templates.render("gateway/member-check.sh.j2", node=node, paths=paths)
