"""The CrossGuard pack (policy/): each rule on good and bad facts, the SSH rule on the cloud
firewall inputs it will see, and the whole pack driven in-process with the engine's own
protocol messages (which is also what guards the pinned SDK internals policy/server.py uses)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format, struct_pb2
from pulumi.runtime.proto import analyzer_pb2

from policy import rules
from policy.rules import SECRET_SIG, SECRET_SIG_KEY, StackFacts
from tests.helpers import API_KEY, ssh_key
from tests.unit import test_cloud as cloud
from tests.unit.test_cloud import mocks  # noqa: F401 - the fixture, for the cloud firewall test

ROOT = Path(__file__).resolve().parents[2]


def facts(stack="cpu-epyc-prod", secret=("fimfleet:sshPrivateKey", "fimfleet:apiKeys"), plain_in_file=(), **config):
    cfg = {"fimfleet:tier": "cpu-epyc-prod", "fimfleet:sshPrivateKey": ssh_key(), "fimfleet:apiKeys": {"alice": API_KEY}}
    cfg.update({k.replace("__", ":"): v for k, v in config.items()})
    return StackFacts(stack, cfg, frozenset(secret), frozenset(plain_in_file))


def secret(value):
    return {SECRET_SIG_KEY: SECRET_SIG, "value": value}


# --- secrets --------------------------------------------------------------------------

def test_credentials_in_plain_config_are_named_with_the_fix():
    assert rules.plaintext_credentials_in_config(facts()) == []
    msgs = rules.plaintext_credentials_in_config(facts(secret=("fimfleet:sshPrivateKey",), hcloud__token="t" * 64))
    assert len(msgs) == 2
    assert any(m.startswith("fimfleet:apiKeys is stored in plain text") and "--secret --path 'fimfleet:apiKeys.<name>'" in m
               for m in msgs)
    assert any(m.startswith("hcloud:token is stored in plain text") for m in msgs)


def test_one_plain_key_in_a_partly_secret_map_is_found_in_the_stack_file(tmp_path):
    (tmp_path / "Pulumi.yaml").write_text("name: x\nruntime: python\nstackConfigDir: stacks\n")
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "Pulumi.s-prod.yaml").write_text(
        "config:\n  fimfleet:tier: cpu-epyc-prod\n  fimfleet:apiKeys:\n    alice:\n      secure: v1:abc\n"
        "    bob: bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb\n  fimfleet:sshPrivateKey:\n    secure: v1:def\n")
    plain = rules.plain_values_in_stack_file(tmp_path, "s-prod")
    assert plain == {"fimfleet:apiKeys.bob"}
    msgs = rules.plaintext_credentials_in_config(facts(plain_in_file=plain))
    assert msgs == ["fimfleet:apiKeys.bob is stored in plain text in the stack config: store it as a secret "
                    "(pulumi config set --secret --path 'fimfleet:apiKeys.bob' <value>)."]
    assert rules.plain_values_in_stack_file(tmp_path, "missing") == frozenset()


def test_resource_inputs_must_carry_keys_inside_secrets():
    f = facts()
    good = {"connection": secret({"privateKey": ssh_key()}), "files": secret([{"content": f"KEY={API_KEY}"}]),
            "apply": "systemctl restart nginx"}
    assert rules.plaintext_credentials_in_inputs("node-ingress-nginx", good, f) == []
    bad = {"connection": {"host": "203.0.113.10", "privateKey": ssh_key()},
           "files": [{"path": "/etc/fimfleet/keys", "content": f"alice {API_KEY}\n"}]}
    msgs = rules.plaintext_credentials_in_inputs("node-ingress-nginx", bad, f)
    assert len(msgs) == 2
    assert "input connection.privateKey holds a private key in plain text: fimfleet:sshPrivateKey" in msgs[0]
    assert "input files[0].content holds the value of fimfleet:apiKeys.alice in plain text" in msgs[1]


@pytest.mark.parametrize("password", ["ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "Hunter2Hunter2"])
def test_a_registry_password_is_found_base64_encoded_and_short(password):
    """runtime.registry_login writes docker's config.json with auth = base64("user:password"); a password
    under MIN_SECRET_CHARS is still a secret key's value."""
    import base64
    import json as _json

    f = facts(secret=("fimfleet:sshPrivateKey", "fimfleet:apiKeys", "fimfleet:registryPassword"),
              fimfleet__registryPassword=password, fimfleet__runtime={"kind": "docker", "registryUser": "bot"})
    auth = base64.b64encode(f"bot:{password}".encode()).decode()
    for content in (_json.dumps({"auths": {"ghcr.io": {"auth": auth}}}, indent=1), f"/etc/x/{auth}",
                    f"PASSWORD={password}\n"):
        msgs = rules.plaintext_credentials_in_inputs("node-runtime-image", {"files": [{"content": content}]}, f)
        assert len(msgs) == 1 and "input files[0].content holds the value of fimfleet:registryPassword" in msgs[0]
    assert "base64-encoded" in rules.plaintext_credentials_in_inputs(
        "n", {"files": [{"content": auth}]}, f)[0]
    assert rules.plaintext_credentials_in_inputs("n", {"files": secret([{"content": auth}])}, f) == []
    if len(password) < rules.MIN_SECRET_CHARS:  # short: only as a whole word, only for a key known to be secret
        assert rules.plaintext_credentials_in_inputs("n", {"apply": f"echo x{password}y"}, f) == []
        other = facts(other__password=password)
        assert rules.plaintext_credentials_in_inputs("n", {"apply": f"PASSWORD={password}"}, other) == []


