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


# --- SSH on provisioned instances -----------------------------------------------------

ADMIN = {"fimfleet__host": {"provider": "hcloud", "adminCidrs": ["198.51.100.7/32", "2001:db8:1::/48"]}}


def hcloud_rule(port, sources, protocol="tcp"):
    return {"direction": "in", "protocol": protocol, "port": port, "sourceIps": sources}


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
                     properties=_struct({"thresholds": dict(TIER, ttft_p50_ms=900.0)}))]
    got = _violations(pack.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=resources), None))
    assert [(n, lvl) for n, _, lvl in got] == [("sla-gate-on-prod", analyzer_pb2.MANDATORY)] + \
        [("prod-hardening", analyzer_pb2.ADVISORY)] * 3
    assert "fimfleet:sla.ttftP50Ms = 900 is looser than the cpu-epyc-prod tier's 400" in got[0][1]
