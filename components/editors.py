"""Ready-to-paste editor settings for one user's key (pure): Continue.dev, and honest Cursor notes.

The Continue config.yaml must work as generated, checked against Continue's own packages
(tests/js): the private CA travels inside it as a data: URI (Continue's fetch reads
`requestOptions.caBundlePath` as a path or a data: URI), `maxTokens` is the SLA's measured
length and fits the context (Continue otherwise asks for 4096 and vLLM answers 400),
and the FIM stop strings come first with `maxStopWords: 4` (Continue appends its own
stops after `defaultCompletionOptions.stop`, and vLLM refuses more than 4).
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass

import yaml

from components import models, templates

CONTINUE_MIN_DEBOUNCE_MS = 250
"""Continue's own debounce is 350 ms; faster tiers may go down to this."""
CONTINUE_MAX_PROMPT_TOKENS = 1024
"""Continue's default prompt budget for autocomplete."""
CONTINUE_MIN_MODEL_TIMEOUT_MS = 150
"""Continue's default `modelTimeout`: lines after the first are dropped once it has passed,
and the stream is cut after 2.5x it."""


@dataclass(frozen=True)
class EditorArgs:
    """What editor configs need to know about a node, taken from the stack config once."""

    model: str
    """The served model name (vLLM's --served-model-name)."""
    fim: models.FimFormat | None
    """The model's FIM format; None means no autocomplete."""
    chat: bool
    """The model has a chat template (an -Instruct model)."""
    context_length: int
    """vLLM's --max-model-len: prompt plus completion must fit."""
    max_tokens: int
    """Completion length the SLA gate measured (sla.maxTokens)."""
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    min_decode_tokens_per_s: float | None
    private_ca: bool
    """The certificate is not publicly trusted (self-signed or provided): embed the CA."""
    public_https: bool
    """An ACME certificate on a public domain: the only way Cursor's servers can reach it."""


def args_for(cfg) -> EditorArgs:
    """EditorArgs from a validated StackConfig."""
    from components.engine import served_name

    s, spec = cfg.sla, cfg.model_spec
    return EditorArgs(
        model=served_name(cfg), fim=spec.fim, chat=spec.chat, context_length=cfg.engine.max_model_len,
        max_tokens=s.max_tokens, ttft_p50_ms=s.ttft_p50_ms, ttft_p99_ms=s.ttft_p99_ms,
        min_decode_tokens_per_s=s.min_decode_tokens_per_s, private_ca=cfg.ingress.tls != "acme",
        public_https=cfg.ingress.tls == "acme" and bool(cfg.ingress.domain),
    )