# --- TLS, /metrics --------------------------------------------------------------------

@pytest.mark.parametrize("stack,ingress,blocked", [
    ("cpu-epyc-prod", None, True),
    ("cpu-epyc-prod", {"tls": "self-signed"}, True),
    ("cpu-epyc-prod", {"allowSelfSigned": False}, True),
    ("cpu-epyc-prod", {"allowSelfSigned": True}, False),
    ("cpu-epyc-prod", {"tls": "acme", "domain": "a.example.com", "acmeEmail": "o@example.com"}, False),
    ("gpu-h100", {"tls": "provided"}, False),
    ("local", None, False),
    ("local-fleet", None, False),
])
def test_self_signed_tls_needs_an_explicit_override_outside_local_stacks(stack, ingress, blocked):
    f = facts(stack, fimfleet__ingress=ingress) if ingress is not None else facts(stack)
    msgs = rules.self_signed_tls(f)
    assert bool(msgs) == blocked
    if blocked:
        assert "fimfleet:ingress.tls" in msgs[0] and "fimfleet:ingress.allowSelfSigned" in msgs[0]


@pytest.mark.parametrize("cidrs,world", [
    (["10.0.0.0/8", "192.168.0.0/16"], []),
    (["0.0.0.0/0"], ["0.0.0.0/0"]),
    (["10.0.0.0/8", "::/0"], ["0.0.0.0/0", "::/0"]),  # ::/0 holds the IPv4-mapped range too
    (["0.0.0.0/1", "128.0.0.0/1"], ["0.0.0.0/0"]),
    (["1.2.3.4/0"], ["0.0.0.0/0"]),
    (["::ffff:0:0/96"], ["0.0.0.0/0"]),
    (["::ffff:0.0.0.0/97", "128.0.0.0/1"], ["0.0.0.0/0"]),
    (["all"], ["0.0.0.0/0"]),
    (["2001:db8::/32", "not-a-cidr"], []),
    (["2000::/3", None, 5], ["::/0"]),  # every global IPv6 address, as the config check (grammar.world_open) reads it
])
def test_world_open_sees_every_spelling_of_everywhere(cidrs, world):
    assert rules.world_open(cidrs) == world


def test_metrics_cidrs_are_checked_wherever_the_config_holds_them():
    assert rules.metrics_open_to_world(facts(fimfleet__ingress={"metricsAllowCidrs": ["10.0.0.0/8"]})) == []
    msgs = rules.metrics_open_to_world(facts(fimfleet__ingress={"metricsAllowCidrs": ["10.0.0.0/8", "::/0"]},
                                             fimfleet__nodes={"b": {"ingress": {"metricsAllowCidrs": ["0.0.0.0/0"]}}}))
    assert [m.split(" = ")[0] for m in msgs] == ["fimfleet:ingress.metricsAllowCidrs",
                                                 "fimfleet:nodes.b.ingress.metricsAllowCidrs"]


# --- SLA gate -------------------------------------------------------------------------

