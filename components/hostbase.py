"""HostBase: what a host needs once, however many nodes it serves.

The connection (identity pinned), preflight, packages, kernel tuning, nginx's main config
and systemd's watchdog belong to the host, not to a node: a second node on the same host
shares them instead of writing the same sysctl, limits and nginx files again. NodeService
(components/node.py) builds on its outputs.

Until the fleet shape, these resources lived under the node (InferenceNode). `moved_from`
aliases them to those URNs, so an existing stack upgrades without replacing anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from components import host, kernel, nginx_base, templates, watchdog
from components.host import Host
from components.kernel import KernelTuning
from components.remote import RemoteStep

LEGACY_NODE_TYPE = "fimfleet:node:InferenceNode"
"""The node component that owned the host's resources before HostBase existed."""


@dataclass(frozen=True)
class HostBaseArgs:
    """One host: how to reach and check it (host.HostArgs), how its kernel is tuned, how its
    nginx runs, and whether systemd's hardware watchdog reboots it when it hangs."""

    host: host.HostArgs
    kernel: kernel.KernelArgs
    watchdog: bool = False
    nginx: nginx_base.NginxBase = nginx_base.NginxBase()


def args_for(cfg, engine: bool = True) -> HostBaseArgs:
    """A validated StackConfig's host as HostBaseArgs (host.args_for reads the test VM's info.json);
    `engine=False` for the gateway's own machine."""
    return HostBaseArgs(host=host.args_for(cfg, engine), kernel=kernel.args_for(cfg), watchdog=cfg.monitor.watchdog)


def legacy_parent(node_name: str, fleet: pulumi.Resource) -> pulumi.Alias:
    """Where a host resource lived before: under the node's InferenceNode, itself under the fleet."""
    return pulumi.Alias(parent=pulumi.create_urn(node_name, LEGACY_NODE_TYPE, parent=fleet))


class HostBase(pulumi.ComponentResource):
    """Host (identity, preflight, packages), then kernel tuning, nginx's main config and the
    watchdog. Outputs: connection, facts, identity, the nginx settings (`nginx_settings`),
    and the stages nodes wait for (`host`: packages installed, `kernel`: tuned, `nginx`:
    the main config that includes their sites)."""

    def __init__(self, name: str, args: HostBaseArgs, moved_from: pulumi.Alias | None = None,
                 opts: pulumi.ResourceOptions | None = None, cloud_keys: Mapping[str, pulumi.Resource] | None = None):
        """`cloud_keys`: the fleet's shared cloud SSH keys (cloud.shared_keys)."""
        super().__init__("fimfleet:host:HostBase", name, None, opts)
        moved = [moved_from] if moved_from else []
        self.host = Host(f"{name}-host", args.host, opts=pulumi.ResourceOptions(parent=self, aliases=moved),
                         cloud_keys=cloud_keys)
        self.connection = self.host.connection
        self.facts = self.host.facts
        self.identity = self.host.identity.identity
        # Kernel tuning needs only the preflight: it overlaps the package install.
        self.kernel = KernelTuning(f"{name}-kernel", args.kernel, self.connection, opts=pulumi.ResourceOptions(
            parent=self, depends_on=[self.host.preflight], aliases=moved))
        self.nginx_settings = args.nginx
        n = nginx_base.render(args.nginx)
        self.nginx = RemoteStep(f"{name}-nginx", label="nginx (host)", connection=self.connection, files=n.files,
                                apply=n.apply, check=n.check, destroy=n.destroy,
                                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.host]))
        self.nginx_digest = templates.digest(n.files, n.apply)
        self.watchdog = None
        if args.watchdog:
            w = watchdog.render()
            self.watchdog = RemoteStep(f"{name}-watchdog", label="systemd watchdog", connection=self.connection,
                                       files=w.files, apply=w.apply, check=w.check, destroy=w.destroy,
                                       opts=pulumi.ResourceOptions(parent=self, depends_on=[self.host.preflight]))
        self.register_outputs({"address": self.host.address, "identity": self.identity})
