"""Stack config validation: every problem at once, each naming key, value and fix."""

import json
from pathlib import Path

import pytest

from components import config, grammar, passphrase
from tests.helpers import API_KEY, TINY_CONFIG, parse, problems_of, raw_config, ssh_key


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
    ({"sla": {"minDecodeCeilingFraction": 1.5}}, "sla.minDecodeCeilingFraction", "fraction in (0, 1]"),
    ({"sla": {"minDecodeCeilingFraction": 0}}, "sla.minDecodeCeilingFraction", "fraction in (0, 1]"),
    ({"sla": {"minDecodeCeilingFraction": 0.7}, "runtime": {"kind": "docker"}}, "sla.minDecodeCeilingFraction",
     "runtime.kind systemd"),
    ({"sla": {"minDecodeCeilingFraction": 0.7, "maxTokens": 1}}, "sla.maxTokens", "second token"),
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
    ({"apiKeys": {"alice": "short"}}, "apiKeys.alice", "24-512"),
    ({"apiKeys": {"al ice": "x" * 32}}, "apiKeys.al ice", "identifiers"),
    ({"sshPrivateKey": "not a key"}, "sshPrivateKey", "PRIVATE KEY"),
    # Quoted numbers: one type error each, never a traceback from a later comparison.
    ({"engine": {"maxNumSeqs": "8"}}, "engine.maxNumSeqs", "whole number"),
    ({"engine": {"reservedCpus": "1"}}, "engine.reservedCpus", "whole number"),
    ({"engine": {"tensorParallelSize": "2"}}, "engine.tensorParallelSize", "whole number"),
    ({"engine": {"port": "8000"}}, "engine.port", "whole number"),
    ({"host": {"address": "203.0.113.10", "cpus": "8"}}, "host.cpus", "whole number"),
    ({"ingress": {"httpsPort": "443"}}, "ingress.httpsPort", "whole number"),
    ({"sla": {"ttftP50Ms": "400"}}, "sla.ttftP50Ms", "a number"),
    # Values with a grammar: URLs, spaces, host bits, the whole internet.
    ({"ingress": {"domain": "https://code.example.com"}}, "ingress.domain", "DNS name"),
    ({"ingress": {"domain": "code example.com"}}, "ingress.domain", "DNS name"),
    ({"ingress": {"metricsAllowCidrs": ["192.168.10.5/24"]}}, "ingress.metricsAllowCidrs[0]", "192.168.10.0/24"),
    ({"ingress": {"metricsAllowCidrs": ["0.0.0.0/0"]}}, "ingress.metricsAllowCidrs[0]", "whole internet"),
    ({"ingress": {"metricsAllowCidrs": ["10.0.0.0/8", "::/0"]}}, "ingress.metricsAllowCidrs[1]", "whole internet"),
    ({"ingress": {"metricsAllowCidrs": ["0.0.0.0/1", "128.0.0.0/1"]}}, "ingress.metricsAllowCidrs", "cover 0.0.0.0/0"),
    ({"ingress": {"metricsAllowCidrs": ["10.0.0.0/8", "10.0.0.0/8"]}}, "ingress.metricsAllowCidrs[1]", "repeats [0]"),
    # Silently accepted before.
    ({"host": {"address": "203.0.113.10", "gpuCount": 0}, "tier": "gpu-l40s"}, "host.gpuCount", "at least 1"),
    ({"host": {"address": "203.0.113.10", "gpuCount": 4}, "engine": {"tensorParallelSize": 3}, "tier": "gpu-l40s"},
     "engine.tensorParallelSize", "attention heads"),
    ({"kernel": {"sysctl": {"vm.swapiness": 1}}}, "kernel.sysctl.vm.swapiness", "no such sysctl"),
    ({"kernel": {"sysctl": {"kernel.sched_migration_cost_ns": 500000}}}, "kernel.sysctl.kernel.sched_migration_cost_ns", "no such sysctl"),
    ({"kernel": {"sysctl": {"vm.transparent_hugepage": "never"}}}, "kernel.sysctl.vm.transparent_hugepage", "not a sysctl"),
    # Each passed its grammar and failed later on the host (an adversarial review, 2026-12-07).
    ({"monitoring": {"alertmanagerWebhookUrl": "https://hooks.example.com/x\n"}}, "monitoring.alertmanagerWebhookUrl", "http"),
    ({"monitoring": {"alertmanagerWebhookUrl": "https://hooks.example.com/%zz"}}, "monitoring.alertmanagerWebhookUrl", "hex"),
    ({"monitoring": {"alertmanagerWebhookUrl": "https://{x}/a"}}, "monitoring.alertmanagerWebhookUrl", "http"),
    ({"ingress": {"clientMaxBodySize": "8589934592g"}}, "ingress.clientMaxBodySize", "larger than nginx"),
    ({"ingress": {"clientMaxBodySize": "99999999999999999999"}}, "ingress.clientMaxBodySize", "larger than nginx"),
    ({"ingress": {"clientMaxBodySize": "256k\n"}}, "ingress.clientMaxBodySize", "size"),
    ({"runtime": {"kind": "docker", "image": "vllm/vllm-openai-cpu:v0.32.0-\u00e9"}}, "runtime.image", "image reference"),
    ({"host": {"address": "203.0.113.10", "bastion": {"address": 3232235521}}}, "host.bastion.address", "IP address"),
    ({"host": {"address": "203.0.113.10", "bastion": {"address": True}}}, "host.bastion.address", "IP address"),
    ({"engine": {"threadsBind": "0-3\n"}}, "engine.threadsBind", "CPU list"),
    ({"ingress": {"tls": "acme", "domain": "Code.Example.com", "acmeEmail": "ops@example.com"}}, "ingress.domain",
     "code.example.com"),
    ({"ingress": {"domain": "code.example.com."}}, "ingress.domain", "trailing dot"),
    # One port, one listener on the host (a second review, 2026-12-07): sshd, the engine, nginx,
    # Prometheus, node_exporter and Alertmanager.
    ({"host": {"address": "203.0.113.10", "port": 443}}, "ingress.httpsPort", "sshd"),
    ({"ingress": {"httpsPort": 22}}, "ingress.httpsPort", "sshd"),
    ({"engine": {"port": 22}}, "engine.port", "between 1024"),
    ({"engine": {"port": 9090}}, "engine.port", "Prometheus"),
    ({"engine": {"port": 9100}}, "engine.port", "node_exporter"),
    ({"ingress": {"httpsPort": 9090}}, "ingress.httpsPort", "Prometheus"),
    ({"ingress": {"httpsPort": 9093}, "monitoring": {"alertmanagerWebhookUrl": "https://h.example.com/x"}},
     "ingress.httpsPort", "Alertmanager"),
    ({"engine": {"port": 1000}}, "engine.port", "between 1024"),
    ({"host": {"provider": "hcloud", "adminCidrs": ["198.51.100.7/32"]}, "ingress": {"httpsPort": 22}},
     "ingress.httpsPort", "sshd"),  # on a cloud host it also opened port 22 to the internet
    # every probe request would get vLLM's 400 (prompt + max_tokens over max_model_len): the gate reported a miss
    ({"engine": {"maxModelLen": 1024}, "sla": {"maxTokens": 4096}}, "sla.maxTokens", "engine.maxModelLen (1024)"),
    ({"engine": {"maxModelLen": 2048}, "sla": {"maxTokens": 2048}}, "sla.maxTokens", "at most"),
    ({"monitoring": {"scrapeIntervalS": 600}}, "monitoring.scrapeIntervalS", "two samples"),
    ({"monitoring": {"retention": "999999d"}}, "monitoring.retention", "106751d"),
    ({"host": {"address": "203.0.113.10", "cpuFlags": ["avx2", 1]}}, "host.cpuFlags[1]", "cpuinfo"),
    ({"host": {"address": "203.0.113.10", "cpuFlags": ["AVX512F"]}}, "host.cpuFlags[0]", "lower case"),
    ({"apiKeys": {"FIMFLEET_FLEET_PROBE": API_KEY}}, "apiKeys.FIMFLEET_FLEET_PROBE", "reserved"),
    ({"engine": {"threadsBind": "5-2"}}, "engine.threadsBind", "backwards"),
    ({"engine": {"threadsBind": "0-200"}}, "engine.threadsBind", "not on the host"),
    ({"tier": "cpu-epyc-prod", "engine": {"tensorParallelSize": 2}}, "engine.tensorParallelSize", "one engine process"),
    # read-only: `sysctl -p` fails on them on the host
    ({"kernel": {"sysctl": {"fs.file-nr": 1}}}, "kernel.sysctl.fs.file-nr", "read-only"),
    ({"kernel": {"sysctl": {"kernel.osrelease": "6.1"}}}, "kernel.sysctl.kernel.osrelease", "read-only"),
    ({"kernel": {"sysctl": {"kernel.random.uuid": "x"}}}, "kernel.sysctl.kernel.random.uuid", "read-only"),
    ({"kernel": {"sysctl": {"vm.swappiness": 1.5}}}, "kernel.sysctl.vm.swappiness", "whole number"),
    ({"host": {"address": "203.0.113.10", "bastion": {"address": "198.51.100.1", "port": "22x"}}}, "host.bastion.port", "between 1"),
    ({"host": {"address": "203.0.113.10", "bastion": {"address": "198.51.100.1", "user": "ops;id"}}}, "host.bastion.user", "user name"),
    ({"engine": {"port": 8443}, "ingress": {"httpsPort": 8443}}, "engine.port", "differ"),
    ({"engine": {"port": 8080}, "ingress": {"httpPort": 8080}}, "engine.port", "differ"),
    ({"sla": {"concurrency": 40}}, "sla.concurrency", "maxConnsPerAddress"),
    ({"engine": {"extraArgs": ["--disable-log-stats"]}}, "engine.extraArgs", "busy engine from a hung"),
    # fimfleet's own flags and environment: a second --host would win in vLLM's parser (a keyless engine on
    # every address), a second --max-model-len or VLLM_CPU_KVCACHE_SPACE would bypass the memory check
    ({"engine": {"extraArgs": ["--host", "0.0.0.0"]}}, "engine.extraArgs", "behind nginx"),
    ({"engine": {"extraArgs": ["--api-key=abc"]}}, "engine.extraArgs", "behind nginx"),
    ({"engine": {"extraArgs": ["--port", "9000"]}}, "engine.extraArgs", "engine.port"),
    ({"engine": {"extraArgs": ["--max-model-len=1000000"]}}, "engine.extraArgs", "engine.maxModelLen"),
    ({"engine": {"extraArgs": ["--served-model-name", "x"]}}, "engine.extraArgs", "model.servedName"),
    ({"engine": {"extraArgs": ["--no-enable-prefix-caching"]}}, "engine.extraArgs", "engine.enablePrefixCaching"),
    ({"engine": {"env": {"VLLM_CPU_KVCACHE_SPACE": "1000"}}}, "engine.env.VLLM_CPU_KVCACHE_SPACE", "engine.kvCacheGib"),
    ({"engine": {"env": {"LD_PRELOAD": "/tmp/x.so"}}}, "engine.env.LD_PRELOAD", "runtime.allocator"),
    ({"tier": "cpu-epyc-avx2-7b-int8", "model": {"quantization": "gptq-int4"}}, "model.quantization", "no INT4"),
    # The node's Prometheus (components/monitoring.py holds these rules; config applies them).
    ({"monitoring": {"retention": "15 days"}}, "monitoring.retention", "duration"),
    ({"monitoring": {"scrapeIntervalS": 0}}, "monitoring.scrapeIntervalS", "whole number"),
    ({"monitoring": {"scrapeIntervalS": "15"}}, "monitoring.scrapeIntervalS", "whole number"),
    ({"monitoring": {"alertmanagerWebhookUrl": "hooks.example.com/x"}}, "monitoring.alertmanagerWebhookUrl", "http"),
    ({"monitoring": {"enabled": "yes"}}, "monitoring.enabled", "true or false"),
    ({"apiKeys": {"alice": API_KEY, "bob": API_KEY}}, "apiKeys.bob", "a key of their own"),
    # `pulumi config set --path k 150.5` stores the text '150.5': the fix says how to store a number.
    ({"sla": {"ttftP50Ms": "150.5"}}, "sla.ttftP50Ms", "--type float"),
    ({"sla": {"samples": "40"}}, "sla.samples", "--type int"),
    ({"sla": {"samples": "forty"}}, "sla.samples", "whole number"),
    ({"monitoring": {"port": 9090}}, "monitoring.port", "unknown key"),
    # Misleading messages before.
    ({"engine": {"extraArgs": ["--device", "cpu"]}}, "engine.extraArgs", "removed"),
    ({"engine": {"extraArgs": ["--swap-space=4"]}}, "engine.extraArgs", "removed"),
    ({"engine": {"extraArgs": ["8", "--max-logprobs"]}}, "engine.extraArgs", "flag like"),
]

