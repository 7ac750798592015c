"""Cloud instances (components/cloud.py) under Pulumi mocks: what every cloud stack creates,
its firewall, its secrets, where the Host connects, what waits for what, and what destroy removes.

The providers' plugins cannot be downloaded here, so no cloud stack can be previewed. The
mocks answer with the outputs the real providers return; their names are read from the
installed SDKs (`wire`), never typed from memory.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import warnings
from pathlib import Path

import dill
import pulumi
import pulumi_hcloud as hcloud
import pytest
import yaml
from pulumi import _types as ptypes

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # pulumi_aws.ec2 announces its own deprecated classes on import
    import pulumi_aws as aws

    aws.ec2.Instance, aws.route53.Record  # noqa: B018 - load the lazily imported submodules while the filter holds

from components import cloud, cloud_types, config, templates
from components.errors import Error
from components.fleet import Fleet, args_for
from tests.helpers import API_KEY, raw_config, ssh_key

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "198.51.100.7/32"
TOKEN = "hcloud-token-0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghij"
HCLOUD_IP, AWS_IP, AMI = "198.51.100.20", "198.51.100.30", "ami-0123456789abcdef0"


def wire(cls, attr: str) -> str:
    """The provider's own name of an SDK property (what the engine and the mocks carry)."""
    prop = getattr(cls, attr)
    assert isinstance(prop, property), f"{cls.__name__}.{attr} is not an SDK property"
    return getattr(prop.fget, ptypes._PULUMI_NAME)


