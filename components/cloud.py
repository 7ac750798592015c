"""Cloud instances that `pulumi up` creates with the clouds' own Pulumi providers.

One component per provider (pulumi-hcloud, pulumi-aws), each creating: the SSH key from the
stack's secret, a firewall (the public ingress ports from anywhere, 22 only from
host.adminCidrs, nothing else in), the server with an image found by name or lookup,
cloud-init that turns password logins off, and optionally a DNS record for ingress.domain.
Output: `address`, the instance's public IPv4, and `reachable`, done once sshd answers there.
The Host then makes its first SSH contact (HostIdentity pins the host key), waits for
cloud-init (`cloud_init_step`) and runs the same preflight as on any other host.

The provider SDKs are imported inside the components: non-cloud stacks and the dynamic
provider below never load them.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, Resource, ResourceProvider

from components import cloud_types, templates
from components.config import StackConfig
from components.errors import Error, readable_failures
from components.remote import RemoteStep

ANYWHERE = ("0.0.0.0/0", "::/0")
LABELS = {"managed-by": "fimfleet"}
HCLOUD_IMAGE = "debian-12"
"""The OS fimfleet's test VM runs; Hetzner keeps the name current, so it never goes stale."""
AMI_LOOKUP = {
    # NVIDIA driver, CUDA, Docker and the NVIDIA container toolkit preinstalled; published by AWS.
    True: {"owners": ["amazon"], "name": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *"},
    # Debian's own account (the Debian cloud team); same OS as fimfleet's test VM.
    False: {"owners": ["136693071363"], "name": "debian-12-amd64-*"},
}
"""AMI name lookups by `gpu`; the newest match is taken once, at creation (see ignore_changes below)."""
ROOT_DISK_GIB = 200
"""AWS root volume: the image's OS (and CUDA stack), the vllm-openai image and the checkpoint
(Qwen2.5-Coder-32B in BF16 is about 66 GB). Deleted with the instance."""
BOOT_TIMEOUT_S = 900
"""How long a new instance may take until sshd answers (GPU instances can take several minutes)."""


@dataclass(frozen=True)
class InstanceArgs:
    provider: str
    """hcloud or aws (cloud_types.CLOUD_PROVIDERS)."""
    region: str
    """Hetzner location or AWS region."""
    instance_type: str
    image: str
    """Override: a Hetzner image name or an AMI ID; "" = HCLOUD_IMAGE / the AMI_LOOKUP match."""
    gpu: bool
    """The type has GPUs: on AWS the image must carry the NVIDIA driver and container toolkit."""
    public_key: str
    """OpenSSH public key derived from the stack's sshPrivateKey (the private key never leaves the secret)."""
    admin_cidrs: tuple[str, ...]
    public_ports: tuple[int, ...]
    """Open to anywhere: ingress.httpsPort and ingress.httpPort (the redirect), and 80 with ACME:
    Let's Encrypt's HTTP-01 challenge comes to port 80 only, where certbot answers it itself."""
    domain: str
    dns_zone: str
    """When set, an A record for `domain` in this zone (Hetzner DNS or Route 53)."""
    user_data: str
    account: Mapping[str, Any] = field(default_factory=dict)
    """aws: the stack's aws:* account settings for the instance's own provider (cloud_types.aws_settings)."""


def instance_args(cfg: StackConfig) -> InstanceArgs:
    h = cfg.host
    return InstanceArgs(account=cloud_types.aws_settings() if h.provider == "aws" else {},
        provider=h.provider, region=h.region, instance_type=h.instance_type, image=h.image, gpu=bool(h.gpu_count),
        public_key=cloud_types.public_key(cfg.secrets.ssh_private_key), admin_cidrs=tuple(h.admin_cidrs),
        public_ports=tuple(dict.fromkeys((cfg.ingress.https_port, cfg.ingress.http_port,
                                          *((80,) if cfg.ingress.tls == "acme" else ())))),
        domain=cfg.ingress.domain,
        dns_zone=h.dns_zone, user_data=templates.render("cloud/cloud-init.yaml.j2"))


def ingress_rules(args: InstanceArgs) -> list[tuple[int, tuple[str, ...], str]]:
    """(TCP port, source CIDRs, why): everything the firewall lets in. Outbound stays open (apt, model download)."""
    return [(22, args.admin_cidrs, "SSH from host.adminCidrs"),
            *((p, ANYWHERE, "fimfleet ingress (nginx)") for p in args.public_ports)]


def shared_keys(fleet: pulumi.Resource, instances: Mapping[str, InstanceArgs | None]) -> dict[str, pulumi.Resource]:
    """One hcloud SshKey per public key for a whole fleet, by public key: Hetzner refuses a second
    key with the same fingerprint ("uniqueness_error"), so every server of the fleet names this one.
    It keeps the resource that the first such host made for itself before (an alias, no replace)."""
    keys: dict[str, pulumi.Resource] = {}
    for host, a in instances.items():
        if a is None or a.provider != "hcloud" or a.public_key in keys:
            continue
        import pulumi_hcloud as hcloud

        old_parent = pulumi.create_urn(f"{host}-host-cloud", "fimfleet:cloud:HcloudInstance", parent=pulumi.create_urn(
            f"{host}-host", "fimfleet:host:Host", parent=pulumi.create_urn(host, "fimfleet:host:HostBase", parent=fleet)))
        keys[a.public_key] = hcloud.SshKey(f"hcloud-key-{host}", public_key=a.public_key, labels=LABELS,
                                           opts=pulumi.ResourceOptions(parent=fleet, aliases=[
                                               pulumi.Alias(name=f"{host}-host-cloud-key", parent=old_parent)]))
    return keys


class HcloudInstance(pulumi.ComponentResource):
    """A Hetzner Cloud server with its firewall and optional DNS record, and its SSH key: the
    fleet's shared one (`key`), or its own when built alone."""

    def __init__(self, name: str, args: InstanceArgs, opts: pulumi.ResourceOptions | None = None,
                 key: pulumi.Resource | None = None):
        super().__init__("fimfleet:cloud:HcloudInstance", name, None, opts)
        import pulumi_hcloud as hcloud

        child = pulumi.ResourceOptions(parent=self)
        self.key = key or hcloud.SshKey(f"{name}-key", public_key=args.public_key, labels=LABELS, opts=child)
        self.firewall = hcloud.Firewall(f"{name}-firewall", labels=LABELS, opts=child, rules=[
            {"direction": "in", "protocol": "tcp", "port": str(port), "source_ips": list(cidrs), "description": why}
            for port, cidrs, why in ingress_rules(args)])
        self.server = hcloud.Server(
            f"{name}-server", server_type=args.instance_type, image=args.image or HCLOUD_IMAGE, location=args.region,
            ssh_keys=[self.key.id], firewall_ids=[self.firewall.id.apply(int)], user_data=args.user_data,
            public_nets=[{"ipv4_enabled": True, "ipv6_enabled": True}], labels=LABELS, opts=child)
        self.address: pulumi.Output[str] = self.server.ipv4_address
        self.reachable = SshReachable(f"{name}-ssh", host=self.address, opts=child)
        self.dns = None
        if args.dns_zone:
            self.dns = hcloud.ZoneRrset(
                f"{name}-dns", zone=args.dns_zone, name=cloud_types.dns_record_name(args.domain, args.dns_zone),
                type="A", ttl=60, records=[{"value": self.address}], opts=child)
        self.register_outputs({"address": self.address})


class AwsInstance(pulumi.ComponentResource):
    """An EC2 instance with its key pair, security group and optional Route 53 record.

    Its own aws provider carries the region (host.region), so nodes of one fleet can sit in
    different regions, and the stack's aws:profile / credentials (an explicit provider reads no
    stack config); without them, the AWS CLI's standard chain (AWS_PROFILE, AWS_ACCESS_KEY_ID...)."""

    def __init__(self, name: str, args: InstanceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:cloud:AwsInstance", name, None, opts)
        import pulumi_aws as aws

        self.provider = aws.Provider(f"{name}-aws", region=args.region, **args.account,
                                     opts=pulumi.ResourceOptions(parent=self))
        child = pulumi.ResourceOptions(parent=self, provider=self.provider)
        invoke = pulumi.InvokeOptions(parent=self, provider=self.provider)
        tags = {**LABELS, "Name": f"fimfleet-{pulumi.get_stack()}-{name}"}
        if args.image:
            ami = pulumi.Output.from_input(args.image)
        else:
            look = AMI_LOOKUP[args.gpu]
            ami = aws.ec2.get_ami_output(
                most_recent=True, owners=look["owners"], opts=invoke,
                filters=[{"name": "name", "values": [look["name"]]}, {"name": "architecture", "values": ["x86_64"]},
                         {"name": "state", "values": ["available"]}]).id
        self.key = aws.ec2.KeyPair(f"{name}-key", public_key=args.public_key, tags=tags, opts=child)
        self.firewall = aws.ec2.SecurityGroup(
            f"{name}-firewall", description="fimfleet: ingress ports from anywhere, SSH from host.adminCidrs",
            tags=tags, opts=child,
            ingress=[{"protocol": "tcp", "from_port": port, "to_port": port, "description": why,
                      "cidr_blocks": [c for c in cidrs if ":" not in c], "ipv6_cidr_blocks": [c for c in cidrs if ":" in c]}
                     for port, cidrs, why in ingress_rules(args)],
            egress=[{"protocol": "-1", "from_port": 0, "to_port": 0, "cidr_blocks": ["0.0.0.0/0"], "ipv6_cidr_blocks": ["::/0"]}])
        # A newer AMI release must not replace a serving instance: the lookup counts at creation only
        # (`pulumi up --replace <urn>` moves to the newest image on purpose). A host.image the user
        # sets is theirs to change: a new one replaces the instance, as on Hetzner.
        self.server = aws.ec2.Instance(
            f"{name}-server", ami=ami, instance_type=args.instance_type, key_name=self.key.key_name,
            vpc_security_group_ids=[self.firewall.id], associate_public_ip_address=True, user_data=args.user_data,
            root_block_device={"volume_size": ROOT_DISK_GIB, "volume_type": "gp3", "encrypted": True,
                               "delete_on_termination": True},
            metadata_options={"http_tokens": "required"}, tags=tags,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(ignore_changes=[] if args.image else ["ami"])))
        self.address: pulumi.Output[str] = self.server.public_ip
        self.reachable = SshReachable(f"{name}-ssh", host=self.address, opts=pulumi.ResourceOptions(parent=self))
        self.dns = None
        if args.dns_zone:
            zone = aws.route53.get_zone_output(name=args.dns_zone, private_zone=False, opts=invoke)
            self.dns = aws.route53.Record(f"{name}-dns", zone_id=zone.zone_id, name=args.domain, type="A", ttl=60,
                                          records=[self.address], opts=child)
        self.register_outputs({"address": self.address})


COMPONENTS = {"hcloud": HcloudInstance, "aws": AwsInstance}


def instance_for(name: str, args: InstanceArgs | None, opts: pulumi.ResourceOptions | None = None,
                 keys: Mapping[str, pulumi.Resource] | None = None):
    """The cloud instance of a host, or None when it has none (host.provider ssh or local-vm);
    `keys`: the fleet's shared_keys."""
    if args is None:
        return None
    if args.provider == "hcloud":
        return HcloudInstance(name, args, opts, key=(keys or {}).get(args.public_key))
    return COMPONENTS[args.provider](name, args, opts)


def wait_for_ssh(host: str, port: int, timeout_s: float, poll_s: float = 3.0) -> None:
    """Return once `host:port` accepts TCP; raise an Error naming the likely cause after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(10.0, max(timeout_s, 0.1))).close()
            return
        except OSError as e:
            if time.monotonic() + poll_s > deadline:
                raise Error(f"the new instance {host} did not accept SSH on port {port} within {timeout_s:.0f}s ({e}). "
                            "Check that fimfleet:host.adminCidrs contains the address this machine connects from") from None
            time.sleep(poll_s)


class SshReachableProvider(ResourceProvider):
    """Waits (create) until a new instance's sshd accepts connections. Opens no SSH session and
    holds no secret: the first SSH contact (HostIdentity, which pins the host key) comes after."""

    @readable_failures
    def create(self, props: dict[str, Any]) -> CreateResult:
        wait_for_ssh(props["host"], int(props["port"]), float(props["timeoutS"]))
        return CreateResult(id_=uuid.uuid4().hex, outs=props)

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        moved = (olds.get("host"), olds.get("port")) != (news.get("host"), news.get("port"))
        return DiffResult(changes=moved, replaces=["host"] if moved else [], delete_before_replace=False)


class SshReachable(Resource):
    """The instance's sshd answers: what HostIdentity's first contact waits for."""

    def __init__(self, name: str, *, host: pulumi.Input[str], port: int = 22, timeout_s: int = BOOT_TIMEOUT_S,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(SshReachableProvider(), name, {"host": host, "port": port, "timeoutS": timeout_s}, opts)


def cloud_init_step(name: str, connection: pulumi.Input[dict], opts: pulumi.ResourceOptions | None = None) -> RemoteStep:
    """The first step on a new instance: cloud-init has finished and sshd refuses passwords."""
    return RemoteStep(name, label="cloud-init", connection=connection, apply=templates.render("cloud/boot-wait.sh.j2"),
                      timeout_s=1800, opts=opts)