# Values that would run commands as root if pasted into a script (issue: shell injection).
HOSTILE = ["x; touch /tmp/pwned", "$(touch /tmp/pwned)", "`touch /tmp/pwned`", "x' || touch /tmp/pwned '",
           'x" && touch /tmp/pwned "', "x\ntouch /tmp/pwned", "a b"]
STRING_KEYS = [
    ({"model": {"servedName": None}}, "model.servedName"),
    ({"model": {"source": "local", "localPath": None}}, "model.localPath"),
    ({"model": {"revision": None}}, "model.revision"),
    ({"runtime": {"kind": "docker", "image": None}}, "runtime.image"),
    ({"runtime": {"venvPath": None}}, "runtime.venvPath"),
    ({"runtime": {"indexUrl": None}}, "runtime.indexUrl"),
    ({"ingress": {"tls": "acme", "domain": "code.example.com", "acmeEmail": None}}, "ingress.acmeEmail"),
    ({"ingress": {"domain": None}}, "ingress.domain"),
    ({"host": {"address": None}}, "host.address"),
    ({"host": {"address": "203.0.113.10", "user": None}}, "host.user"),
    ({"kernel": {"sysctl": {"vm.swappiness": None}}}, "kernel.sysctl.vm.swappiness"),
    ({"engine": {"env": {"FOO": None}}}, "engine.env.FOO"),
    ({"engine": {"extraArgs": ["--max-logprobs", None]}}, "engine.extraArgs"),
    ({"monitoring": {"alertmanagerWebhookUrl": None}}, "monitoring.alertmanagerWebhookUrl"),
    ({"monitoring": {"retention": None}}, "monitoring.retention"),
]


