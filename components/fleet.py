"""Fleet: the hosts (HostBase, once each) and the nodes on them, rolled out one after another.

Without a gateway, a node starts changing only after the previous node has passed its SLA
check, so a bad change stops at the first node instead of taking the whole fleet down. A
host's base waits for the same gate, as a kernel or package change there touches every node
it serves.

With a gateway (components/gateway.py) the nodes roll in waves: the first node (the canary)
alone, then `rollout.maxUnavailable` at a time. A node whose engine or host changes is drained
at the gateway first (its host retunes after that), checked directly, then enabled; the next
wave waits for the enables. The roll reads the gateway's rotation first (gateway.rotation_step).
A node neither in it nor deployed by the last successful `up` serves nobody yet, so its engine
waits only for the canary and its host is set up beside the canary: a fresh fleet is the
canary, then all the rest at once. A deployed node out of rotation (an `up` failed after its
drain) rolls first, and every serving node waits for its enable: draining one more could leave
none in rotation.
The gateway's host (a node's, or its own machine without an engine) is set up first and is
not gated, since every drain runs there.

Every gate is a rollout order only (rollout_gate): held while `up` runs, never recorded as a
dependency, so `destroy` takes the nodes down side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from components import gateway as gateway_shape
from components import cloud, gateway_render, hostbase, keys, node, templates
from components.gateway import GatewayArgs
from components.hostbase import HostBase, HostBaseArgs
from components.identity import this_stack
from components.ingress import NginxIngress
from components.node import NodeArgs, NodeService
from components.sla.provider import FimSlaCheck


def _serving_and_stranded(nodes: list, deployed: list, rotation_stdout: str | None) -> tuple[list, list]:
    """Serving: the nodes in the gateway's rotation now, or deployed by the last successful `up`
    (an `up` that failed exports nothing, so a node it enabled is known by the rotation alone).
    Stranded: deployed and out of rotation now, as an `up` that failed after a drain leaves it.
    With none in rotation (a fleet whose first `up` failed, a gateway host wiped) none serves, and
    the canary goes first as in a fresh fleet, so a bad change still stops there."""
    out = gateway_render.out_of_rotation(rotation_stdout)
    if not set(nodes) - out:
        return [], []
    deployed = set(deployed or []) & set(nodes)  # a node removed from the stack has no enable to wait for
    return sorted(deployed | (set(nodes) - out)), sorted(deployed & out)


@dataclass(frozen=True)
class FleetArgs:
    hosts: dict[str, HostBaseArgs]
    nodes: dict[str, NodeArgs]
    """In rollout order; each names its host in `hosts`."""
    gateway: GatewayArgs | None = None


def args_for(cfg) -> FleetArgs:
    """Each node of fimfleet:nodes on a host of its own, of the same name (the single-node
    shorthand is the node `node`), in the stack's order: the first is the canary."""
    views = {name: cfg.for_node(name) for name in cfg.node_names()}
    gw = gateway_shape.args_for(cfg)
    nodes = {name: node.args_for(view, name, host=name) for name, view in views.items()}
    if gw:  # behind the gateway, each node's certificate also carries the name the gateway verifies
        nodes = {name: node.behind_gateway(a) for name, a in nodes.items()}
    hosts = {name: hostbase.args_for(view) for name, view in views.items()}
    if cfg.gateway_host:  # the gateway on its own machine: a host without an engine
        hosts[gateway_shape.GATEWAY] = hostbase.args_for(cfg.for_gateway(), engine=False)
    return FleetArgs(hosts=hosts, nodes=nodes, gateway=gw)


def _registered(gate: pulumi.Input[list]) -> pulumi.Output:
    """The URNs of the resources in `gate`, known once each is registered (created or updated)."""
    return pulumi.Output.from_input(gate).apply(lambda rs: pulumi.Output.all(*[r.urn for r in rs or []]))


def rollout_gate(gate: pulumi.Input[list]) -> pulumi.Output:
    """`depends_on` for the rollout order, held while the program runs and not kept in the state.

    A resource given it registers only once every custom resource in `gate` (a list, or an
    Output of one) has been created or updated, as with `depends_on` itself, but no dependency
    on them is recorded: one node needs nothing of another, the order is only the rollout's.
    Recorded, it would make `destroy` take the nodes down one after another, in reverse rollout
    order, and every later node a dependent of the canary (`destroy --target`)."""
    return _held(_registered(gate))


def _held(waited: pulumi.Output) -> pulumi.Output:
    """An empty list known once `waited` is, with none of its resources as dependencies."""
    return pulumi.Output(set(), waited.apply(lambda _: []).future(), waited.is_known())


