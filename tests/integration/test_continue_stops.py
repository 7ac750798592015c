"""The FIM stop strings fire on a real vLLM engine, as they do for Qwen2.5-Coder (issue 18 item 4).

vLLM detokenizes with skip_special_tokens=True, so a stop string made of a token the
tokenizer marks `special` never appears in the text and never fires: generation runs to
max_tokens. Qwen2.5-Coder marks only <|endoftext|> (its EOS) special, and the tiny model
is built the same way (toolchain/tinymodel/make_tiny_model.py). `logit_bias` makes the
random model emit a chosen token first, so each stop is exercised on purpose; the same
request without `stop` is the control.
"""

from __future__ import annotations

import json

import httpx
import pytest

from components import models
from tests.integration.conftest import API_KEY, SERVED

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

FIM = models.QWEN_FIM
MAX_TOKENS = 6
REAL_QWEN_SPECIAL = {"<|endoftext|>": True, "<|fim_prefix|>": False, "<|fim_middle|>": False, "<|fim_suffix|>": False,
                     "<|fim_pad|>": False, "<|repo_name|>": False, "<|file_sep|>": False}
"""added_tokens_decoder[...]["special"] in Qwen/Qwen2.5-Coder-*'s tokenizer_config.json (ids 151643, 151659-151664)."""


@pytest.fixture(scope="module")
def token_ids(tiny_model) -> dict[str, int]:
    return json.loads((tiny_model / "fimfleet-tiny.json").read_text())["special_token_ids"]


def complete(vllm_server, token_id: int, stop: list[str] | None) -> dict:
    body = {"model": SERVED, "prompt": FIM.prompt("def add(a, b):\n    return ", "\n"), "max_tokens": MAX_TOKENS,
            "temperature": 0, "logit_bias": {str(token_id): 100}}
    if stop is not None:
        body["stop"] = stop
    r = httpx.post(vllm_server["base"] + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], "finish": out["choices"][0]["finish_reason"],
            "tokens": out["usage"]["completion_tokens"]}


def test_tiny_tokenizer_marks_tokens_like_qwen(tiny_model):
    decoder = json.loads((tiny_model / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {t["content"]: t["special"] for t in decoder.values()} == REAL_QWEN_SPECIAL
    assert models.load_local_spec(SERVED, tiny_model).fim == FIM


@pytest.mark.parametrize("token", [t for t in FIM.stop if not REAL_QWEN_SPECIAL[t]])
def test_each_fim_stop_string_ends_generation(vllm_server, token_ids, token):
    stopped = complete(vllm_server, token_ids[token], list(FIM.stop))
    assert stopped == {"text": "", "finish": "stop", "tokens": 1}, stopped
    # control: the same token without stop strings is plain text, and generation runs on
    free = complete(vllm_server, token_ids[token], None)
    assert free["finish"] == "length" and free["tokens"] == MAX_TOKENS and token in free["text"], free


def test_end_of_text_stops_as_eos(vllm_server, token_ids):
    """<|endoftext|> is special (skipped from text): it ends generation as the EOS token, stop strings or not."""
    for stop in (list(FIM.stop), None):
        out = complete(vllm_server, token_ids["<|endoftext|>"], stop)
        assert out == {"text": "", "finish": "stop", "tokens": 1}, out