def _fill(obj, value):
    if isinstance(obj, dict):
        return {k: _fill(v, value) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, value) for v in obj]
    return value if obj is None else obj


# sysctl values are words separated by spaces ("4096 87380 16777216"), so "a b" is valid there.
HOSTILE_CASES = [(c, k, h) for c, k in STRING_KEYS for h in HOSTILE if not (k.startswith("kernel.sysctl") and h == "a b")]


@pytest.mark.parametrize("change,key,hostile", HOSTILE_CASES, ids=[f"{k}-{HOSTILE.index(h)}" for _, k, h in HOSTILE_CASES])
def test_hostile_values_are_refused_by_their_grammar(change, key, hostile):
    raw, secret = raw_config()
    raw.update(_fill(change, hostile.replace("\\n", "\n")))
    problems = problems_of(raw, secret)
    assert any(p.key == key for p in problems), [str(p) for p in problems]


def test_flag_and_value_as_two_items_is_accepted():
    cfg = parse(engine={"extraArgs": ["--max-logprobs", "8", "--enable-prompt-tokens-details", "--seed=1"]})
    assert list(cfg.engine.extra_args) == ["--max-logprobs", "8", "--enable-prompt-tokens-details", "--seed=1"]


def test_numbers_as_flag_values_reach_the_engine_as_strings():
    from components import engine
    cfg = parse(engine={"extraArgs": ["--max-logprobs", 8]})
    assert engine.render(cfg, "m").args[-2:] == ("--max-logprobs", "8")