# What the real providers return beyond the inputs, by resource type: (SDK class, {python name: value}).
OUTPUTS = {
    "hcloud:index/server:Server": (hcloud.Server, {"ipv4_address": HCLOUD_IP, "ipv6_address": "2001:db8::1",
                                                  "status": "running", "primary_disk_size": 600}),
    "hcloud:index/sshKey:SshKey": (hcloud.SshKey, {"fingerprint": "aa:bb"}),
    "hcloud:index/zoneRrset:ZoneRrset": (hcloud.ZoneRrset, {}),
    "aws:ec2/instance:Instance": (aws.ec2.Instance, {"public_ip": AWS_IP, "public_dns": "ec2-198-51-100-30.example",
                                                     "arn": "arn:aws:ec2:us-east-1:1:instance/i-1", "instance_state": "running"}),
    "aws:ec2/keyPair:KeyPair": (aws.ec2.KeyPair, {"key_name": "node-host-cloud-key-7a1b2c3", "key_pair_id": "key-0abc"}),
    "aws:ec2/securityGroup:SecurityGroup": (aws.ec2.SecurityGroup, {"arn": "arn:aws:ec2:us-east-1:1:security-group/sg-1"}),
    "aws:route53/record:Record": (aws.route53.Record, {"fqdn": "code.example.com"}),
}
INVOKES = {
    "aws:ec2/getAmi:getAmi": (aws.ec2.GetAmiResult, {"id": AMI, "image_id": AMI,
                                                    "name": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261006"}),
    "aws:route53/getZone:getZone": (aws.route53.GetZoneResult, {"id": "Z0123", "zone_id": "Z0123", "name": "example.com"}),
}
HCLOUD_IDS = iter(range(4000, 10**6))


class CloudMocks(pulumi.runtime.Mocks):
    """conftest's mocks (`base`), plus the cloud providers' computed outputs and invoke results."""

    def __init__(self, base: pulumi.runtime.Mocks):
        self.base = base
        self.calls: list[tuple[str, dict]] = []
        self.ids: dict[str, str] = {}

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        rid, outs = self.base.new_resource(args)
        if args.typ in OUTPUTS:
            cls, values = OUTPUTS[args.typ]
            outs.update({wire(cls, k): v for k, v in values.items()})
        if args.typ.startswith("hcloud:"):
            rid = str(next(HCLOUD_IDS))  # Hetzner ids are numbers (firewall_ids takes ints)
        self.ids[args.name] = rid
        return rid, outs

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append((args.token, dict(args.args)))
        if args.token in INVOKES:
            cls, values = INVOKES[args.token]
            return {wire(cls, k): v for k, v in values.items()}
        return self.base.call(args)


def cloud_stacks() -> dict[str, dict]:
    """Every stack file whose host.provider is a cloud, as its config mapping."""
    found = {}
    for path in sorted((ROOT / "stacks").glob("Pulumi.*.yaml")):
        values = yaml.safe_load(path.read_text()).get("config") or {}
        if (values.get("fimfleet:host") or {}).get("provider") in cloud_types.CLOUD_PROVIDERS:
            found[path.name[len("Pulumi."):-len(".yaml")]] = values
    return found


STACKS = cloud_stacks()


def stack_values(stack: str, ingress: dict | None = None, **host) -> dict[str, str]:
    """The stack file's config as Pulumi hands it over (JSON-encoded), plus throwaway secrets."""
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in STACKS[stack].items()}
    values["fimfleet:host"] = json.dumps({**STACKS[stack]["fimfleet:host"], **host})
    if ingress is not None:
        values["fimfleet:ingress"] = json.dumps(ingress)
    values.update({"fimfleet:sshPrivateKey": ssh_key(), "fimfleet:apiKeys": json.dumps({"alice": API_KEY})})
    return values


SECRET = frozenset({"fimfleet:sshPrivateKey", "fimfleet:apiKeys", "hcloud:token"})


def stack_config(stack: str, ingress: dict | None = None, **host) -> config.StackConfig:
    """Through the same path `pulumi up` takes (config.from_mapping), cloud token included."""
    return config.from_mapping({**stack_values(stack, ingress, **host), "hcloud:token": TOKEN}, SECRET)


def with_dns(stack: str) -> config.StackConfig:
    """The stack with ingress.domain in a zone on the same provider."""
    ingress = {**(STACKS[stack].get("fimfleet:ingress") or {}), "domain": "code.example.com"}
    return stack_config(stack, ingress, dnsZone="example.com")


@pytest.fixture
def mocks(recorder, monkeypatch):
    """Cloud-aware mocks on conftest's recorder; registrations also keep protect / retain / ignoreChanges / provider."""
    m = CloudMocks(recorder.mocks)
    monkeypatch.setattr(recorder, "mocks", m)
    original = recorder.RegisterResource

    def register(request):
        resp = original(request)
        recorder.registrations[-1].update(protect=request.protect, retain=request.retainOnDelete,
                                          ignore_changes=list(request.ignoreChanges),
                                          provider=request.provider.rsplit("::", 1)[0] if request.provider else "")
        return resp

    monkeypatch.setattr(recorder, "RegisterResource", register)
    m.recorder = recorder
    return m


def deploy(cfg: config.StackConfig, mocks: CloudMocks) -> tuple[dict, dict]:
    """Build one node under mocks; returns (registrations by name, resolved outputs)."""
    outputs = {}

    @pulumi.runtime.test
    def run():
        fleet = Fleet("fleet", args_for(cfg))
        return pulumi.Output.all(fleet.nodes["node"].endpoint, fleet.hosts["node"].host.address).apply(
            lambda a: outputs.update(endpoint=a[0], address=a[1]))

    run()
    return {r["name"]: r for r in mocks.recorder.registrations}, outputs


def unwrap(v):
    """An input as the program passed it (secret inputs arrive wrapped in Pulumi's secret signature)."""
    return v["value"] if isinstance(v, dict) and pulumi.runtime.rpc._special_sig_key in v else v


def by_type(regs: dict, typ: str) -> list[dict]:
    return [r for r in regs.values() if r["type"] == typ]


def one(regs: dict, typ: str) -> dict:
    found = by_type(regs, typ)
    assert len(found) == 1, (typ, [r["name"] for r in found])
    return found[0]


def closure(regs: dict, name: str) -> set[str]:
    """Every resource `name` depends on, directly or through others (what must exist first)."""
    name_of = {r["urn"]: n for n, r in regs.items()}
    seen, todo = set(), [name]
    while todo:
        r = regs[todo.pop()]
        for u in {*r["deps"], r.get("provider") or ""}:  # a resource also needs its provider
            n = name_of.get(u)
            if n and n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_a_cloud_stack_for_the_epyc_tier_and_every_gpu_tier():
    from components.tiers import TIERS

    tiers = {values["fimfleet:tier"] for values in STACKS.values()}
    assert "hcloud-epyc-prod" in STACKS and STACKS["hcloud-epyc-prod"]["fimfleet:tier"] == "cpu-epyc-prod"
    assert {t.name for t in TIERS.values() if t.device == "gpu"} <= tiers


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_stack_creates_its_instance(stack, mocks):
    cfg = stack_config(stack)
    regs, out = deploy(cfg, mocks)
    h = cfg.host
    if h.provider == "hcloud":
        key, fw = one(regs, "hcloud:index/sshKey:SshKey"), one(regs, "hcloud:index/firewall:Firewall")
        server = one(regs, "hcloud:index/server:Server")["inputs"]
        assert (server["serverType"], server["image"], server["location"]) == (h.instance_type, "debian-12", h.region)
        assert server["sshKeys"] == [mocks.ids[key["name"]]]
        assert server["firewallIds"] == [int(mocks.ids[fw["name"]])]
        assert key["inputs"]["publicKey"] == cloud_types.public_key(ssh_key())
        assert fw["type"] == "hcloud:index/firewall:Firewall"
    else:
        key = one(regs, "aws:ec2/keyPair:KeyPair")
        server_reg = one(regs, "aws:ec2/instance:Instance")
        server = server_reg["inputs"]
        assert (server["instanceType"], server["ami"]) == (h.instance_type, AMI)
        assert server["keyName"] == OUTPUTS["aws:ec2/keyPair:KeyPair"][1]["key_name"]
        assert server["vpcSecurityGroupIds"] == [one(regs, "aws:ec2/securityGroup:SecurityGroup")["name"] + "-id"]
        assert server["rootBlockDevice"]["deleteOnTermination"] is True
        assert server["metadataOptions"] == {"httpTokens": "required"}
        assert server_reg["ignore_changes"] == ["ami"], "a newer AMI release must not replace a serving instance"
        assert key["inputs"]["publicKey"] == cloud_types.public_key(ssh_key())
        provider = one(regs, "pulumi:providers:aws")
        assert provider["inputs"]["region"] == h.region == "us-east-1"
        assert all(r["provider"] == provider["urn"] for r in regs.values() if r["type"].startswith("aws:"))
        ami_call = [a for t, a in mocks.calls if t == "aws:ec2/getAmi:getAmi"]
        assert len(ami_call) == 1 and ami_call[0]["mostRecent"] is True
        assert ami_call[0]["owners"] == ["amazon"] and "Nvidia Driver GPU" in ami_call[0]["filters"][0]["values"][0]
        assert cfg.host.gpu_count >= 1
    assert "ssh_pwauth: false" in server["userData"] and "PasswordAuthentication no" in server["userData"]
    # The type's facts, not the tier's, describe the host that the sizing check and the preflight judge.
    t = cloud_types.TYPES[h.provider][h.instance_type]
    assert (h.cpus, h.memory_gib, h.gpu_count, h.gpu_memory_gib) == (t.vcpus, t.memory_gib, t.gpu_count, t.gpu_memory_gib)
    ip = HCLOUD_IP if h.provider == "hcloud" else AWS_IP
    assert out["address"] == ip
    assert out["endpoint"] == f"https://{cfg.ingress.domain or ip}"


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_firewall_lets_in_ingress_from_anywhere_and_ssh_from_admins_only(stack, mocks):
    cfg = stack_config(stack, adminCidrs=[ADMIN, "2001:db8:7::/48"])
    regs, _ = deploy(cfg, mocks)
    anywhere = {"0.0.0.0/0", "::/0"}
    want = {22: {ADMIN, "2001:db8:7::/48"}, cfg.ingress.https_port: anywhere, cfg.ingress.http_port: anywhere}
    if cfg.host.provider == "hcloud":
        rules = one(regs, "hcloud:index/firewall:Firewall")["inputs"]["rules"]
        assert all(r["direction"] == "in" and r["protocol"] == "tcp" for r in rules)
        got = {int(r["port"]): set(r["sourceIps"]) for r in rules}
    else:
        sg = one(regs, "aws:ec2/securityGroup:SecurityGroup")["inputs"]
        assert all(r["protocol"] == "tcp" and r["fromPort"] == r["toPort"] for r in sg["ingress"])
        got = {r["fromPort"]: set(r.get("cidrBlocks", [])) | set(r.get("ipv6CidrBlocks", [])) for r in sg["ingress"]}
        assert sg["egress"] == [{"protocol": "-1", "fromPort": 0, "toPort": 0, "cidrBlocks": ["0.0.0.0/0"],
                                 "ipv6CidrBlocks": ["::/0"]}]
    assert got == want  # nothing else gets in


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_ssh_key_and_cloud_token_stay_secret(stack, mocks):
    pulumi.runtime.set_config("hcloud:token", TOKEN)
    try:
        regs, _ = deploy(stack_config(stack), mocks)
    finally:
        pulumi.runtime.config.CONFIG.get().pop("hcloud:token", None)
    for name, r in regs.items():
        if "connection" in r["inputs"]:
            assert "connection" in r["secret_fields"], name
        plain = repr({k: v for k, v in r["inputs"].items() if k not in r["secret_fields"]})
        assert "PRIVATE KEY" not in plain, f"SSH private key in plain inputs of {name}"
        assert TOKEN not in repr(r["inputs"]), f"cloud token among the inputs of {name}"


def test_cloud_credentials_in_plain_text_are_refused_naming_the_key():
    values = {**stack_values("hcloud-epyc-prod"), "hcloud:token": TOKEN, "aws:secretKey": "x" * 40}
    with pytest.raises(config.ConfigError) as e:
        config.from_mapping(values, SECRET - {"hcloud:token"})
    text = str(e.value)
    assert "hcloud:token" in text and "aws:secretKey" in text and "--secret" in text
    assert TOKEN not in text


def test_the_stacks_aws_account_reaches_each_instances_provider_and_other_aws_keys_are_refused(mocks, monkeypatch):
    """An explicit provider reads no stack config: without passing them on, aws:profile and the
    keys were accepted and then silently replaced by whatever account the shell held."""
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    account = {"aws:profile": "prod-account", "aws:accessKey": "AKIAIOSFODNN7EXAMPLE", "aws:secretKey": secret,
               "aws:sharedCredentialsFiles": '["/home/ops/.aws/credentials"]'}
    cfg = config.from_mapping({**stack_values("aws-gpu-l40s"), **account}, SECRET | {"aws:secretKey"})
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps(account))  # where the engine hands a program its config
    regs, _ = deploy(cfg, mocks)
    provider = one(regs, "pulumi:providers:aws")
    got = {k: unwrap(provider["inputs"].get(k)) for k in ("profile", "accessKey", "secretKey", "sharedCredentialsFiles")}
    assert got == {"profile": "prod-account", "accessKey": "AKIAIOSFODNN7EXAMPLE", "secretKey": secret,
                   "sharedCredentialsFiles": '["/home/ops/.aws/credentials"]'}  # a provider's inputs go as JSON text
    assert {"secretKey", "accessKey"} <= provider["secret_fields"]
    for extra, fix in (({"aws:region": "eu-west-1"}, "fimfleet:host.region eu-west-1"),
                       ({"aws:skipMetadataApiCheck": "true"}, "take only aws:profile")):
        with pytest.raises(config.ConfigError) as e:
            config.from_mapping({**stack_values("aws-gpu-l40s"), **extra}, SECRET)
        assert [p.key for p in e.value.problems] == list(extra) and fix in e.value.problems[0].fix


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_host_connects_to_the_instance_address_after_it_exists(stack, mocks):
    cfg = stack_config(stack)
    regs, _ = deploy(cfg, mocks)
    server_type = "hcloud:index/server:Server" if cfg.host.provider == "hcloud" else "aws:ec2/instance:Instance"
    server = one(regs, server_type)["name"]
    ip = HCLOUD_IP if cfg.host.provider == "hcloud" else AWS_IP
    steps = [n for n, r in regs.items() if "connection" in r["inputs"]]
    assert {"node-host-identity", "node-host-cloud-init", "node-host-preflight", "node-host-packages"} <= set(steps)
    for n in steps:
        assert unwrap(regs[n]["inputs"]["connection"])["host"] == ip, n
        assert server in closure(regs, n), f"{n} could run before the instance exists"
    # sshd answering comes before the first contact; cloud-init before the preflight.
    assert regs["node-host-cloud-ssh"]["inputs"]["host"] == ip
    assert "node-host-cloud-ssh" in closure(regs, "node-host-identity")
    assert "node-host-cloud-init" in closure(regs, "node-host-preflight")
    assert "node-host-identity" in closure(regs, "node-host-cloud-init")