TIER = {"ttft_p50_ms": 400.0, "ttft_p95_ms": 800.0, "ttft_p99_ms": 1200.0, "min_decode_tokens_per_s": 12.0,
        "max_errors": 0}


def test_sla_gate_holds_prod_stacks_to_their_tier():
    assert rules.tier_limits("cpu-epyc-prod") == TIER
    assert rules.sla_gate(facts(), [("node-sla", TIER)], nodes=1) == []
    stricter = dict(TIER, ttft_p95_ms=500.0, min_decode_tokens_per_s=20.0)
    assert rules.sla_gate(facts(), [("node-sla", stricter)], nodes=1) == []
    looser = dict(TIER, ttft_p99_ms=2400.0, min_decode_tokens_per_s=1.0, max_errors=3)
    msgs = rules.sla_gate(facts(), [("node-sla", looser)], nodes=1)
    assert [m.split(" = ")[0] for m in msgs] == ["node-sla: fimfleet:sla.ttftP99Ms", "node-sla: fimfleet:sla.minDecodeTokensPerS",
                                                 "node-sla: fimfleet:sla.maxErrors"]
    missing = {k: v for k, v in TIER.items() if k != "ttft_p50_ms"}
    assert "fimfleet:sla.ttftP50Ms = no limit" in rules.sla_gate(facts(), [("node-sla", missing)], nodes=1)[0]


def test_sla_gate_must_exist_for_every_prod_node_only():
    msgs = rules.sla_gate(facts(fimfleet__sla={"enabled": False}), [], nodes=1)
    assert msgs and "set fimfleet:sla.enabled to true" in msgs[0]
    assert rules.sla_gate(facts(), [("a-sla", TIER)], nodes=2)
    assert rules.sla_gate(facts("cpu-epyc-7b-int8"), [], nodes=1) == []


NO_MAX_ERRORS = {k: v for k, v in TIER.items() if k != "max_errors"}


@pytest.mark.parametrize("thresholds", [
    {k: str(v) for k, v in TIER.items()},  # numbers as text: the provider reads "400" as 400
    dict(NO_MAX_ERRORS, max_error_rate=0.0),  # a rate of 0 allows no error, as max_errors 0 does
    dict(TIER, max_error_rate=1.0),  # max_errors 0 still applies
    dict(TIER, max_errors=5, max_error_rate=0),
    dict(TIER, min_decode_ceiling_fraction=0.7),  # a limit the tier does not set is only stricter
])
def test_sla_gate_passes_thresholds_the_provider_reads_as_the_tiers(thresholds):
    assert rules.sla_gate(facts(), [("node-sla", thresholds)], nodes=1) == []


@pytest.mark.parametrize("thresholds,first,fix", [
    ({"ttft_p50_ms": "90000", "ttft_p95_ms": "90000", "ttft_p99_ms": "90000", "min_decode_tokens_per_s": "12",
      "max_errors": "1000"}, "node-sla: fimfleet:sla.ttftP50Ms = 90000 is looser", "to at most 400."),
    (dict(TIER, max_errors="3"), "node-sla: fimfleet:sla.maxErrors = 3 is looser", "to at most 0."),
    (dict(NO_MAX_ERRORS, max_error_rate=1.0), "node-sla: max_error_rate = 1 without max_errors is looser",
     "set fimfleet:sla.maxErrors to at most 0 and leave max_error_rate out"),
    (dict(TIER, ttft_p99_ms="slow"), 'node-sla: threshold ttft_p99_ms = "slow" cannot be read',
     "set fimfleet:sla.ttftP99Ms to a number."),
    (dict(TIER, max_errors=1.5), "node-sla: threshold max_errors = 1.5 cannot be read",
     "set fimfleet:sla.maxErrors to a number."),
    (dict(TIER, min_decode_tokens_per_s="NaN"), 'node-sla: threshold min_decode_tokens_per_s = "NaN" cannot be read',
     "set fimfleet:sla.minDecodeTokensPerS to a number."),
    (dict(TIER, max_error_rate=[]), "node-sla: threshold max_error_rate = [] cannot be read",
     "leave max_error_rate out"),
    (dict(TIER, ttft_p50_ms=900.0), "node-sla: the SLA provider refuses the thresholds", "must not decrease"),
    ("fast", 'node-sla: input thresholds = "fast" is not a map', "under fimfleet:sla."),
])
def test_sla_gate_reads_thresholds_as_the_provider_does(thresholds, first, fix):
    """components/sla/thresholds.py's SlaThresholds.from_dict and judged_limits, as FimSlaCheck applies them:
    text is read as numbers, max_error_rate is an error limit, and what it refuses is named."""
    msgs = rules.sla_gate(facts(), [("node-sla", thresholds)], nodes=1)
    assert msgs[0].startswith(first) and fix in msgs[0]