def test_every_quoted_number_gives_one_error_and_no_traceback():
    raw, secret = raw_config(host={"address": "203.0.113.10", "cpus": "8", "memoryGiB": "64", "gpuCount": "1"},
                             engine={"maxNumSeqs": "8", "reservedCpus": "1", "maxModelLen": "8192",
                                     "maxNumBatchedTokens": "8192", "tensorParallelSize": "1", "port": "8000"},
                             ingress={"httpsPort": "443", "httpPort": "80"},
                             sla={"ttftP50Ms": "1", "ttftP95Ms": "2", "ttftP99Ms": "3"})
    keys = [p.key for p in problems_of(raw, secret)]
    assert len(keys) == len(set(keys)) == 14, keys


def test_valid_cidrs_and_sysctl_overrides_pass():
    cfg = parse(ingress={"metricsAllowCidrs": ["10.0.0.0/8", "2001:db8::/32"]},
                kernel={"sysctl": {"vm.swappiness": 10, "net.ipv4.tcp_rmem": "4096 87380 33554432"}})
    assert cfg.kernel.sysctl["vm.swappiness"] == 10


def test_the_nodes_own_prometheus_may_read_metrics_on_loopback_only_when_it_runs():
    from components import ingress, monitoring

    on = parse(ingress={"metricsAllowCidrs": ["10.0.0.0/8"]})
    spec = ingress.spec_for(ingress.args_for(on), "code.example.com", "/c", "/k")
    assert spec.metrics_allow_cidrs == ("10.0.0.0/8", "127.0.0.1/32", "::1/128")
    assert monitoring.args_for(on, "node").nodes[0].metrics_url == "https://127.0.0.1/metrics"
    off = parse(ingress={"metricsAllowCidrs": ["10.0.0.0/8"]}, monitoring={"enabled": False})
    assert ingress.spec_for(ingress.args_for(off), "code.example.com", "/c", "/k").metrics_allow_cidrs == ("10.0.0.0/8",)


