"""Host: how fimfleet reaches a node, what it checks first, and the packages it installs.

Kinds: an existing VPS over SSH (the runbook's case) and the local test VM built by
toolchain/testbed. A provisioned cloud instance fits the same interface: it only has
to produce `connection` (address, port, user, private key as a secret).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pulumi

from components import cloud, cloud_types, templates, tiers
from components.config import StackConfig
from components.identity import HostIdentity, this_stack
from components.remote import RemoteStep

STEAL_SAMPLE_SECONDS = 3


ALLOCATOR_PACKAGES = {"jemalloc": ["libjemalloc2"], "tcmalloc": ["libtcmalloc-minimal4"], "none": []}
"""The Debian package behind each runtime.allocator (its library is runtime.PRELOAD's)."""


def packages(cfg: StackConfig) -> list[str]:
    """Debian packages the node needs for its runtime kind."""
    base = ["nginx", "openssl", "curl", "ca-certificates", "numactl", "libnuma1", "jq"]
    allocator = ALLOCATOR_PACKAGES[cfg.runtime.allocator]
    # the venv's own pip comes from python3-venv (ensurepip); Debian's python3-pip would add four
    # packages that nothing runs
    runtime = ["docker.io", "apparmor"] if cfg.runtime.kind == "docker" else ["python3-venv"]
    return base + allocator + runtime


GATEWAY_PACKAGES = ("nginx", "openssl", "curl", "ca-certificates", "jq")
"""What a gateway's own machine needs: nginx and the tools its scripts use, no engine."""


def preflight_script(cfg: StackConfig, engine: bool = True) -> str:
    """The read-only host check (files/host/preflight.sh.j2); GPU rules from tiers.gpu_requirement.
    A host without an engine (the gateway's own) is held to no tier's hardware, only to steal."""
    h = cfg.host
    needed_gib = int(cfg.memory.total / 1024**3) + 1 if cfg.memory and cfg.tier.device == "cpu" else 1
    accepted, min_gpu_mib = tiers.gpu_requirement(h.gpu_model or "", h.gpu_memory_gib or 0)
    cpu_tiers = [t for t in tiers.TIERS.values() if t.device == "cpu" and not t.test_only]
    facts = dict(cpu_flags=h.cpu_flags or [], memory_gib=h.memory_gib, cpus=h.cpus, numa_nodes=h.numa_nodes,
                 gpu_count=h.gpu_count or 0) if engine else dict(cpu_flags=[], memory_gib=1, cpus=1, numa_nodes=0, gpu_count=0)
    return templates.render(
        "host/preflight.sh.j2", tier=cfg.tier.name, config_key=f"fimfleet:{cfg.node_key}", min_memory_gib=needed_gib,
        steal_seconds=STEAL_SAMPLE_SECONDS, max_steal=h.max_steal_percent, cpu_tiers=cpu_tiers,
        gpu_model=h.gpu_model or "", gpu_memory_gib=h.gpu_memory_gib or 0, accepted_gpus=accepted,
        min_gpu_mib=min_gpu_mib, venv=cfg.runtime.venv_path if engine and cfg.runtime.kind == "systemd" else "",
        **facts,
    )


def _testbed_info(state_dir: str) -> dict:
    """The test VM's facts, written by toolchain/testbed/vm.py (info.json)."""
    path = Path(state_dir) / "info.json"
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise FileNotFoundError(f"fimfleet:host.testbedState: no test VM in {state_dir} ({e}); "
                                "start one with `python3 toolchain/testbed/vm.py restore --state DIR`") from None


def testbed_connection(state_dir: str) -> dict:
    """The VM's SSH endpoint and key; its host key is known from the image build, so it is always pinned."""
    ssh = _testbed_info(state_dir)["ssh"]
    return {"host": ssh["host"], "port": int(ssh["port"]), "user": ssh.get("user", "root"),
            "privateKey": Path(ssh["key"]).read_text(), "hostKey": " ".join(ssh["host_key"].split()[:2])}


def testbed_forwards(state_dir: str) -> dict[int, int]:
    """Guest port -> host port of the VM's user-mode network forwards."""
    return {int(g): int(h) for g, h in _testbed_info(state_dir)["ports"].items()}


def base_connection(cfg: StackConfig) -> dict:
    """The SSH connection before its host key is verified; it carries the private key, so Host
    keeps it a secret. A cloud instance's address replaces `host` once the instance exists."""
    h = cfg.host
    if h.kind == "local-vm":
        conn = testbed_connection(h.testbed_state)
    else:
        conn = {"host": h.address or "", "port": h.port, "user": h.user, "privateKey": cfg.secrets.ssh_private_key}
    if h.bastion:
        conn.update(bastionHost=h.bastion["address"], bastionPort=int(h.bastion.get("port", 22)),
                    bastionUser=h.bastion.get("user", h.user))
    conn["gone"] = h.gone  # a host declared gone is never contacted (destroy and refresh skip it)
    return conn


def pinned_connection(base: pulumi.Input[dict], ident: HostIdentity) -> pulumi.Output[dict]:
    """What every step connects with: the base connection plus the verified host key(s) and identity."""
    return pulumi.Output.secret(pulumi.Output.all(base, ident.hostKeySeen, ident.bastionHostKeySeen, ident.identity).apply(
        lambda a: {**a[0], "hostKey": a[1], "bastionHostKey": a[2] or "", "identity": a[3]}))


@dataclass(frozen=True)
class HostFacts:
    """What other components may know of a host; only Host reads the testbed's info.json."""

    kind: str
    """ssh, local-vm, or a cloud provider (hcloud, aws)."""
    address: pulumi.Output
    """Where operators and editors reach it: the configured address, the instance's, or 127.0.0.1 (test VM)."""
    configured_address: str = ""
    """fimfleet:host.address as configured ("" for the test VM and cloud instances)."""
    forwards: dict[int, int] = field(default_factory=dict)
    """Guest port -> local port of the test VM's user-mode network; empty elsewhere."""

    @property
    def provisioned(self) -> bool:
        return self.kind in cloud_types.CLOUD_PROVIDERS

    def public_port(self, port: int) -> int:
        return self.forwards.get(port, port)


@dataclass(frozen=True)
class HostArgs:
    """What Host needs: how to reach the host, which key it must show, what to check and install."""

    kind: str
    """ssh, local-vm, or a cloud provider (hcloud, aws)."""
    connection: dict
    """base_connection(): a secret, as it holds the private key."""
    configured_address: str = ""
    host_key: str = ""
    """The key the host must show ("" = trust on first use, then pinned)."""
    bastion_host_key: str = ""
    forwards: dict[int, int] = field(default_factory=dict)
    preflight: str = ""
    """The rendered read-only check (preflight_script)."""
    packages: tuple[str, ...] = ()
    instance: cloud.InstanceArgs | None = None
    """A cloud instance to create first (host.provider hcloud or aws)."""


def args_for(cfg: StackConfig, engine: bool = True) -> HostArgs:
    """A validated StackConfig's host as HostArgs; the only reader of the test VM's info.json.
    `engine=False`: a host that runs no engine (the gateway's own): nginx only, no tier hardware."""
    h = cfg.host
    conn = base_connection(cfg)
    testbed = h.kind == "local-vm"
    return HostArgs(kind=h.kind, connection=conn, configured_address=h.address or "",
                    host_key=h.host_key or (conn["hostKey"] if testbed else ""),
                    bastion_host_key=(h.bastion or {}).get("hostKey", ""),
                    forwards=testbed_forwards(h.testbed_state) if testbed else {},
                    preflight=preflight_script(cfg, engine),
                    packages=tuple(packages(cfg)) if engine else GATEWAY_PACKAGES,
                    instance=cloud.instance_args(cfg) if h.provider in cloud_types.CLOUD_PROVIDERS else None)


class Host(pulumi.ComponentResource):
    """Connection, preflight (read-only, first), then packages."""

    def __init__(self, name: str, args: HostArgs, opts: pulumi.ResourceOptions | None = None,
                 cloud_keys: Mapping[str, pulumi.Resource] | None = None):
        super().__init__("fimfleet:host:Host", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # host.provider hcloud / aws: create the instance first; first contact waits until sshd answers.
        self.instance = cloud.instance_for(f"{name}-cloud", args.instance, opts=child, keys=cloud_keys)
        base = pulumi.Output.secret({**args.connection, "host": self.instance.address} if self.instance
                                    else args.connection)
        self.address = pulumi.Output.from_input(
            self.instance.address if self.instance else
            args.configured_address if args.kind == "ssh" else pulumi.Output.unsecret(base.apply(lambda c: c["host"])))
        self.facts = HostFacts(kind=args.kind, address=self.address, configured_address=args.configured_address,
                               forwards=dict(args.forwards))
        first = pulumi.ResourceOptions(parent=self, depends_on=[self.instance] if self.instance else [])
        self.identity = HostIdentity(f"{name}-identity", connection=base, host_key=args.host_key,
                                     bastion_host_key=args.bastion_host_key, owner=this_stack(), opts=first)
        self.connection = pinned_connection(base, self.identity)
        booted = [cloud.cloud_init_step(f"{name}-cloud-init", self.connection, opts=child)] if self.instance else []
        self.preflight = RemoteStep(f"{name}-preflight", label="host preflight", connection=self.connection,
                                    apply=args.preflight, timeout_s=120,
                                    opts=pulumi.ResourceOptions(parent=self, depends_on=booted))
        pkgs = list(args.packages)
        self.packages = RemoteStep(
            f"{name}-packages", label="packages", connection=self.connection,
            apply=templates.render("host/packages.sh.j2", packages=pkgs),
            destroy=templates.render("host/packages-destroy.sh.j2"), triggers=pkgs, timeout_s=1800,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.preflight]))
        self.register_outputs({"address": self.address, "identity": self.identity.identity})