def test_hcloud_nodes_of_one_fleet_share_one_ssh_key_which_keeps_the_single_nodes_urn(mocks):
    """Hetzner refuses a second SSH key with the same fingerprint: a fleet uploads its key once
    and every server names it. The key is the one a one-node stack made under its instance
    before (an alias), so an `up` after the upgrade replaces neither the key nor the server."""
    values = {**stack_values("hcloud-epyc-prod"), "hcloud:token": TOKEN, "fimfleet:nodes": json.dumps({"a": {}, "b": {}})}
    cfg = config.from_mapping(values, SECRET)

    @pulumi.runtime.test
    def run():
        Fleet("fleet", args_for(cfg))

    run()
    regs = {r["name"]: r for r in mocks.recorder.registrations}
    key = one(regs, "hcloud:index/sshKey:SshKey")
    servers = by_type(regs, "hcloud:index/server:Server")
    assert len(servers) == 2 and all(s["inputs"]["sshKeys"] == [mocks.ids[key["name"]]] for s in servers)
    fleet = regs["fleet"]["urn"].rsplit("::", 1)[0]  # what the engine computes: the parent's type chain, then its own
    instance = f"{fleet}$fimfleet:host:HostBase$fimfleet:host:Host$fimfleet:cloud:HcloudInstance::a-host-cloud"
    assert [(a.spec.name, a.spec.parentUrn) for a in key["aliases"]] == [("a-host-cloud-key", instance)]