# --- SSH on provisioned instances -----------------------------------------------------

ADMIN = {"fimfleet__host": {"provider": "hcloud", "adminCidrs": ["198.51.100.7/32", "2001:db8:1::/48"]}}


HC, DO = "hcloud:index/firewall:Firewall", "digitalocean:index/firewall:Firewall"
SG = "aws:ec2/securityGroup:SecurityGroup"


def hcloud_rule(port, sources, protocol="tcp"):
    return {"direction": "in", "protocol": protocol, "port": port, "sourceIps": sources}


def do_rule(ports, sources, protocol="tcp"):
    return {"protocol": protocol, "portRange": ports, "sourceAddresses": sources}


def aws_rule(protocol, lo, hi, cidrs):
    return {"protocol": protocol, "fromPort": lo, "toPort": hi, "cidrBlocks": cidrs}


@pytest.mark.parametrize("rtype,props,bad", [
    ("hcloud:index/firewall:Firewall", {"rules": [hcloud_rule("22", ["198.51.100.7/32"]),
                                                  hcloud_rule("443", ["0.0.0.0/0", "::/0"])]}, []),
    ("hcloud:index/firewall:Firewall", {"rules": [hcloud_rule("22", ["0.0.0.0/0", "::/0"])]}, ["0.0.0.0/0", "::/0"]),
    ("hcloud:index/firewall:Firewall", {"rules": [hcloud_rule("any", ["198.51.100.0/24"])]}, ["198.51.100.0/24"]),
    ("hcloud:index/firewall:Firewall", {"rules": [hcloud_rule("20-30", ["2001:db8:1:2::/64"])]}, []),
    ("hcloud:index/firewall:Firewall", {"rules": [hcloud_rule("22", ["0.0.0.0/0"], "udp")]}, []),
    ("hcloud:index/firewall:Firewall", {"rules": [dict(hcloud_rule("22", None), direction="out",
                                                       destinationIps=["0.0.0.0/0"])]}, []),
    ("aws:ec2/securityGroup:SecurityGroup", {"ingress": [
        {"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["198.51.100.7/32"]},
        {"protocol": "tcp", "fromPort": 443, "toPort": 443, "cidrBlocks": ["0.0.0.0/0"]}]}, []),
    ("aws:ec2/securityGroup:SecurityGroup", {"ingress": [
        {"protocol": "-1", "fromPort": 0, "toPort": 0, "ipv6CidrBlocks": ["::/0"]}]}, ["::/0"]),
    ("aws:ec2/securityGroupRule:SecurityGroupRule", {"type": "ingress", "protocol": "6", "fromPort": 0,
                                                     "toPort": 1024, "cidrBlocks": ["203.0.113.0/24"]}, ["203.0.113.0/24"]),
    ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22,
                                                                   "cidrIpv4": "0.0.0.0/0"}, ["0.0.0.0/0"]),
    ("digitalocean:index/firewall:Firewall", {"inboundRules": [
        {"protocol": "tcp", "portRange": "all", "sourceAddresses": ["0.0.0.0/0"]}]}, ["0.0.0.0/0"]),
    ("fimfleet:node:InferenceNode", {"rules": [hcloud_rule("22", ["0.0.0.0/0"])]}, []),
    # numbers as the wire carries them (every JSON number is a float), names in any case
    (HC, {"rules": [hcloud_rule(22, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (HC, {"rules": [hcloud_rule(22.0, ["0.0.0.0/0"]), hcloud_rule(443.0, ["::/0"])]}, ["0.0.0.0/0"]),
    (HC, {"rules": [hcloud_rule("22.0", ["0.0.0.0/0"], "TCP")]}, ["0.0.0.0/0"]),
    (HC, {"rules": [hcloud_rule("22", "0.0.0.0/0")]}, ["0.0.0.0/0"]),  # one CIDR, not a list
    (DO, {"inboundRules": [do_rule(22, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (DO, {"inboundRules": [do_rule("0", ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),  # the DO API's "all ports"
    (DO, {"inboundRules": [do_rule("ALL", ["::/0"]), do_rule(443.0, ["0.0.0.0/0"])]}, ["::/0"]),
    (SG, {"ingress": [aws_rule(-1, 0, 0, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule(-1.0, 0, 0, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule("-1.0", 0, 0, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule("ALL", 0, 0, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule(6, 22, 22, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule("6.0", "22", 22.0, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule("Tcp", 22, None, ["0.0.0.0/0"])]}, ["0.0.0.0/0"]),
    (SG, {"ingress": [aws_rule(17, 22, 22, ["0.0.0.0/0"]), aws_rule(6, 443, 443, ["0.0.0.0/0"])]}, []),
    ("aws:ec2/defaultSecurityGroup:DefaultSecurityGroup", {"ingress": [aws_rule("tcp", 22, 22, ["0.0.0.0/0"])]},
     ["0.0.0.0/0"]),
    ("aws:ec2/securityGroupRule:SecurityGroupRule", dict(aws_rule(-1, 0, 0, ["0.0.0.0/0"]), type="INGRESS"),
     ["0.0.0.0/0"]),
    ("aws:ec2/securityGroupRule:SecurityGroupRule", dict(aws_rule(-1, 0, 0, ["0.0.0.0/0"]), type="egress"), []),
    ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", {"ipProtocol": -1.0, "cidrIpv6": "::/0"}, ["::/0"]),
])
def test_ssh_opens_only_to_admin_cidrs(rtype, props, bad):
    msgs = rules.ssh_beyond_admin_cidrs(facts(**ADMIN), "fw", rtype, props)
    assert [m.split("is open to ")[1].split(",")[0] for m in msgs] == bad
    assert all("fimfleet:host.adminCidrs" in m for m in msgs)


@pytest.mark.parametrize("stack", sorted(cloud.STACKS))
def test_ssh_rule_on_the_firewalls_fimfleet_provisions(stack, mocks):
    """components/cloud.py's real firewall inputs (under Pulumi mocks): the stack's own adminCidrs pass,
    and the same firewall judged against other admin networks is blocked, rule by rule."""
    regs, _ = cloud.deploy(cloud.stack_config(stack), mocks)
    firewalls = [r for r in regs.values() if rules.ingress_rules(r["type"], r["inputs"]) is not None]
    assert firewalls, f"{stack} provisions no firewall the SSH policy knows"
    own = StackFacts.from_engine(stack, cloud.stack_values(stack), cloud.SECRET)
    other = StackFacts.from_engine(stack, cloud.stack_values(stack, adminCidrs=["192.0.2.0/24"]), cloud.SECRET)
    for r in firewalls:
        assert rules.ssh_beyond_admin_cidrs(own, r["name"], r["type"], r["inputs"]) == []
        blocked = rules.ssh_beyond_admin_cidrs(other, r["name"], r["type"], r["inputs"])
        assert blocked and all('fimfleet:host.adminCidrs = ["192.0.2.0/24"]' in m for m in blocked)


@pytest.mark.parametrize("rtype,props,field", [
    (HC, {"rules": [hcloud_rule("ssh", ["198.51.100.7/32"])]}, 'rules[0].port = "ssh"'),
    (HC, {"rules": [hcloud_rule(22.5, ["0.0.0.0/0"])]}, "rules[0].port = 22.5"),
    (HC, {"rules": [hcloud_rule("20-x", ["0.0.0.0/0"])]}, 'rules[0].port = "20-x"'),
    (HC, {"rules": [None]}, "rules[0] = null"),
    (HC, {"rules": "0.0.0.0/0"}, 'rules = "0.0.0.0/0"'),
    (HC, {"rules": [hcloud_rule("22", ["0.0.0.0/0"], None)]}, "rules[0].protocol = null"),
    (HC, {"rules": [hcloud_rule("22", ["0.0.0.0/0"], "ssh")]}, 'rules[0].protocol = "ssh"'),
    (SG, {"ingress": [aws_rule(600.0, 22, 22, ["0.0.0.0/0"])]}, "ingress[0].protocol = 600.0"),
    (HC, {"rules": [hcloud_rule("22", {"a": 1})]}, 'rules[0].sourceIps = {"a": 1}'),
    (HC, {"rules": [hcloud_rule("22", ["198.51.100.7/32", None])]}, "rules[0].sourceIps[1] = null"),
    (DO, {"inboundRules": [do_rule(True, ["0.0.0.0/0"])]}, "inboundRules[0].portRange = true"),
    (SG, {"ingress": [aws_rule("tcp", "x", 22, ["0.0.0.0/0"])]}, 'ingress[0].fromPort = "x"'),
    (SG, {"ingress": [aws_rule({}, 22, 22, ["0.0.0.0/0"])]}, "ingress[0].protocol = {}"),
    ("aws:ec2/securityGroupRule:SecurityGroupRule", dict(aws_rule("tcp", 22, "y", []), type="ingress"), 'toPort = "y"'),
    ("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
     {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv4": 1.5}, "cidrIpv4 = 1.5"),
])
def test_ssh_rule_names_what_it_cannot_read(rtype, props, field):
    """Fail closed, with the input, its value and the fix: never a traceback that fails the whole analysis."""
    msgs = rules.ssh_beyond_admin_cidrs(facts(**ADMIN), "fw", rtype, props)
    assert len(msgs) == 1 and msgs[0].startswith(f"fw: input {field} cannot be read, so it may open SSH") \
        and ": give " in msgs[0]


@pytest.mark.parametrize("admin,world", [
    (["0.0.0.0/1", "128.0.0.0/1"], ["0.0.0.0/0"]),
    (["::/1", "8000::/1"], ["0.0.0.0/0", "::/0"]),  # ::/1 holds the IPv4-mapped range
    (["2000::/3"], ["::/0"]),  # every global IPv6 address
    (["2001:db8::/32", "198.51.100.0/24"], []),
])
def test_ssh_open_to_the_whole_internet_in_pieces_is_open_to_the_world(admin, world):
    """adminCidrs that cover the internet between them (config refuses only 0.0.0.0/0 itself) leave SSH open
    to everyone, whether one rule or several open 22 to them."""
    f = facts(fimfleet__host={"adminCidrs": admin})
    for props in ({"rules": [hcloud_rule("22", admin)]}, {"rules": [hcloud_rule("22", [c]) for c in admin]}):
        msgs = rules.ssh_beyond_admin_cidrs(f, "fw", HC, props)
        assert [m.split("is open to ")[1].split(",")[0] for m in msgs] == world
        assert all("the whole internet" in m and "fimfleet:host.adminCidrs" in m for m in msgs)


def test_ssh_without_admin_cidrs_is_open_to_nobody():
    msgs = rules.ssh_beyond_admin_cidrs(facts(), "fw", "hcloud:index/firewall:Firewall",
                                        {"rules": [hcloud_rule("22", ["198.51.100.7/32"])]})
    assert len(msgs) == 1 and "fimfleet:host.adminCidrs = []" in msgs[0]


def test_prod_hardening_is_advice_for_prod_only():
    full = ["fimfleet:node:InferenceNode", "fimfleet:kernel:KernelTuning", "fimfleet:monitor:Monitor"]
    assert [m.split(": ")[-1].split(" under ")[-1] for m in rules.prod_hardening(facts(), ["fimfleet:node:InferenceNode"], 1)] \
        == ["fimfleet:kernel.", "fimfleet:monitor.", "fimfleet:nodes."]
    assert rules.prod_hardening(facts(), full + full, 2) == []
    assert rules.prod_hardening(facts("gpu-h100"), [], 1) == []


@pytest.mark.parametrize("stack,config", [("x-PROD", {}), ("local-prod", {}), ("Local-Prod", {}),
                                          ("x-prod", {"fimfleet__tier": "local-vm"}),
                                          ("x-prod", {"fimfleet__host": {"kind": "local-vm"}})])
def test_a_prod_stack_in_any_case_gets_the_prod_rules_even_when_local(stack, config):
    """The local exemption (self-signed TLS) never outranks prod (the SLA gate, hardening)."""
    f = facts(stack, **config)
    assert f.is_prod and not f.is_local
    assert rules.sla_gate(f, [], nodes=1) and rules.prod_hardening(f, [], 1) and rules.self_signed_tls(f)
    assert facts("local-fleet").is_local and not facts("local-fleet").is_prod


# --- every stack in stacks/, statically -----------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "stacks").glob("Pulumi.*.yaml")), ids=lambda p: p.stem[7:])
def test_every_stack_file_passes_the_config_policies(path):
    import yaml

    stack = path.stem[len("Pulumi."):]
    config = yaml.safe_load(path.read_text())["config"]
    f = StackFacts(stack, config, frozenset(), rules.plain_values_in_stack_file(ROOT, stack))
    assert rules.self_signed_tls(f) == [] and rules.metrics_open_to_world(f) == []
    assert rules.plaintext_credentials_in_config(f) == []


# --- the pack in-process, through the engine protocol ---------------------------------

def _struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    json_format.ParseDict(d, s)
    return s


@pytest.fixture()
def pack():
    import policy.__main__ as main

    return main.make_servicer(main.NAME, main.POLICIES, "test")


def _violations(resp) -> list[tuple[str, str, int]]:
    return [(d.policyName, d.message, d.enforcementLevel) for d in resp.diagnostics]


def test_the_pack_judges_engine_messages(pack):
    import json as _json

    config = {"fimfleet:tier": "cpu-epyc-prod", "fimfleet:apiKeys": _json.dumps({"alice": API_KEY}),
              "fimfleet:sshPrivateKey": ssh_key(), "fimfleet:host": _json.dumps({"adminCidrs": ["198.51.100.7/32"]}),
              "fimfleet:ingress": _json.dumps({"metricsAllowCidrs": ["::/0"]})}
    pack.ConfigureStack(analyzer_pb2.AnalyzerStackConfigureRequest(
        stack="cpu-epyc-prod", project="fimfleet", config=config, config_secret_keys=["fimfleet:sshPrivateKey"]), None)

    stack_urn = "urn:pulumi:cpu-epyc-prod::fimfleet::pulumi:pulumi:Stack::fimfleet-cpu-epyc-prod"
    got = _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
        urn=stack_urn, type="pulumi:pulumi:Stack", name="fimfleet-cpu-epyc-prod", properties=_struct({})), None))
    mandatory = analyzer_pb2.MANDATORY
    assert {(n, lvl) for n, _, lvl in got} == {("credentials-are-secret", mandatory), ("metrics-not-public", mandatory),
                                              ("no-self-signed-tls-outside-local", mandatory)}

    step = "urn:pulumi:cpu-epyc-prod::fimfleet::pulumi-python:dynamic:Resource::node-ingress-nginx"
    leaky = {"connection": secret({"privateKey": ssh_key()}), "files": [{"content": f"alice {API_KEY}"}]}
    got = _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
        urn=step, type="pulumi-python:dynamic:Resource", name="node-ingress-nginx", properties=_struct(leaky)), None))
    assert [(n, "files[0].content" in m) for n, m, _ in got] == [("credentials-are-secret", True)]
    sealed = dict(leaky, files=secret(leaky["files"]))
    assert _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
        urn=step, type="pulumi-python:dynamic:Resource", name="node-ingress-nginx", properties=_struct(sealed)), None)) == []

    fw = {"rules": [hcloud_rule("22", ["0.0.0.0/0"])]}
    got = _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
        urn="urn:pulumi:cpu-epyc-prod::fimfleet::hcloud:index/firewall:Firewall::fw",
        type="hcloud:index/firewall:Firewall", name="fw", properties=_struct(fw)), None))
    assert [(n, lvl) for n, _, lvl in got] == [("ssh-only-from-admin-cidrs", mandatory)]


def test_the_pack_judges_the_whole_stack(pack):
    pack.ConfigureStack(analyzer_pb2.AnalyzerStackConfigureRequest(
        stack="cpu-epyc-prod", config={"fimfleet:tier": "cpu-epyc-prod"}), None)
    base = "urn:pulumi:cpu-epyc-prod::fimfleet::"
    resources = [analyzer_pb2.AnalyzerResource(urn=base + "fimfleet:node:InferenceNode::node", name="node",
                                               type="fimfleet:node:InferenceNode", properties=_struct({})),
                 analyzer_pb2.AnalyzerResource(
                     urn=base + "pulumi-python:dynamic/fimfleet:FimSlaCheck::node-sla", name="node-sla",
                     type="pulumi-python:dynamic/fimfleet:FimSlaCheck",
                     properties=_struct({"thresholds": dict(TIER, ttft_p50_ms=700.0)}))]
    got = _violations(pack.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=resources), None))
    assert [(n, lvl) for n, _, lvl in got] == [("sla-gate-on-prod", analyzer_pb2.MANDATORY)] + \
        [("prod-hardening", analyzer_pb2.ADVISORY)] * 3
    assert "fimfleet:sla.ttftP50Ms = 700 is looser than the cpu-epyc-prod tier's 400" in got[0][1]


ODD = [None, True, -1, 1.5, 22.0, 1e308, "", "x", "22", "NaN", [], {}, [None], {"a": None}, ["0.0.0.0/0", None]]
FIREWALLS = {  # type -> (list input or None for a one-rule resource, a rule that opens 22 to the world)
    HC: ("rules", hcloud_rule("22", ["0.0.0.0/0"])),
    DO: ("inboundRules", do_rule("22", ["0.0.0.0/0"])),
    SG: ("ingress", aws_rule("tcp", 22, 22, ["0.0.0.0/0"])),
    "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup": ("ingress", aws_rule("tcp", 22, 22, ["0.0.0.0/0"])),
    "aws:ec2/securityGroupRule:SecurityGroupRule": (None, dict(aws_rule("tcp", 22, 22, ["0.0.0.0/0"]), type="ingress")),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
        (None, {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv4": "0.0.0.0/0"}),
}


def _odd_firewalls():
    for rtype, (field, rule) in FIREWALLS.items():
        for odd in ODD:
            for key in rule:
                changed = dict(rule, **{key: odd})
                yield rtype, {field: [changed]} if field else changed
            if field:
                yield rtype, {field: odd}
                yield rtype, {field: [odd]}


def test_the_pack_judges_odd_firewall_inputs_without_a_traceback(pack):
    """Every firewall shape with each input swapped for an odd value, through the engine protocol (the SDK
    hands rules over as read-only proxies): each gets a message from the rule itself, never an exception
    nor the fail-closed fallback."""
    pack.ConfigureStack(analyzer_pb2.AnalyzerStackConfigureRequest(
        stack="x-prod", config={"fimfleet:tier": "cpu-epyc-prod",
                                "fimfleet:host": '{"adminCidrs": ["198.51.100.7/32"]}'}), None)
    cases = 0
    for rtype, props in _odd_firewalls():
        got = _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
            urn=f"urn:pulumi:x-prod::fimfleet::{rtype}::fw", type=rtype, name="fw", properties=_struct(props)), None))
        for policy_name, message, _ in got:
            assert policy_name == "ssh-only-from-admin-cidrs" and "could not judge" not in message, (rtype, props)
            assert "fimfleet:host.adminCidrs" in message or "cannot be read" in message, message
            assert " object at 0x" not in message, message  # values shown as JSON, not as the SDK's proxies
        cases += 1
    assert cases > 400
    for odd in ODD:
        sla_type = "pulumi-python:dynamic/fimfleet:FimSlaCheck"
        sla = analyzer_pb2.AnalyzerResource(urn=f"urn:pulumi:x-prod::fimfleet::{sla_type}::s", name="s", type=sla_type,
                                            properties=_struct({"thresholds": odd}))
        got = _violations(pack.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=[sla]), None))
        assert all("could not judge" not in m for _, m, _ in got) and any(n == "sla-gate-on-prod" for n, _, _ in got)


def test_a_rule_that_raises_blocks_instead_of_failing_the_analysis(pack, monkeypatch):
    """The fail-closed fallback: a mandatory violation naming the policy and the line, not the exception text
    (it may quote an input)."""
    def broken(*_):
        raise ValueError(f"bad {API_KEY}")

    monkeypatch.setattr(rules, "ssh_beyond_admin_cidrs", broken)
    pack.ConfigureStack(analyzer_pb2.AnalyzerStackConfigureRequest(stack="x-prod", config={}), None)
    got = _violations(pack.Analyze(analyzer_pb2.AnalyzeRequest(
        urn="urn:pulumi:x-prod::fimfleet::hcloud:index/firewall:Firewall::fw", type=HC, name="fw",
        properties=_struct({"rules": []})), None))
    assert [(n, lvl) for n, _, lvl in got] == [("ssh-only-from-admin-cidrs", analyzer_pb2.MANDATORY)]
    assert "fw: the ssh-only-from-admin-cidrs policy could not judge it (ValueError at test_policy_pack.py:" \
        in got[0][1]
    assert API_KEY not in got[0][1]
