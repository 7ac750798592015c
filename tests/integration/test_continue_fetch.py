"""A generated Continue config.yaml, used by Continue's own HTTP layer, through real nginx TLS
in front of real vLLM (issue 18 item 3).

tests/js/continue_fim.mjs reads the config with Continue's parser, renders its autocomplete
template with Handlebars, builds the request as Continue's OpenAI provider does (stop words
sliced to maxStopWords, max_tokens from the config) and sends it with @continuedev/fetch,
which trusts the CA from `requestOptions.caBundlePath` (here a data: URI). The key is a
user's named key, checked by nginx. Without the CA the same request must fail TLS.
"""

from __future__ import annotations

import json

import pytest
import yaml

from components import config, editors, models
from tests.helpers import raw_config
from tests.integration.conftest import API_KEY, SERVED
from tests.integration.nginx_harness import vllm_behind_nginx
from tests.js.continue_pkgs import node

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

USER_KEY = "sk-fimfleet-continue-user-0123456789"
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"
TLS_FAILURES = {"SELF_SIGNED_CERT_IN_CHAIN", "UNABLE_TO_VERIFY_LEAF_SIGNATURE", "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
                "DEPTH_ZERO_SELF_SIGNED_CERT"}


@pytest.fixture(scope="module")
def ingress(vllm_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("continue-ingress")
    with vllm_behind_nginx(root, vllm_server, {"alice": USER_KEY}, API_KEY) as ing:
        yield ing


@pytest.fixture(scope="module")
def editor_args(tiny_model, tmp_path_factory):
    """The local stack's editor args, with the tiny model the engine serves (FIM format read from it)."""
    state = tmp_path_factory.mktemp("testbed")
    raw, secret = raw_config(tier="local-vm", host={"kind": "local-vm", "testbedState": str(state)},
                             model={"source": "local", "localPath": str(tiny_model), "servedName": SERVED},
                             apiKeys={"alice": USER_KEY})
    a = editors.args_for(config.parse(raw, secret))
    assert a.model == SERVED and a.fim == models.QWEN_FIM and a.private_ca
    return a


def continue_run(ingress, editor_args, name: str, extra_body: dict, *flags: str) -> dict:
    """Write alice's generated config.yaml (plus Continue's extraBodyProperties) and run one request."""
    doc = yaml.safe_load(editors.continue_yaml(editor_args, ingress["endpoint"], USER_KEY, ingress["ca"]))
    doc["models"][0].setdefault("requestOptions", {})["extraBodyProperties"] = extra_body
    path = ingress["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    _, out = node("continue_fim.mjs", str(path), PREFIX, SUFFIX, *flags)
    return out


def test_continue_streams_a_fim_completion_with_the_generated_config(ingress, editor_args):
    max_tokens = editors.completion_budget(editor_args)[0]
    # include_usage only lets the test count tokens (vLLM's chunks may merge); Continue passes it through.
    out = continue_run(ingress, editor_args, "plain", {"stream_options": {"include_usage": True}})
    assert out["ok"], out
    assert out["request"]["url"] == ingress["endpoint"] + "/v1/completions"
    assert out["request"]["prompt"] == models.QWEN_FIM.prompt(PREFIX, SUFFIX)
    assert out["request"]["stop"] == list(models.QWEN_FIM.stop)  # Continue's own stops were cut by maxStopWords
    assert out["request"]["max_tokens"] == max_tokens
    assert out["text"] and out["chunks"] >= 1
    assert out["finishReason"] == "length" and out["usage"]["completion_tokens"] == max_tokens
    print(f"\nContinue fetch through nginx: {out['chunks']} chunks, {json.dumps(out['text'])}")


def test_continue_request_stops_at_a_fim_stop_word(ingress, editor_args, tiny_model):
    """The random model is pushed to emit <|file_sep|> first; the config's stop words end the stream there."""
    file_sep = json.loads((tiny_model / "fimfleet-tiny.json").read_text())["special_token_ids"]["<|file_sep|>"]
    out = continue_run(ingress, editor_args, "stop",
                       {"stream_options": {"include_usage": True}, "logit_bias": {str(file_sep): 100}})
    assert out["ok"], out
    assert out["finishReason"] == "stop" and out["text"] == "" and out["usage"]["completion_tokens"] == 1, out


def test_without_the_ca_continue_fails_tls(ingress, editor_args):
    out = continue_run(ingress, editor_args, "no-ca", {}, "--no-ca")
    assert not out["ok"] and out.get("code") in TLS_FAILURES, out
    assert "certificate" in out["error"].lower(), out
    print(f"\nwithout the CA: {out['code']}: {out['error']}")
