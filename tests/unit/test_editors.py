"""Editor outputs, the FIM format's one source, and the node's own probe key.

Every stack's Continue config.yaml is checked with Continue's own package
(@continuedev/config-yaml: its parser, schema and validator, tests/js/validate_config.mjs);
the resource tree under Pulumi mocks shows one output set per user key, and that the
monitor and the SLA gate hold fimfleet's probe key, so revoking a user changes nothing for them.
"""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path

import pulumi
import pytest
import yaml

from components import config, editors, grammar, keys, models
from components.ingress_render import _check_bearer
from tests.helpers import API_KEY, TINY_CONFIG, raw_config, set_path, ssh_key, vm_state_keys
from tests.js.continue_pkgs import node

ROOT = Path(__file__).resolve().parents[2]
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))
CA = "-----BEGIN CERTIFICATE-----\nMIIBfakeCAforTests\n-----END CERTIFICATE-----\n"
QWEN_ADDED = {"<|endoftext|>": True, "<|fim_prefix|>": False, "<|fim_middle|>": False, "<|fim_suffix|>": False,
              "<|fim_pad|>": False, "<|repo_name|>": False, "<|file_sep|>": False}
"""Qwen2.5-Coder's tokenizer_config.json marks only <|endoftext|> special among these."""


def model_dir(tmp_path: Path, chat: bool = False, fim: bool = True) -> Path:
    d = tmp_path / ("chat-model" if chat else "fim-model" if fim else "plain-model")
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    added = {str(8000 + i): {"content": t, "special": s} for i, (t, s) in enumerate(QWEN_ADDED.items()) if fim or s}
    tok = {"added_tokens_decoder": added, **({"chat_template": "{{ messages }}"} if chat else {})}
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return d


def stack_config(stack: str, tmp_path: Path, **overrides) -> config.StackConfig:
    """A stack file from stacks/ plus throwaway secrets (and a tiny model dir for the local stack)."""
    doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    raw = {k.split(":", 1)[1]: v for k, v in doc.items()}
    raw.update(sshPrivateKey=ssh_key(), apiKeys={"alice": API_KEY, "bob": API_KEY[::-1]})
    if (raw.get("host") or {}).get("kind") == "local-vm":
        for path, state in vm_state_keys(raw, str(tmp_path / "testbed")).items():
            set_path(raw, path, state)
        raw["model"]["localPath"] = str(model_dir(tmp_path))
    for dotted, value in overrides.items():
        set_path(raw, dotted, value)
    return config.parse(raw, frozenset({"sshPrivateKey", "apiKeys"}))


# ----------------------------------------------------------------------------- FIM format


def test_fim_format_is_one_source():
    f = models.QWEN_FIM
    assert f.prompt("a(", ")") == "<|fim_prefix|>a(<|fim_suffix|>)<|fim_middle|>"
    assert f.handlebars() == "<|fim_prefix|>{{{prefix}}}<|fim_suffix|>{{{suffix}}}<|fim_middle|>"
    assert 0 < len(f.stop) <= models.MAX_STOP_WORDS == 4
    with pytest.raises(ValueError, match="1-4 stop strings"):
        models.FimFormat("<p>", "<s>", "<m>", stop=("a", "b", "c", "d", "e"))
    body = json.loads(models.readiness_body(models.CATALOG["Qwen/Qwen2.5-Coder-7B"], "m"))
    assert body == {"model": "m", "prompt": f.prompt("def f(x):\n    return ", "\n"), "max_tokens": 1,
                    "temperature": 0, "stop": list(f.stop)}


def test_local_model_spec_reads_fim_and_chat_from_its_tokenizer(tmp_path):
    fim = models.load_local_spec("m", model_dir(tmp_path))
    assert fim.fim == models.QWEN_FIM and fim.chat is False
    chat = models.load_local_spec("m", model_dir(tmp_path, chat=True))
    assert chat.chat is True
    plain = models.load_local_spec("m", model_dir(tmp_path, fim=False))
    assert plain.fim is None
    assert "prompt" in json.loads(models.readiness_body(plain, "m")) and "stop" not in json.loads(models.readiness_body(plain, "m"))


# ----------------------------------------------------------------------------- Continue


