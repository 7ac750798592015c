"""Fleet: several inference nodes rolled out one after another, and their endpoints.

A node starts changing only after the previous node has passed its SLA check, so a bad
change stops at the first node instead of taking the whole fleet down.
"""

from __future__ import annotations

import pulumi

from components.node import InferenceNode, NodeArgs


class Fleet(pulumi.ComponentResource):
    def __init__(self, name: str, nodes: dict[str, NodeArgs], opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:fleet:Fleet", name, None, opts)
        self.nodes: dict[str, InferenceNode] = {}
        previous = None
        for node_name, args in nodes.items():
            gate = [previous.sla or previous] if previous else []
            node = InferenceNode(node_name, args, opts=pulumi.ResourceOptions(parent=self, depends_on=gate))
            self.nodes[node_name] = node
            previous = node
        self.endpoints = {n: node.endpoint for n, node in self.nodes.items()}
        self.register_outputs({"endpoints": self.endpoints})
