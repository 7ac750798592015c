"""Stack config validation: every problem at once, each naming key, value and fix."""

import pytest

from components import config
from tests.helpers import raw_config


def parse(**sections):
    raw, secret = raw_config(**sections)
    return config.parse(raw, secret)


def problems_of(raw, secret=frozenset({"sshPrivateKey", "apiKeys"})):
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    return err.value.problems


def test_valid_config_takes_defaults_from_the_tier():
    cfg = parse()
    assert cfg.tier.name == "cpu-epyc-prod"
    assert cfg.model.id == "Qwen/Qwen2.5-Coder-7B"
    assert cfg.engine.kv_cache_gib == cfg.tier.kv_cache_gib
    assert cfg.host.cpus == cfg.tier.cpus
    assert cfg.sla.ttft_p99_ms == cfg.tier.sla["ttftP99Ms"]
    assert cfg.memory.fits


def test_stack_values_override_tier_defaults():
    cfg = parse(engine={"kvCacheGiB": 12, "maxNumSeqs": 4})
    assert (cfg.engine.kv_cache_gib, cfg.engine.max_num_seqs) == (12, 4)


# (raw-config change, expected key path, a word the fix must contain)
BAD = [
    ({"tier": "cpu-epyc-huge"}, "tier", "known tier"),
    ({"hots": {}}, "hots", "unknown key"),
    ({"host": {"address": "203.0.113.10", "adress": "x"}}, "host.adress", "unknown key"),
    ({"host": {"address": ""}}, "host.address", "VPS address"),
    ({"host": {"address": "not a host!"}}, "host.address", "IP address"),
    ({"host": {"address": "203.0.113.10", "port": 70000}}, "host.port", "between"),
    ({"host": {"address": "203.0.113.10", "kind": "k8s"}}, "host.kind", "one of"),
    ({"host": {"address": "203.0.113.10", "cpus": "many"}}, "host.cpus", "whole number"),
    ({"host": {"address": "203.0.113.10", "memoryGiB": 16}}, "host.memoryGiB", "does not fit"),
    ({"host": {"address": "203.0.113.10", "bastion": {"address": "198.51.100.1", "prot": 22}}}, "host.bastion.prot", "unknown key"),
    ({"model": {"quantization": "int3"}}, "model.quantization", "one of"),
    ({"model": {"quantization": "fp8"}}, "model.quantization", "not runnable"),
    ({"model": {"id": "Qwen/Qwen2.5-Coder-7B-Instruct"}}, "model.id", "unknown model"),
    ({"model": {"source": "local", "localPath": "/nonexistent/model"}}, "model.localPath", "config.json"),
    ({"engine": {"dtype": "float16"}}, "engine.dtype", "bfloat16"),
    ({"engine": {"threadsBind": "cores 0 to 3"}}, "engine.threadsBind", "CPU list"),
    ({"engine": {"maxModelLen": 65536}}, "engine.maxModelLen", "at most"),
    ({"engine": {"kvCacheGiB": 1, "maxModelLen": 32768}}, "engine.kvCacheGiB", "full-context"),
    ({"engine": {"extraArgs": ["-x"]}}, "engine.extraArgs", "--"),
    ({"engine": {"env": {"lower": "x"}}}, "engine.env.lower", "UPPER_CASE"),
    ({"runtime": {"kind": "podman"}}, "runtime.kind", "one of"),
    ({"runtime": {"vllmVersion": "latest"}}, "runtime.vllmVersion", "exact release"),
    ({"runtime": {"wheelhouseUrl": "ftp://x"}}, "runtime.wheelhouseUrl", "http"),
    ({"ingress": {"metricsAllowCidrs": ["10.0.0.0/33"]}}, "ingress.metricsAllowCidrs[0]", "CIDR"),
    ({"ingress": {"httpPort": 443}}, "ingress.httpPort", "differ"),
    ({"ingress": {"tls": "acme"}}, "ingress.domain", "DNS name"),
    ({"ingress": {"tls": "provided"}}, "tlsCert", "tlsKey"),
    ({"monitor": {"intervalS": 1}}, "monitor.intervalS", "between"),
    ({"monitor": {"failureTreshold": 3}}, "monitor.failureTreshold", "failureThreshold"),
    ({"sla": {"ttftP50Ms": 900, "ttftP95Ms": 500}}, "sla", "must not decrease"),
    ({"sla": {"samples": 0}}, "sla.samples", "between"),
    ({"kernel": {"sysctl": {"swappiness": 1}}}, "kernel.sysctl.swappiness", "sysctl name"),
    ({"apiKeys": {}}, "apiKeys", "at least one"),
    ({"apiKeys": {"alice": "short"}}, "apiKeys.alice", "24+"),
    ({"apiKeys": {"al ice": "x" * 32}}, "apiKeys.al ice", "identifiers"),
    ({"sshPrivateKey": "not a key"}, "sshPrivateKey", "PRIVATE KEY"),
]


@pytest.mark.parametrize("change,key,fix_word", BAD, ids=[b[1] for b in BAD])
def test_bad_config_names_key_value_and_fix(change, key, fix_word):
    raw, secret = raw_config()
    raw.update(change)
    problems = problems_of(raw, secret)
    match = [p for p in problems if p.key == key]
    assert match, f"no problem for {key}: {[str(p) for p in problems]}"
    assert fix_word.lower() in match[0].fix.lower(), str(match[0])
    assert str(match[0]).startswith(f"fimfleet:{key} = ")


def test_all_problems_are_reported_at_once():
    raw, secret = raw_config(host={"address": "203.0.113.10", "port": 0}, monitor={"intervalS": 1},
                             runtime={"kind": "podman"})
    keys = {p.key for p in problems_of(raw, secret)}
    assert {"host.port", "monitor.intervalS", "runtime.kind"} <= keys


def test_secret_set_in_plain_text_is_rejected_and_never_echoed():
    raw, _ = raw_config()
    problems = problems_of(raw, frozenset({"apiKeys"}))
    p = next(p for p in problems if p.key == "sshPrivateKey")
    assert "--secret" in p.fix
    assert "PRIVATE KEY" not in str(config.ConfigError(problems))


def test_api_key_values_never_appear_in_errors():
    raw, secret = raw_config(apiKeys={"alice": "short-but-secret"}, host={"address": ""})
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    assert "short-but-secret" not in str(err.value)


def test_gpu_tier_must_run_in_docker():
    raw, secret = raw_config("gpu-l40s", runtime={"kind": "systemd"})
    assert any(p.key == "runtime.kind" and "docker" in p.fix for p in problems_of(raw, secret))


@pytest.mark.parametrize("tier", sorted(t for t in config.TIERS if t != "local-vm"))
def test_every_tier_default_is_valid_and_fits(tier):
    cfg = parse(tier=tier)
    assert cfg.memory.fits, cfg.memory.explain()