def test_continue_config_content(tmp_path):
    cfg = stack_config("cpu-epyc-prod", tmp_path)
    a = editors.args_for(cfg)
    doc = yaml.safe_load(editors.continue_yaml(a, "https://code.example.com", API_KEY, CA))
    [m] = doc["models"]  # a base FIM model: autocomplete only, no chat/edit roles
    assert m["roles"] == ["autocomplete"]
    assert m["apiBase"] == "https://code.example.com/v1" and m["apiKey"] == API_KEY
    assert m["promptTemplates"]["autocomplete"] == models.QWEN_FIM.handlebars()
    opts = m["defaultCompletionOptions"]
    assert opts["stop"] == list(models.QWEN_FIM.stop) and m["maxStopWords"] == 4
    assert opts["maxTokens"] == cfg.sla.max_tokens and opts["contextLength"] == cfg.engine.max_model_len
    ac = m["autocompleteOptions"]
    assert ac["debounceDelay"] >= cfg.sla.ttft_p50_ms
    assert ac["maxPromptTokens"] + opts["maxTokens"] <= cfg.engine.max_model_len
    # long enough for a whole completion at the SLA's worst accepted speed
    assert ac["modelTimeout"] >= cfg.sla.ttft_p99_ms + cfg.sla.max_tokens * 1000 / cfg.sla.min_decode_tokens_per_s
    uri = m["requestOptions"]["caBundlePath"]
    assert uri.startswith("data:") and base64.b64decode(uri.split(",", 1)[1]).decode() == CA


def test_max_tokens_fit_a_small_context(tmp_path):
    # the SLA's 300 tokens fit the context beside the probe's prompts; an editor's prompts are longer
    cfg = stack_config("cpu-epyc-prod", tmp_path, **{"engine.maxModelLen": 512, "sla.maxTokens": 300})
    tokens, prompt = editors.completion_budget(editors.args_for(cfg))
    assert tokens + prompt <= 512 and tokens == 128


def test_acme_certificate_needs_no_ca_and_chat_appears_only_for_chat_models(tmp_path):
    cfg = stack_config("cpu-epyc-prod", tmp_path, **{"ingress.tls": "acme", "ingress.acmeEmail": "ops@example.com"})
    a = editors.args_for(cfg)
    doc = yaml.safe_load(editors.continue_yaml(a, "https://code.example.com", API_KEY, ""))
    assert "requestOptions" not in doc["models"][0]
    chatty = editors.EditorArgs(**{**a.__dict__, "chat": True})
    roles = [m["roles"] for m in yaml.safe_load(editors.continue_yaml(chatty, "https://x", API_KEY))["models"]]
    assert roles == [["autocomplete"], ["chat", "edit"]]


def every_generated_config(tmp_path) -> dict[str, str]:
    """Each stack's config.yaml as generated (private CA where the stack has one), plus a chat model variant."""
    out = {}
    for stack in STACKS:
        cfg = stack_config(stack, tmp_path / stack)
        out[stack] = editors.continue_yaml(editors.args_for(cfg), "https://203.0.113.10", API_KEY, CA)
    cfg = stack_config("cpu-epyc-prod", tmp_path / "acme", **{"ingress.tls": "acme", "ingress.acmeEmail": "ops@example.com"})
    out["acme+chat"] = editors.continue_yaml(editors.EditorArgs(**{**editors.args_for(cfg).__dict__, "chat": True}),
                                             "https://code.example.com", API_KEY, "")
    # A served name and a key that YAML 1.2 reads as numbers unless quoted (PyYAML writes 1.1, which does not)
    cfg = stack_config("cpu-epyc-prod", tmp_path / "numbers", **{"model.servedName": "1e5"})
    out["numberlike"] = editors.continue_yaml(editors.args_for(cfg), "https://203.0.113.10", "0o" + "1234567" * 4, CA)
    return out


def test_every_generated_config_passes_continues_own_validator(tmp_path):
    files = []
    for name, text in every_generated_config(tmp_path).items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        files.append(str(path))
    rc, results = node("validate_config.mjs", *files)
    bad = {Path(r["file"]).stem: r["problems"] for r in results if not r["ok"]}
    assert rc == 0 and not bad, bad
    assert len(results) == len(STACKS) + 2


def test_continues_validator_is_not_a_rubber_stamp(tmp_path):
    """Negative controls: a typo'd key, a wrong type and a missing field are all reported."""
    doc = yaml.safe_load(every_generated_config(tmp_path)["local"])
    m = doc["models"][0]
    cases = {"typo": {**doc, "models": [{**m, "autocompleteOption": {}}]},
             "type": {**doc, "models": [{**m, "maxStopWords": "four"}]},
             "missing": {**doc, "models": [{k: v for k, v in m.items() if k != "model"}]}}
    for name, bad in cases.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(bad))
    rc, results = node("validate_config.mjs", *(str(tmp_path / f"{n}.yaml") for n in cases))
    assert rc != 0 and not any(r["ok"] for r in results), results


# ----------------------------------------------------------------------------- Cursor


def test_cursor_notes_claim_only_what_works(tmp_path):
    base = editors.args_for(stack_config("cpu-epyc-prod", tmp_path))
    notes = editors.cursor_notes(base, "https://code.example.com")
    assert "Tab completion: not possible" in notes and "does not work" in notes and API_KEY not in notes
    public_chat = editors.EditorArgs(**{**base.__dict__, "chat": True, "public_https": True, "private_ca": False})
    assert "may work if the endpoint is public" in editors.cursor_notes(public_chat, "https://code.example.com")