def test_unknown_namespace_in_the_stack_file_is_an_error():
    values = {f"fimfleet:{k}": json.dumps(v) if not isinstance(v, str) else v for k, v in raw_config()[0].items()}
    values["fimflet:engine"] = json.dumps({"maxNumSeqs": 4})
    values["pulumi:tags"] = "{}"
    with pytest.raises(config.ConfigError) as err:
        config.from_mapping(values, frozenset({"fimfleet:sshPrivateKey", "fimfleet:apiKeys"}))
    assert [p.key for p in err.value.problems] == ["fimflet:engine"]
    assert "fimfleet:engine" in str(err.value) and "fimfleet:fimflet" not in str(err.value)
    del values["fimflet:engine"]
    assert config.from_mapping(values, frozenset({"fimfleet:sshPrivateKey", "fimfleet:apiKeys"})).engine.max_num_seqs


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


@pytest.mark.parametrize("where", ["sshKey", "registryPass", "host"])
def test_a_value_set_with_secret_is_never_echoed_whatever_its_key_is_called(where):
    """The engine says which keys are secrets: a mistyped `sshKey`, or a setting inside a secret
    map, hides its value (and a fix that quotes it) even though the key's name looks harmless."""
    raw, secret = raw_config()
    pem = ssh_key()
    if where == "host":
        raw["host"] = {**raw["host"], "sshKey": pem, "port": "hunter2-port"}
    else:
        raw[where] = pem
    text = str(problems_of(raw, secret | {where}) and config.ConfigError(problems_of(raw, secret | {where})))
    assert f"fimfleet:{where if where != 'host' else 'host.sshKey'} = <secret>" in text
    assert "PRIVATE KEY" not in text and "hunter2" not in text
    shown = str(config.ConfigError(problems_of(raw, secret)))  # the same keys not held as secrets
    assert "hunter2" in shown if where == "host" else "PRIVATE KEY" in shown


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


def test_published_passphrase_is_refused_for_real_stacks_only(tmp_path):
    env = {"PULUMI_CONFIG_PASSPHRASE": passphrase.LOCAL_PASSPHRASE}
    (tmp_path / "Pulumi.cpu-epyc-prod.yaml").write_text("config: {}\n")
    with pytest.raises(config.ConfigError, match="PULUMI_CONFIG_PASSPHRASE=<your own>"):
        passphrase.check_passphrase("cpu-epyc-prod", dry_run=False, environ=env, stack_dir=tmp_path)
    passphrase.check_passphrase("cpu-epyc-prod", dry_run=True, environ=env, stack_dir=tmp_path)  # previews decrypt only
    passphrase.check_passphrase("local", dry_run=False, environ=env, stack_dir=tmp_path)
    passphrase.check_passphrase("local-fleet", dry_run=False, environ=env, stack_dir=tmp_path)
    passphrase.check_passphrase("cpu-epyc-prod", dry_run=False, environ={"PULUMI_CONFIG_PASSPHRASE": "own"}, stack_dir=tmp_path)
    (tmp_path / "Pulumi.cpu-epyc-prod.yaml").write_text("secretsprovider: awskms://alias/fimfleet\nconfig: {}\n")
    passphrase.check_passphrase("cpu-epyc-prod", dry_run=False, environ=env, stack_dir=tmp_path)


