"""Fleet: the hosts (HostBase, once each) and the nodes on them, rolled out one after another.

A node starts changing only after the previous node has passed its SLA check, so a bad
change stops at the first node instead of taking the whole fleet down. A host's base waits
for the same gate, as a kernel or package change there touches every node it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from components import hostbase, node
from components.hostbase import HostBase, HostBaseArgs
from components.node import NodeArgs, NodeService


@dataclass(frozen=True)
class FleetArgs:
    hosts: dict[str, HostBaseArgs]
    nodes: dict[str, NodeArgs]
    """In rollout order; each names its host in `hosts`."""


def args_for(cfg) -> FleetArgs:
    """Each node of fimfleet:nodes on a host of its own, of the same name (the single-node
    shorthand is the node `node`), in the stack's order: the first is the canary."""
    views = {name: cfg.for_node(name) for name in cfg.node_names()}
    return FleetArgs(hosts={name: hostbase.args_for(view) for name, view in views.items()},
                     nodes={name: node.args_for(view, name, host=name) for name, view in views.items()})


class Fleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: FleetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:fleet:Fleet", name, None, opts)
        unknown = sorted({n.host for n in args.nodes.values()} - set(args.hosts))
        if unknown:
            raise ValueError(f"nodes name hosts that the fleet does not have: {unknown}")
        self.hosts: dict[str, HostBase] = {}
        self.nodes: dict[str, NodeService] = {}
        previous = None
        for node_name, node_args in args.nodes.items():
            gate = [previous.sla or previous] if previous else []
            if node_args.host not in self.hosts:
                # The one-node layout kept the host under the node of the same name.
                moved = hostbase.legacy_parent(node_args.host, self) if node_args.host in args.nodes else None
                self.hosts[node_args.host] = HostBase(node_args.host, args.hosts[node_args.host], moved_from=moved,
                                                      opts=pulumi.ResourceOptions(parent=self, depends_on=gate))
            self.nodes[node_name] = previous = NodeService(
                node_name, node_args, self.hosts[node_args.host], opts=pulumi.ResourceOptions(parent=self, depends_on=gate))
        self.endpoints = {n: svc.endpoint for n, svc in self.nodes.items()}
        self.register_outputs({"endpoints": self.endpoints})