def test_an_image_the_user_sets_is_not_ignored_when_it_changes(mocks):
    """Only the looked-up AMI is kept at creation; host.image set in the stack is the user's to change."""
    cfg = stack_config("aws-gpu-l40s", image="ami-0fedcba9876543210")
    regs, _ = deploy(cfg, mocks)
    server = one(regs, "aws:ec2/instance:Instance")
    assert server["inputs"]["ami"] == "ami-0fedcba9876543210" and not server["ignore_changes"]
    assert not [a for t, a in mocks.calls if t == "aws:ec2/getAmi:getAmi"]


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_destroy_removes_everything_in_order(stack, mocks):
    """`pulumi destroy` deletes dependents first: every SSH step while the instance and its
    firewall still exist, then the instance, then its firewall and key. Nothing is kept."""
    cfg = with_dns(stack)
    regs, _ = deploy(cfg, mocks)
    custom = {n: r for n, r in regs.items() if not r["type"].startswith("fimfleet:")}
    cloud_res = {n for n, r in custom.items() if r["type"].split(":")[0] in cloud_types.CLOUD_PROVIDERS}
    assert all(not r["protect"] and not r["retain"] for r in custom.values())
    # Pulumi deletes a resource only after everything that depends on it is gone.
    order, left = [], dict(custom)
    while left:
        ready = sorted(n for n in left if not any(n in closure(regs, m) for m in left if m != n))
        assert ready, "dependency cycle"
        order += ready
        for n in ready:
            del left[n]
    server = next(n for n in cloud_res if regs[n]["type"] in ("hcloud:index/server:Server", "aws:ec2/instance:Instance"))
    pos = {n: i for i, n in enumerate(order)}
    for n, r in custom.items():
        if "connection" in r["inputs"]:
            assert pos[n] < pos[server], f"{n} would run its destroy after the instance is gone"
    for n in cloud_res - {server}:
        depends_on_server = server in closure(regs, n)
        assert (pos[n] < pos[server]) if depends_on_server else (pos[n] > pos[server]), n
    for n, r in custom.items():
        if r["type"].startswith("pulumi:providers:"):
            assert all(pos[n] > pos[m] for m in cloud_res), "the provider goes last"
    kinds = {regs[n]["type"].rsplit(":", 1)[-1] for n in cloud_res}
    assert kinds == ({"SshKey", "Firewall", "Server", "ZoneRrset"} if cfg.host.provider == "hcloud"
                     else {"KeyPair", "SecurityGroup", "Instance", "Record"})


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_dns_record_points_the_domain_at_the_instance(stack, mocks):
    cfg = with_dns(stack)
    regs, out = deploy(cfg, mocks)
    if cfg.host.provider == "hcloud":
        rec = one(regs, "hcloud:index/zoneRrset:ZoneRrset")["inputs"]
        assert (rec["zone"], rec["name"], rec["type"], rec["records"]) == ("example.com", "code", "A", [{"value": HCLOUD_IP}])
    else:
        rec = one(regs, "aws:route53/record:Record")["inputs"]
        assert (rec["zoneId"], rec["name"], rec["type"], rec["records"]) == ("Z0123", "code.example.com", "A", [AWS_IP])
        assert ("aws:route53/getZone:getZone", {"name": "example.com", "privateZone": False}) in mocks.calls
    assert out["endpoint"] == "https://code.example.com"