# ----------------------------------------------------------------------------- the probe key


def test_probe_key_provider_makes_a_valid_key_once_and_again_on_rotate():
    p = keys.ProbeKeyProvider()
    first, second = p.create({"rotate": ""}), p.create({"rotate": ""})
    assert first.outs["key"] != second.outs["key"]
    assert grammar.api_key(first.outs["key"]) is None
    _check_bearer("probe", first.outs["key"], "the key")  # the ingress accepts it
    same = p.diff(first.id, first.outs, {"rotate": "", "key": None})
    assert same.changes is False
    rotated = p.diff(first.id, first.outs, {"rotate": "2025-01", "key": None})
    assert rotated.changes is True and rotated.replaces == ["rotate"]


def test_users_cannot_take_fimfleets_key_names():
    raw, secret = raw_config(apiKeys={"alice": API_KEY, keys.PROBE_KEY_NAME: API_KEY[::-1]})
    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    assert f"apiKeys.{keys.PROBE_KEY_NAME}" in str(err.value) and "reserved" in str(err.value)


def build_node(api_keys: dict):
    from components.fleet import Fleet, args_for

    raw, secret = raw_config(apiKeys=api_keys)
    return Fleet("fleet", args_for(config.parse(raw, secret))).nodes["node"]


def registered(recorder) -> dict:
    return {r["name"]: r for r in recorder.registrations}


def settled(node):
    return pulumi.Output.all(node.sla.id, node.monitor.step.id, node.ingress.step.id, node.endpoint)


@pulumi.runtime.test
def test_each_user_key_gets_its_own_secret_editor_outputs(recorder):
    node = build_node({"alice": API_KEY, "bob": API_KEY[::-1]})
    assert sorted(node.editor_configs) == ["alice", "bob"]
    assert all(sorted(o) == ["continueYaml", "cursorNotes"] for o in node.editor_configs.values())

    def check(args):
        alice_yaml, bob_yaml, *flags = args
        assert API_KEY in alice_yaml and API_KEY[::-1] not in alice_yaml
        assert API_KEY[::-1] in bob_yaml and API_KEY not in bob_yaml
        assert all(flags), "editor outputs must be secrets"

    async def is_secret(o):
        return await o.is_secret()

    outs = [o for v in node.editor_configs.values() for o in v.values()]
    return pulumi.Output.all(node.editor_configs["alice"]["continueYaml"], node.editor_configs["bob"]["continueYaml"],
                             *(pulumi.Output.from_input(is_secret(o)) for o in outs)).apply(check)


@pulumi.runtime.test
def test_monitor_and_sla_use_the_probe_key_and_the_ingress_accepts_it(recorder):
    node = build_node({"alice": API_KEY, "bob": API_KEY[::-1]})
    probe = "mock-node-probe-key-0123456789abcdefghijklmnop"  # tests/unit/conftest.py: the mocked ProbeKey output

    def check(_):
        regs = registered(recorder)
        assert regs["node-probe-key"]["type"] == "pulumi-python:dynamic:Resource"
        monitor_files = repr(regs["node-monitor-timer"]["inputs"]["files"])
        assert probe in monitor_files and API_KEY not in monitor_files and API_KEY[::-1] not in monitor_files
        sla_key = repr({k: v for k, v in regs["node-sla"]["inputs"].items() if k in ("api_key", "apiKey")})
        assert probe in sla_key and API_KEY not in sla_key
        nginx_files = repr(regs["node-ingress-nginx"]["inputs"]["files"])
        assert keys.PROBE_KEY_NAME in nginx_files and probe in nginx_files and API_KEY in nginx_files

    return settled(node).apply(check)


@pulumi.runtime.test
def test_engine_readiness_check_sends_the_models_fim_request(recorder):
    """The deployed start script's request is models.readiness_body for the stack's model, quoted once."""
    node = build_node({"alice": API_KEY})
    raw, secret = raw_config()
    cfg = config.parse(raw, secret)

    def check(_):
        script = registered(recorder)["node-runtime-service"]["inputs"]["apply"]
        line = next(ln for ln in script.splitlines() if ln.startswith("body="))
        assert shlex.split(line[len("body="):].split("  #")[0]) == [models.readiness_body(cfg.model_spec, node.model)]

    return settled(node).apply(check)


def monitor_inputs(recorder, api_keys):
    recorder.registrations.clear()
    node = build_node(api_keys)
    return settled(node).apply(lambda _: registered(recorder)["node-monitor-timer"]["inputs"])


@pulumi.runtime.test
def test_revoking_a_user_changes_nothing_for_the_monitor(recorder):
    both = monitor_inputs(recorder, {"alice": API_KEY, "bob": API_KEY[::-1]})
    return both.apply(lambda before: monitor_inputs(recorder, {"bob": API_KEY[::-1]}).apply(
        lambda after: _same(before, after)))


def _same(before, after):
    assert before == after