def test_no_real_stack_file_carries_the_local_passphrase_salt():
    # The salt in a stack file binds it to one passphrase: a committed salt from the published one would
    # force every user of that stack onto it.
    for f in sorted((Path(__file__).resolve().parents[2] / "stacks").glob("Pulumi.*.yaml")):
        stack = f.name[len("Pulumi."):-len(".yaml")]
        if not passphrase.is_local_stack(stack):
            assert "encryptionsalt:" not in f.read_text(), f


def test_a_decode_limit_relative_to_the_ceiling_reaches_the_sla_gate():
    raw, secret = raw_config(sla={"minDecodeCeilingFraction": 0.7})
    cfg = config.parse(raw, secret)
    assert cfg.sla.min_decode_ceiling_fraction == 0.7
    from components.node import sla_thresholds

    assert sla_thresholds(cfg).min_decode_ceiling_fraction == 0.7


@pytest.mark.parametrize("runtime_cfg, password, plain, key, says", [
    ({"registryUser": "acme-bot"}, None, False, "registryPassword", "needs its password or token"),
    ({}, "tok-1234567890", False, "runtime.registryUser", "needs the user it belongs to"),
    ({"registryUser": "acme-bot"}, "tok-1234567890", True, "registryPassword", "store it as a secret"),
    ({"registryUser": "acme bot;id"}, "tok-1234567890", False, "runtime.registryUser", "must be a registry user name"),
])
def test_a_registry_login_is_a_user_plus_a_secret_password(runtime_cfg, password, plain, key, says):
    raw, secret = raw_config("gpu-l40s", runtime=runtime_cfg)
    if password is not None:
        raw["registryPassword"] = password
        secret = secret if plain else secret | {"registryPassword"}
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, secret)
    found = [p for p in e.value.problems if p.key == key]
    assert found and says in found[0].fix, e.value.problems
    assert password is None or password not in str(e.value)


def test_a_registry_login_is_for_the_docker_runtime_only():
    raw, secret = raw_config(runtime={"registryUser": "acme-bot"}, registryPassword="tok-1234567890")
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, secret | {"registryPassword"})
    assert [p.key for p in e.value.problems] == ["runtime.registryUser"], e.value.problems


def test_only_text_that_reads_as_the_number_is_told_about_type():
    assert "--type" not in grammar.wrong_type(int, "forty")
    assert "--type" not in grammar.wrong_type(int, "1.5")
    assert "--type" not in grammar.wrong_type(str, 3)
    assert "KEY 0.001 --type float`" in grammar.wrong_type(float, "0.001")


def test_a_null_value_is_the_default_as_a_missing_key_is():
    """`tls:` with nothing after it (YAML null) passed validation as None and failed later in
    the ingress with a KeyError traceback; it means "not set" now, for every key."""
    default = parse()
    cfg = parse(ingress={"tls": None}, sla={"samples": None}, engine={"maxNumSeqs": None})
    assert (cfg.ingress.tls, cfg.sla.samples, cfg.engine.max_num_seqs) == (
        default.ingress.tls, default.sla.samples, default.engine.max_num_seqs)
    assert cfg.ingress.tls == "self-signed"


@pytest.mark.parametrize("path", ["/.", "/./", "/usr/.", "/opt/./vllm", "/opt/../etc", "/opt/x/..", "//opt/x", "/opt//x",
                                  "/opt/x/", "/", "/usr", "/usr/local", "/etc", "/var/lib", "/home", "/opt", "/tmp/venv",
                                  "/proc/x", "/run/vllm", "/boot/v"])
def test_a_venv_path_whose_replace_or_destroy_would_reach_past_fimfleets_own_is_refused(path):
    """The install replaces runtime.venvPath and destroy deletes it (`/.` deleted the host's
    /etc, /usr... 4 levels down under the docker runtime, which installs no venv at all)."""
    for kind in ({}, {"kind": "docker", "image": "vllm/vllm-openai-cpu:v0.32.0"}):
        raw, secret = raw_config(runtime={"venvPath": path, **kind})
        assert [p.key for p in problems_of(raw, secret)] == ["runtime.venvPath"], path