@pytest.mark.parametrize("host, key, fix", [
    ({"instanceType": "m7a.8xlarge"}, "host.instanceType", "has no GPU"),                 # GPU tier on a CPU type
    ({"provider": "hcloud", "instanceType": "ccx63"}, "host.instanceType", "has no GPU"),
    ({"instanceType": "g6e.2xlarge", "provider": "aws"}, "host.instanceType", "L40S GPUs; tier gpu-h100"),
    ({"instanceType": "p4d.24xlarge", "provider": "aws"}, "host.instanceType", "not a aws type fimfleet knows"),
    ({"instanceType": "p5.4xlarge", "provider": "aws", "gpuMemoryGiB": 160}, "host.gpuMemoryGiB", "comes from host.instanceType"),
    ({"provider": "aws", "adminCidrs": ["0.0.0.0/0"]}, "host.adminCidrs[0]", "whole internet"),
    ({"provider": "aws", "adminCidrs": []}, "host.adminCidrs", "networks allowed to SSH"),
    ({"provider": "aws", "adminCidrs": ["0.0.0.0/1", "128.0.0.0/1"]}, "host.adminCidrs", "cover 0.0.0.0/0"),
    ({"provider": "aws", "adminCidrs": ["198.51.100.7/32", "2000::/4", "3000::/4"]}, "host.adminCidrs", "cover ::/0"),
    ({"provider": "aws", "adminCidrs": ["2001:db8:1::/48", "2001:DB8:0001:0000::/48"]}, "host.adminCidrs[1]", "repeats [0]"),
    ({"provider": "aws", "adminCidrs": [22]}, "host.adminCidrs[0]", "CIDR string"),
    ({"provider": "hcloud", "user": "ubuntu"}, "host.user", "let root in"),
    ({"provider": "aws", "bastion": {"address": "203.0.113.5"}}, "host.bastion", "directly"),
    ({"provider": "aws", "address": "203.0.113.9"}, "host.address", "as nodes.node.address"),
    ({"provider": "aws", "image": "debian-12"}, "host.image", "AMI ID"),
    ({"provider": "hcloud", "instanceType": ""}, "host.instanceType", "no hcloud type fimfleet knows carries tier gpu-h100"),
    ({"provider": "aws", "dnsZone": "example.org"}, "host.dnsZone", "not inside this zone"),
])
def test_impossible_cloud_config_fails_validation_naming_the_key(host, key, fix):
    with pytest.raises(config.ConfigError) as e:
        config.from_mapping(stack_values("aws-gpu-h100", **host), SECRET)
    hits = [p for p in e.value.problems if p.key == key]
    assert hits and fix in hits[0].fix, [str(p) for p in e.value.problems]


