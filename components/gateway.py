"""Gateway: the fleet's one endpoint, an nginx site beside one node or on its own machine,
in front of every node.

It terminates TLS for the fleet, checks the named keys and rate limits as a node does, and
proxies to each node's ingress over TLS verified against the nodes' own CAs, keeping each key
on one node (components/gateway_render.py). A rolling update drains a node at the gateway
before its engine changes, checks the node's SLA directly, and only then enables it again
(`member_step`); components/fleet.py orders the nodes into waves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pulumi

from components import host as hosts
from components import ingress, kernel, runtime, templates
from components.config import ConfigError, Problem
from components.gateway_render import (GATEWAY, FleetUpstream, GatewayPaths, Member, member_check, member_script,
                                       rotation_script)
from components.nginx_base import NginxBase
from components.remote import RemoteStep

TESTBED_HOST = "10.0.2.2"
"""How a test VM reaches the machine that runs it (QEMU's user network): another test VM's
ingress is the port that machine forwards to it."""
SERVERS_FILE = "gateway.servers"
"""In the host's fimfleet.d/, beside the sites; not *.conf, so only the gateway's upstream includes it."""


@dataclass(frozen=True)
class GatewayArgs:
    host: str
    """The host that runs the gateway: a node's, or its own (named GATEWAY)."""
    ingress: ingress.IngressArgs
    """The gateway's site: node name GATEWAY, the gateway's ports, the FleetUpstream."""
    max_unavailable: int = 1
    drain_timeout_s: int = 60


def waves(nodes: list[str], max_unavailable: int) -> list[list[str]]:
    """The canary alone, then the others `max_unavailable` at a time, in the stack's order."""
    head, rest = nodes[:1], nodes[1:]
    return [head] + [rest[i:i + max_unavailable] for i in range(0, len(rest), max_unavailable)] if head else []


def rollout_digest(runtime_args: runtime.RuntimeArgs, kernel_args: kernel.KernelArgs, packages: tuple) -> str:
    """What restarts a node's engine or retunes its host; only a change here drains the node.
    A new site or key reloads nginx gracefully and never drops a stream, so it is not drained."""
    return templates.digest(runtime.digest_of(runtime_args), kernel.digest_of(kernel_args), list(packages))


def args_for(cfg, nginx: NginxBase = NginxBase()) -> GatewayArgs | None:
    """The gateway of a validated StackConfig, or None when fimfleet:gateway.host is unset."""
    gw = cfg.gateway
    if not gw.host:
        return None
    members = tuple(member(name, n.host, gw.host, cfg.ingress.https_port) for name, n in cfg.nodes.items())
    host, view = (GATEWAY, cfg.for_gateway()) if cfg.gateway_host else (gw.host, cfg.for_node(gw.host))
    fleet = FleetUpstream(members=members, paths=GatewayPaths(servers=f"{nginx.sites_dir}/{SERVERS_FILE}"),
                          ca_path=f"{ingress.TLS_ROOT}/{GATEWAY}/nodes-ca.pem", max_fails=gw.max_fails,
                          fail_timeout_s=gw.fail_timeout_s, tries=min(len(members), cfg.rollout.max_unavailable + 1),
                          member_port=gw.member_port)
    settings = dataclasses.replace(cfg.ingress, https_port=gw.https_port, http_port=gw.http_port)
    site = dataclasses.replace(ingress.args_for(view, GATEWAY), settings=settings, fleet=fleet, monitoring=False)
    return GatewayArgs(host=host, ingress=site, max_unavailable=cfg.rollout.max_unavailable,
                       drain_timeout_s=cfg.rollout.drain_timeout_s)


def member(name: str, node_host, gateway_host: str, https_port: int) -> Member:
    """Where the gateway reaches node `name`'s ingress: itself over loopback, a test VM through the
    port the machine running both VMs forwards to it, any other host at its address."""
    if name == gateway_host:
        return Member(name, "127.0.0.1", https_port)
    if node_host.kind == "local-vm":
        forwards = hosts.testbed_forwards(node_host.testbed_state)
        if https_port not in forwards:
            raise ConfigError([Problem(f"nodes.{name}.testbedState", node_host.testbed_state,
                                       f"that test VM forwards no port to its ingress port {https_port}, so the "
                                       f"gateway cannot reach it; restore the VM with `--forward {https_port}`")])
        return Member(name, TESTBED_HOST, forwards[https_port])
    return Member(name, node_host.address, https_port)


def member_step(node: str, enabled: bool, args: GatewayArgs, connection: pulumi.Input[dict], nginx: NginxBase,
                trigger: str, parent: pulumi.Resource, after: pulumi.Input[list],
                drain: RemoteStep | None = None, stranded: pulumi.Input[str] | None = None) -> RemoteStep:
    """Node `node`'s drain (before its engine changes) or enable (after its SLA check) on the
    gateway host. Both run only when `trigger` changes, so an unchanged node is never drained,
    and a node whose check failed stays drained until a later `up` passes it. An enable also
    runs after every run of its `drain` (whose output names the run): a drain's script or a
    config rolled back after a failed check drains again, and the stored enable saw no change.
    `stranded` ("stranded" while the rotation read finds the node out, else "") runs the enable
    of a node out of rotation whose steps saw no change (its marker lost, a drain cut short),
    and once more at the first roll after that, a harmless enable of a node in rotation."""
    paths = args.ingress.fleet.paths
    action = "enable" if enabled else "drain"
    triggers = [trigger] + ([drain.stdout] if drain is not None else [])
    if stranded is not None:  # a trigger only while stranded: the steps of a stack from before it stay unchanged
        triggers = pulumi.Output.all(*triggers, stranded).apply(lambda t: t[:-1] + [t[-1]] if t[-1] else t[:-1])
    return RemoteStep(
        f"{node}-{action}", label=f"gateway: {action} {node}", connection=connection, triggers=triggers,
        apply=member_script(node, enabled, nginx, paths, args.drain_timeout_s),
        check=member_check(node, paths) if enabled else None,
        # a node that leaves the fleet leaves the rotation first
        destroy=member_script(node, False, nginx, paths, 1) if enabled else None,
        timeout_s=args.drain_timeout_s + 120, opts=pulumi.ResourceOptions(parent=parent, depends_on=after))


def member_key(node: str, args: GatewayArgs, nginx: NginxBase, trigger: str) -> str:
    """What runs node `node`'s drain or enable again: its trigger and both scripts (a new drain
    timeout, or a fimfleet upgrade's script, runs them with the same trigger)."""
    paths = args.ingress.fleet.paths
    return templates.digest(trigger, *[member_script(node, e, nginx, paths, args.drain_timeout_s) for e in (False, True)])


def rotation_step(args: GatewayArgs, connection: pulumi.Input[dict], keys: dict[str, str],
                  parent: pulumi.Resource) -> RemoteStep:
    """Reads which of the nodes are out of the gateway's rotation as a roll starts. It runs when
    a drain or enable may run (`keys`: node -> member_key, in the stack's order), so its output
    is never older than the last roll, and a no-op `up` opens no SSH session. The output
    decides the order: a node a failed `up` left drained rolls first."""
    return RemoteStep(f"{GATEWAY}-rotation", label="gateway: read the rotation", connection=connection,
                      triggers=[f"{n} {k}" for n, k in keys.items()],
                      apply=rotation_script(args.ingress.fleet.paths, list(keys)), timeout_s=120,
                      opts=pulumi.ResourceOptions(parent=parent))


def ca_bundle(pems: list[str]) -> str:
    """The nodes' CAs the gateway trusts upstream, one after another."""
    return "".join(p if p.endswith("\n") else p + "\n" for p in pems if p)