@pytest.mark.parametrize("path", ["/opt/fimfleet/vllm", "/srv/vllm", "/home/deploy/venv", "/vllm", "/opt/a.b/c_d+e-f"])
def test_a_venv_path_of_its_own_is_accepted(path):
    assert parse(runtime={"venvPath": path}).runtime.venv_path == path


@pytest.mark.parametrize("url", ["https://hooks.slack.com/services/T000/B000/XXXX", "http://10.0.0.5:9095/hook",
                                 "https://chat.example.com/api/v1/hook?token=a%2Fb&room=ops"])
def test_webhook_urls_people_use_are_accepted(url):
    assert parse(monitoring={"alertmanagerWebhookUrl": url}).monitoring.alertmanager_webhook_url == url


@pytest.mark.parametrize("config_json, tokenizer_json", [
    ({**TINY_CONFIG, "num_attention_heads": 0}, None),      # was ZeroDivisionError
    ({**TINY_CONFIG, "hidden_size": "128"}, None),
    ({**TINY_CONFIG, "num_hidden_layers": True}, None),
    ([1, 2], None),                                          # was AttributeError
    ("not json {", None),
])
def test_a_local_model_directory_that_is_no_model_is_one_clear_error(tmp_path, config_json, tokenizer_json):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config_json if isinstance(config_json, str) else json.dumps(config_json))
    raw, secret = raw_config("local-vm", model={"source": "local", "localPath": str(d), "servedName": "m"})
    found = {p.key: p for p in problems_of(raw, secret)}
    assert "model.localPath" in found and "config.json" in found["model.localPath"].fix, found


@pytest.mark.parametrize("tokenizer", [{"added_tokens_decoder": [1, 2]}, [1], {"added_tokens_decoder": None}])
def test_a_tokenizer_config_of_another_shape_means_no_fim_tokens_not_a_traceback(tmp_path, tokenizer):
    from components import models

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY_CONFIG, "head_dim": None}))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    spec = models.load_local_spec("m", d)
    assert spec.fim is None and spec.head_dim == 64


def test_a_pinned_revision_reaches_the_engine_and_a_local_model_has_none():
    """model.revision was validated and then used nowhere: the engine loaded the branch's head."""
    from components import engine

    cfg = parse(model={"revision": "a1b2c3d"})
    args = engine.render(cfg, cfg.model.id).args
    assert args[args.index("--revision") + 1] == "a1b2c3d"
    assert "--revision" not in engine.render(parse(), "m").args
    raw, secret = raw_config("local-vm", model={"source": "local", "localPath": "/nonexistent/m", "revision": "main"})
    assert "model.revision" in {p.key for p in problems_of(raw, secret)}


def test_a_port_a_daemon_would_hold_is_free_when_that_daemon_is_off():
    assert parse(ingress={"httpsPort": 9093}).ingress.https_port == 9093  # no webhook: no Alertmanager
    assert parse(engine={"port": 9090}, monitoring={"enabled": False}).engine.port == 9090


def test_a_bad_scrape_interval_is_one_error_on_the_key_the_user_set():
    """evaluationIntervalS is derived from it: no second error on a key the stack does not have."""
    raw, secret = raw_config(monitoring={"scrapeIntervalS": 0})
    assert [p.key for p in problems_of(raw, secret)] == ["monitoring.scrapeIntervalS"]