def test_keys_that_cannot_apply_to_a_created_instance_are_refused():
    """Only root gets the stack's key (cloud-init), fimfleet waits for the instance's own sshd, and
    a test VM's state names another machine: each would fail after the instance exists."""
    raw, secret = raw_config(host={"provider": "hcloud", "adminCidrs": ["198.51.100.7/32"], "user": "ubuntu",
                                   "bastion": {"address": "203.0.113.5"}, "testbedState": "/tmp/x"})
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, secret)
    assert {p.key for p in e.value.problems} == {"host.user", "host.bastion", "host.testbedState"}, str(e.value)


def test_a_cpu_type_too_small_for_the_tier_or_the_model_fails():
    def problems(instance_type, **sections):
        raw, secret = raw_config("cpu-epyc-7b-int4", host={"provider": "hcloud", "instanceType": instance_type,
                                                            "adminCidrs": [ADMIN]}, **sections)
        try:
            config.parse(raw, secret)
            return {}
        except config.ConfigError as e:
            return {p.key: p.fix for p in e.problems}

    assert "ccx23 has 4 vCPUs; tier cpu-epyc-7b-int4 is sized (threads, SLA) for 8" in problems("ccx23")["host.instanceType"]
    assert problems("ccx63") == {}
    # The sizing check weighs the type's RAM and names the type: a 14B BF16 model does not fit a CCX33 (32 GB), it fits a CCX43.
    big = {"model": {"id": "Qwen/Qwen2.5-Coder-14B", "quantization": "bf16"}}
    assert "does not fit" in problems("ccx33", **big)["host.instanceType"]
    assert problems("ccx43", **big) == {}