NODES_OUTPUT = "nodes"
"""The stack output that lists the nodes (__main__.py); the next `up` reads it back."""


def deployed_nodes() -> pulumi.Output:
    """The nodes the stack's last successful `up` exported, read back from the stack's own state
    (empty on a stack never deployed). An `up` that failed exports nothing, so a node it
    enabled counts as new once more: it then goes beside the wave after the canary."""
    ref = pulumi.StackReference(this_stack())
    return ref.get_output(NODES_OUTPUT).apply(lambda nodes: sorted(nodes or {}))


class Fleet(pulumi.ComponentResource):
    def __init__(self, name: str, args: FleetArgs, deployed: pulumi.Input[list] | None = None,
                 opts: pulumi.ResourceOptions | None = None):
        """`deployed`: the nodes already serving (deployed_nodes()); None: treat every node as
        serving, so each waits for its wave."""
        super().__init__("fimfleet:fleet:Fleet", name, None, opts)
        unknown = sorted({n.host for n in args.nodes.values()} - set(args.hosts))
        if unknown:
            raise ValueError(f"nodes name hosts that the fleet does not have: {unknown}")
        self.hosts: dict[str, HostBase] = {}
        self.cloud_keys = cloud.shared_keys(self, {n: h.host.instance for n, h in args.hosts.items()})
        self.nodes: dict[str, NodeService] = {}
        self.gateway = self.fleet_sla = None
        self.enables: dict = {}
        self.gates: dict[tuple[str, str], pulumi.Output] = {}
        """(name, "host" | "node" | "drain") -> the names its rollout gate waits for (_gate)."""
        if args.gateway is None:
            self._chain(args)
        else:
            self._waves(args, args.gateway, deployed)
        self.endpoints = {n: svc.endpoint for n, svc in self.nodes.items()}
        # What each node does once this `up` is through (an `up` that fails exports nothing).
        self.states = {n: self.enables[n].id.apply(lambda _: "in rotation") if n in self.enables
                       else (svc.sla or svc.monitor.step).id.apply(lambda _: "serving")
                       for n, svc in self.nodes.items()}
        canary, canary_args = next(iter(self.nodes.values())), next(iter(args.nodes.values()))
        if self.gateway:  # the fleet's endpoint, and the users' editor outputs, are the gateway's
            self.endpoint, self.ca_pem = self.gateway.endpoint, self.gateway.ca_pem
            self.editor_configs = node.editor_outputs(canary_args.editors, self.endpoint, self.ca_pem,
                                                      canary_args.api_keys)
        else:
            self.endpoint, self.ca_pem, self.editor_configs = canary.endpoint, canary.ingress.ca_pem, canary.editor_configs
        self.register_outputs({"endpoints": self.endpoints})

    def _gate(self, name: str, kind: str, gate: pulumi.Input[list]) -> pulumi.Output:
        """rollout_gate(gate), with the names it waits for kept in self.gates: the order is in no
        dependency of the state, so this is where it can be read (the unit tests do)."""
        waited = _registered(gate)
        self.gates[(name, kind)] = waited.apply(lambda urns: {u.split("::")[-1] for u in urns})
        return _held(waited)

    def _host(self, name: str, args: FleetArgs, gate: pulumi.Input[list]) -> HostBase:
        if name not in self.hosts:
            # The one-node layout kept the host under the node of the same name.
            moved = hostbase.legacy_parent(name, self) if name in args.nodes else None
            self.hosts[name] = HostBase(name, args.hosts[name], moved_from=moved, cloud_keys=self.cloud_keys,
                                        opts=pulumi.ResourceOptions(parent=self, depends_on=self._gate(name, "host", gate)))
        return self.hosts[name]

    def _chain(self, args: FleetArgs) -> None:
        previous = None
        for node_name, node_args in args.nodes.items():
            gate = [previous.sla or previous.monitor.step] if previous else []
            base = self._host(node_args.host, args, gate)
            self.nodes[node_name] = previous = NodeService(
                node_name, node_args, base,
                opts=pulumi.ResourceOptions(parent=self, depends_on=self._gate(node_name, "node", gate)))

    def _order(self, node_name: str, serving: list, stranded: list, wave_gate: list, new_gate: list) -> list:
        """What node_name's rollout waits for: nothing if a failed `up` left it drained, the canary's
        enable (new_gate) if it serves nobody yet, else the wave before it and every stranded node."""
        if node_name in stranded:
            return []
        if node_name not in serving:
            return new_gate
        return wave_gate + [self.enables[s] for s in stranded]

    def _waves(self, args: FleetArgs, gw: GatewayArgs, deployed) -> None:
        gw_base = self._host(gw.host, args, [])
        fleet_key = keys.ProbeKey("fleet-probe-key", opts=pulumi.ResourceOptions(parent=self))
        probe_key = pulumi.Output.secret(fleet_key.key)
        triggers = {n: gateway_shape.rollout_digest(a.runtime, args.hosts[a.host].kernel, args.hosts[a.host].host.packages)
                    for n, a in args.nodes.items()}
        order = None  # (serving, stranded); None: every node serves
        if deployed is not None:
            member_keys = {n: gateway_shape.member_key(n, gw, gw_base.nginx_settings, t) for n, t in triggers.items()}
            rotation = gateway_shape.rotation_step(gw, gw_base.connection, member_keys, self)
            order = pulumi.Output.all(deployed, rotation.stdout).apply(
                lambda v: _serving_and_stranded(list(args.nodes), *v))
        wave_gate: list = []
        canary_gate: list = []
        for wave in gateway_shape.waves(list(args.nodes), gw.max_unavailable):
            enables = []
            for node_name in wave:
                gate = wave_gate
                if order is not None:
                    # A serving node waits for the wave before it. A new one serves nobody: its
                    # engine waits for the canary.
                    gate = order.apply(lambda o, n=node_name, w=wave_gate, c=canary_gate: self._order(n, *o, w, c))
                node_args = args.nodes[node_name]
                trigger = triggers[node_name]
                drain = gateway_shape.member_step(node_name, False, gw, gw_base.connection, gw_base.nginx_settings,
                                                  trigger, self, after=self._gate(node_name, "drain", gate))
                # A serving node's host retunes only once the node is out of rotation (its drain);
                # a new or stranded node's host serves nobody, and is set up at once. (The gateway's
                # host, a node's too, is set up first: every drain runs there.)
                base_gate = [drain] if order is None else order.apply(
                    lambda o, n=node_name, d=drain: [d] if n in o[0] and n not in o[1] else [])
                base = self._host(node_args.host, args, base_gate)
                svc = NodeService(node_name, node_args, base, gate=[drain],
                                  extra_keys={keys.FLEET_PROBE_KEY_NAME: probe_key},
                                  opts=pulumi.ResourceOptions(parent=self,
                                                              depends_on=self._gate(node_name, "node", gate)))
                # Back into rotation once the node's own SLA check passed (its monitor, with the gate off).
                # Its destroy (a drain) goes before the gateway host's nginx step: beside it, it could
                # make that step's lock and rotation directories again after their destroy.
                stranded = None if order is None else order.apply(lambda o, n=node_name: "stranded" if n in o[1] else "")
                enable_step = gateway_shape.member_step(node_name, True, gw, gw_base.connection,
                                                        gw_base.nginx_settings, trigger, self,
                                                        after=[svc.sla or svc.monitor.step, gw_base.nginx], drain=drain,
                                                        stranded=stranded)
                self.nodes[node_name], self.enables[node_name] = svc, enable_step
                enables.append(enable_step)
            canary_gate, wave_gate = canary_gate or enables, enables
        cas = pulumi.Output.all(*[svc.ingress.ca_pem for svc in self.nodes.values()]).apply(gateway_shape.ca_bundle)
        self.gateway = NginxIngress(f"{gateway_shape.GATEWAY}-ingress", gw.ingress, host=gw_base.facts,
                                    connection=gw_base.connection, nginx=gw_base.nginx_settings,
                                    extra_keys={keys.FLEET_PROBE_KEY_NAME: probe_key}, upstream_ca_pem=cas,
                                    opts=pulumi.ResourceOptions(parent=self, depends_on=[gw_base.nginx]))
        first = next(iter(args.nodes.values()))
        if first.sla:
            s = first.sla
            triggers = pulumi.Output.all(*[svc.trigger for svc in self.nodes.values()])
            self.fleet_sla = FimSlaCheck(
                "fleet-sla", endpoint=self.gateway.endpoint, api_key=probe_key, ca_pem=self.gateway.ca_pem,
                model=first.model, thresholds=s.thresholds, samples=s.samples * len(args.nodes), warmup=s.warmup,
                concurrency=s.concurrency * len(args.nodes), max_tokens=s.max_tokens,
                trigger=triggers.apply(lambda t: templates.digest(self.gateway.digest, *t)),
                ceiling=None, opts=pulumi.ResourceOptions(parent=self, depends_on=[
                    self.gateway.step, *self.enables.values(),
                    # as each node's own check: never while a node's Prometheus installs and loads it
                    *[step for svc in self.nodes.values() if svc.monitoring for step in svc.monitoring.steps]]))