@pytest.mark.parametrize("raw_extra", [
    {"sshPrivatekey": "-----BEGIN OPENSSH PRIVATE KEY-----\nLEAKED-1\n-----END OPENSSH PRIVATE KEY-----"},
    {"hftoken": "hf_LEAKED-2"},
    {"runtime": {"registryPassword": "LEAKED-3"}},
    {"host": {"address": "203.0.113.10", "privateKey": "LEAKED-4"}},
    {"monitoring": {"alertmanagerWebhookUrl": "https://hooks.example.com/x?token=LEAKED-5 "}},
])
def test_a_secret_under_a_mistyped_or_unknown_key_is_never_printed(raw_extra):
    """Pulumi hides a secret config value where it appears verbatim; json.dumps turned a PEM's
    newlines into \\n, so a mistyped sshPrivateKey printed whole in the error."""
    raw, secret = raw_config()
    raw.update(raw_extra)
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    assert "LEAKED" not in str(err.value) and "<secret>" in str(err.value), str(err.value)
    assert "sla.maxTokens = 99999" in str(config.Problem("sla.maxTokens", 99999, "x"))  # counts are no secrets


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_a_host_key_cut_when_pasted_is_refused_at_preview(tmp_path, kind):
    """A truncated key passed the line grammar and failed at first contact with a binascii traceback
    (building the 'changed' message); every key type whole is accepted, RSA by either name."""
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(tmp_path / "k")], check=True)
    line = " ".join((tmp_path / "k.pub").read_text().split()[:2])
    assert parse(host={"address": "203.0.113.10", "hostKey": line}).host.host_key == line
    if kind == "rsa":
        assert grammar.ssh_public_key("rsa-sha2-512 " + line.split()[1]) is None
    for cut in (1, 4, 12):
        raw, secret = raw_config(host={"address": "203.0.113.10", "hostKey": line[:-cut],
                                       "bastion": {"address": "198.51.100.1", "hostKey": line[:-cut]}})
        found = {p.key: p.fix for p in problems_of(raw, secret)}
        assert "cut" in found["host.hostKey"] and "cut" in found["host.bastion.hostKey"], found
    from components import ssh
    assert ssh.fingerprint(line[:-1]) == "(an unreadable key)"


def test_a_provided_certificate_is_certificates_only_and_its_key_is_the_leafs():
    """tlsCert becomes the clients' caPem (a plain output) and the monitor's CA file: a bundle that
    also held the private key exported it; a key of another certificate failed only in nginx."""
    from tests.helpers import provided_tls

    good = provided_tls()
    raw, secret = raw_config(ingress={"tls": "provided", "domain": "code.example.com"}, **good)
    assert config.parse(raw, secret | {"tlsCert", "tlsKey"}).ingress.tls == "provided"
    from components import tls

    stranger = tls.issue("other.example.com", ["other.example.com"], [])["keyPem"]
    for bad, key, word in (({**good, "tlsCert": good["tlsCert"] + good["tlsKey"]}, "tlsCert", "private key"),
                           ({**good, "tlsCert": "C"}, "tlsCert", "PEM certificates"),
                           ({**good, "tlsKey": "K"}, "tlsKey", "PEM"),
                           ({**good, "tlsKey": stranger}, "tlsKey", "not the key")):
        raw, secret = raw_config(ingress={"tls": "provided", "domain": "code.example.com"}, **bad)
        found = {p.key: p for p in problems_of(raw, secret | {"tlsCert", "tlsKey"})}
        assert word in found[key].fix and "BEGIN" not in str(found[key]), found


def test_an_ssh_key_fimfleet_cannot_use_is_refused_at_preview():
    """A passphrase-protected key passed the text check and failed only at `up`, on the host."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    locked = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.BestAvailableEncryption(b"passphrase")).decode()
    for key, word in ((locked, "passphrase"), ("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----",
                                                "not a usable"), ("ssh-ed25519 AAAA", "private key file")):
        raw, secret = raw_config(sshPrivateKey=key)
        found = {p.key: p for p in problems_of(raw, secret)}
        assert word in found["sshPrivateKey"].fix and "<secret>" in str(found["sshPrivateKey"]), found


def test_every_flag_and_variable_fimfleet_renders_is_one_extraArgs_and_env_may_not_repeat():
    """checks.FLAGS_FIMFLEET_SETS and ENV_FIMFLEET_SETS list what engine.render and runtime.render emit:
    a flag or variable added there and not here would let a stack override it again."""
    from components import checks, engine, runtime

    raw, secret = raw_config("gpu-h100", host={"address": "203.0.113.10", "gpuCount": 2}, model={"revision": "a1b2c3d"},
                             engine={"tensorParallelSize": 2, "kvCacheDtype": "fp8", "enforceEager": True},
                             hfToken="hf_" + "x" * 30)
    gpu = config.parse(raw, secret | {"hfToken"})
    for cfg in (gpu, parse(engine={"enablePrefixCaching": False, "enableChunkedPrefill": False})):
        launch = engine.render(cfg, "m")
        assert {a for a in launch.args if a.startswith("--")} <= set(checks.FLAGS_FIMFLEET_SETS)
        env = {line.split("=", 1)[0] for line in runtime.render(cfg, "node").env_file.splitlines() if "=" in line}
        assert env <= set(checks.ENV_FIMFLEET_SETS), env - set(checks.ENV_FIMFLEET_SETS)