def test_cloud_keys_on_an_existing_host_and_a_conflicting_kind_are_refused():
    raw, secret = raw_config(host={"address": "203.0.113.10", "instanceType": "ccx53", "kind": "local-vm",
                                   "provider": "ssh"})
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, secret)
    keys = {p.key for p in e.value.problems}
    assert {"host.instanceType", "host.kind"} <= keys


def test_host_kind_stays_an_alias_of_provider():
    raw, secret = raw_config(host={"address": "203.0.113.10", "kind": "ssh"})
    h = config.parse(raw, secret).host
    assert (h.provider, h.kind) == ("ssh", "ssh")
    raw, secret = raw_config(host={"provider": "hcloud", "adminCidrs": [ADMIN]})
    h = config.parse(raw, secret).host
    assert (h.provider, h.kind, h.instance_type, h.region) == ("hcloud", "hcloud", "ccx53", "fsn1")


def test_default_types_carry_their_tiers():
    from components.tiers import TIERS

    want = {("hcloud", "cpu-epyc-prod"): "ccx53", ("aws", "gpu-l40s"): "g6e.2xlarge", ("aws", "gpu-h100"): "p5.4xlarge"}
    for (provider, tier), name in want.items():
        assert cloud_types.default_type(provider, TIERS[tier]) == name
    for provider in cloud_types.CLOUD_PROVIDERS:
        for tier in TIERS.values():
            name = cloud_types.default_type(provider, tier)
            if name is None or tier.name == "local-vm":
                continue
            raw, secret = raw_config(tier.name, host={"provider": provider, "adminCidrs": [ADMIN]})
            assert config.parse(raw, secret).host.instance_type == name