def completion_budget(a: EditorArgs) -> tuple[int, int]:
    """(maxTokens, maxPromptTokens). Continue counts prompt tokens with its own tokenizer, not
    the model's, so the prompt gets at most half of what the completion leaves of the context."""
    max_tokens = max(1, min(a.max_tokens, a.context_length // 4))
    return max_tokens, max(64, min(CONTINUE_MAX_PROMPT_TOKENS, (a.context_length - max_tokens) // 2))


def autocomplete_timing(a: EditorArgs) -> dict:
    """Debounce not shorter than the tier's p50 TTFT limit (no point asking faster than the
    first token can come back); modelTimeout long enough for a whole completion at the SLA's
    p99 TTFT and minimum decode rate, so Continue does not cut it to its first line."""
    debounce = max(CONTINUE_MIN_DEBOUNCE_MS, math.ceil(a.ttft_p50_ms or 0))
    whole = (a.ttft_p99_ms or 0) + (a.max_tokens * 1000 / a.min_decode_tokens_per_s if a.min_decode_tokens_per_s else 0)
    return {"debounceDelay": debounce, "modelTimeout": max(CONTINUE_MIN_MODEL_TIMEOUT_MS, math.ceil(whole))}


def ca_data_uri(pem: str) -> str:
    """The CA as a data: URI, so the config is one self-contained file."""
    return "data:application/x-pem-file;base64," + base64.b64encode(pem.encode()).decode()


def continue_config(a: EditorArgs, endpoint: str, key: str, ca_pem: str = "") -> dict:
    """Continue.dev config.yaml content for one key: autocomplete for a FIM model, chat only for a chat model."""
    base: dict = {"provider": "openai", "model": a.model, "apiBase": f"{endpoint}/v1", "apiKey": key}
    if a.private_ca and ca_pem:
        base["requestOptions"] = {"caBundlePath": ca_data_uri(ca_pem)}
    max_tokens, prompt_tokens = completion_budget(a)
    entries = []
    if a.fim:
        entries.append({
            "name": f"fimfleet {a.model} (autocomplete)", **base, "roles": ["autocomplete"],
            "useLegacyCompletionsEndpoint": True,
            "maxStopWords": models.MAX_STOP_WORDS,
            "defaultCompletionOptions": {"contextLength": a.context_length, "maxTokens": max_tokens,
                                         "stop": list(a.fim.stop)},
            # Explicit: for a served name without "coder", Continue would pick a StarCoder template.
            "promptTemplates": {"autocomplete": a.fim.handlebars()},
            "autocompleteOptions": {**autocomplete_timing(a), "maxPromptTokens": prompt_tokens, "onlyMyCode": True},
        })
    if a.chat:
        entries.append({"name": f"fimfleet {a.model} (chat)", **base, "roles": ["chat", "edit"],
                        "defaultCompletionOptions": {"contextLength": a.context_length}})
    return {"name": "fimfleet", "version": "1.0.0", "schema": "v1", "models": entries}


YAML12_NOT_TEXT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+"
                             r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)|null|Null|NULL|~|true|True|TRUE|false|False|FALSE")
"""Plain scalars that YAML 1.2's core schema reads as a number, a boolean or null."""


class _ContinueDumper(yaml.SafeDumper):
    """PyYAML writes YAML 1.1: `1e5` or `0o17` stay unquoted there, and Continue's YAML 1.2 parser
    then reads a served name or a key as a number and refuses the file. Such strings are quoted."""


_ContinueDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style='"' if YAML12_NOT_TEXT.fullmatch(value) else None))


def continue_yaml(a: EditorArgs, endpoint: str, key: str, ca_pem: str = "") -> str:
    return yaml.dump(continue_config(a, endpoint, key, ca_pem), Dumper=_ContinueDumper, sort_keys=False, width=1 << 16)


def cursor_notes(a: EditorArgs, endpoint: str) -> str:
    """What Cursor can and cannot do with this node; claims nothing more."""
    lines = [
        "Cursor and this fimfleet node",
        "",
        "Tab completion: not possible. Cursor's Tab runs on Cursor's own models; no setting points it at",
        "a self-hosted FIM model. Use Continue (the continueYaml output) for completions instead.",
        "",
        "Chat: only through Settings > Models > 'Override OpenAI Base URL' with your key. Cursor's servers,",
        "not your machine, call that URL, so it works only when all of these hold:",
        "  - the endpoint is reachable from the internet,",
        "  - its certificate is publicly trusted (ingress.tls: acme with ingress.domain),",
        "  - the served model is a chat (-Instruct) model.",
        "",
        "This node:",
        f"  - endpoint: {endpoint}/v1",
        f"  - certificate: {'ACME, publicly trusted' if a.public_https else 'private CA: Cursor cannot verify it'}",
        f"  - model {a.model}: {'has a chat template' if a.chat else 'a base FIM model without a chat template: chat requests get HTTP 400'}",
        f"  - so Cursor chat here: {'may work if the endpoint is public' if a.public_https and a.chat else 'does not work'}",
    ]
    return "\n".join(lines) + "\n"


def curl_smoke_test(a: EditorArgs, endpoint: str, key_env: str = "FIMFLEET_KEY", ca_file: str = "fimfleet-ca.pem") -> str:
    """A copy-paste check; the key comes from an environment variable so it is not in shell history."""
    prompt = a.fim.prompt("def fib(n):\n    ", "\n") if a.fim else "def fib(n):\n    "
    body = {"model": a.model, "prompt": prompt, "max_tokens": completion_budget(a)[0], "temperature": 0, "stream": True}
    if a.fim:
        body["stop"] = list(a.fim.stop)
    q = templates.shell_quote
    cacert = f"--cacert {q(ca_file)} " if a.private_ca else ""
    return (f"curl -N {cacert}-H \"Authorization: Bearer ${key_env}\" "
            f"-H 'Content-Type: application/json' -d {q(json.dumps(body))} {q(endpoint + '/v1/completions')}")