def test_names_the_code_reads_exist_in_the_sdks():
    """cloud.py reads these outputs; the mocks above answer under the SDKs' own names for them."""
    reads = [(hcloud.Server, "ipv4_address"), (aws.ec2.Instance, "public_ip"), (aws.ec2.KeyPair, "key_name"),
             (aws.ec2.GetAmiResult, "id"), (aws.route53.GetZoneResult, "zone_id")]
    for cls, attr in reads:
        assert wire(cls, attr)
        assert attr in OUTPUTS.get(next((t for t, (c, _) in OUTPUTS.items() if c is cls), ""), (None, {}))[1] or \
            attr in INVOKES.get(next((t for t, (c, _) in INVOKES.items() if c is cls), ""), (None, {}))[1], attr
    assert (wire(hcloud.Server, "ipv4_address"), wire(aws.ec2.Instance, "public_ip")) == ("ipv4Address", "publicIp")


def test_public_key_is_derived_from_the_private_key():
    from cryptography.hazmat.primitives import serialization

    priv = serialization.load_ssh_private_key(ssh_key().encode(), None)
    want = priv.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    assert cloud_types.public_key(ssh_key()) == want and want.startswith("ssh-ed25519 ")


def test_wait_for_ssh_returns_when_the_port_answers_and_names_admin_cidrs_when_not():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        cloud.wait_for_ssh("127.0.0.1", srv.getsockname()[1], timeout_s=5)
        closed = srv.getsockname()[1]
    with pytest.raises(Error, match="host.adminCidrs"):
        cloud.wait_for_ssh("127.0.0.1", closed, timeout_s=0.5, poll_s=0.2)


def test_ssh_reachable_provider_pickles_and_waits_again_for_a_new_address():
    p = cloud.SshReachableProvider()
    clone = dill.loads(dill.dumps(p, recurse=True))
    assert type(clone).__name__ == "SshReachableProvider" and vars(clone) == {}
    old = {"host": "198.51.100.20", "port": 22, "timeoutS": 900}
    assert not p.diff("id", old, dict(old)).changes
    d = p.diff("id", old, {**old, "host": "198.51.100.21"})
    assert d.changes and d.replaces == ["host"]


@pytest.mark.parametrize("cloud_init_rc, sshd, ok", [
    (0, "passwordauthentication no\nkbdinteractiveauthentication no", True),
    (2, "passwordauthentication no\nkbdinteractiveauthentication no", True),   # recoverable warnings
    (1, "passwordauthentication no\nkbdinteractiveauthentication no", False),
    (0, "passwordauthentication yes\nkbdinteractiveauthentication no", False),
])
def test_cloud_init_step_waits_and_proves_password_login_is_off(tmp_path, cloud_init_rc, sshd, ok):
    for name, body in (("cloud-init", f'[ "$1" = status ] && [ "${{2:-}}" = --long ] && echo "status: x"; exit {cloud_init_rc}'),
                       ("sshd", f"printf '%s\\n' {sshd.splitlines()[0]!r} {sshd.splitlines()[1]!r} 'port 22'"),
                       ("hostname", "echo test-host")):
        f = tmp_path / name
        f.write_text(f"#!/bin/bash\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    script = "set -euo pipefail\n" + templates.render("cloud/boot-wait.sh.j2")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        assert "cloud-init" in proc.stderr or "passwordauthentication" in proc.stderr


def test_acme_on_a_cloud_host_opens_port_80_for_the_challenge_whatever_the_http_port():
    """Let's Encrypt's HTTP-01 challenge comes to port 80 only (certbot --standalone answers it
    there): with ingress.httpPort 8080 the firewall let in 443 and 8080, and no certificate came."""
    from components import cloud

    tls = {"tls": "acme", "domain": "code.example.com", "acmeEmail": "ops@example.com"}
    for ingress, want in (({**tls, "httpPort": 8080}, {443, 8080, 80}), (tls, {443, 80}),
                          ({"httpPort": 8080}, {443, 8080})):
        raw, secret = raw_config(host={"provider": "hcloud", "adminCidrs": [ADMIN]}, ingress=ingress)
        rules = cloud.ingress_rules(cloud.instance_args(config.parse(raw, secret)))
        assert {p for p, cidrs, _ in rules if cidrs == cloud.ANYWHERE} == want
        assert [p for p, _, _ in rules].count(80) <= 1
