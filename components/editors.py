"""Ready-to-paste editor settings for a node (pure): Continue.dev and Cursor."""

from __future__ import annotations

import json

import yaml

FIM_TEMPLATE = "<|fim_prefix|>{{{prefix}}}<|fim_suffix|>{{{suffix}}}<|fim_middle|>"
"""Continue.dev's Handlebars template for Qwen2.5-Coder FIM."""


def continue_config(endpoint: str, model: str, key: str) -> dict:
    """Continue.dev config.yaml content: tab autocomplete with the FIM template, plus chat."""
    base = {"provider": "openai", "model": model, "apiBase": f"{endpoint}/v1", "apiKey": key}
    return {
        "name": "fimfleet",
        "version": "1.0.0",
        "schema": "v1",
        "models": [
            {"name": f"fimfleet {model} (autocomplete)", **base, "roles": ["autocomplete"],
             "promptTemplates": {"autocomplete": FIM_TEMPLATE},
             "autocompleteOptions": {"debounceDelay": 150, "maxPromptTokens": 1024, "onlyMyCode": True}},
            {"name": f"fimfleet {model} (chat)", **base, "roles": ["chat", "edit"]},
        ],
    }


def continue_yaml(endpoint: str, model: str, key: str) -> str:
    return yaml.safe_dump(continue_config(endpoint, model, key), sort_keys=False)


def continue_json(endpoint: str, model: str, key: str) -> str:
    return json.dumps(continue_config(endpoint, model, key), indent=2)


def cursor_settings(endpoint: str, model: str, key: str) -> str:
    """Cursor: Settings > Models > 'Override OpenAI Base URL' plus the key and a custom model name."""
    return json.dumps({"openAIBaseUrl": f"{endpoint}/v1", "openAIApiKey": key, "customModels": [model]}, indent=2)


def curl_smoke_test(endpoint: str, model: str, key_env: str = "FIMFLEET_KEY", ca_file: str = "fimfleet-ca.pem") -> str:
    """A copy-paste check; the key comes from an environment variable so it is not in shell history."""
    body = json.dumps({"model": model, "prompt": "<|fim_prefix|>def fib(n):\n    <|fim_suffix|>\n<|fim_middle|>",
                       "max_tokens": 32, "temperature": 0, "stream": True})
    return (f"curl -N --cacert {ca_file} -H \"Authorization: Bearer ${key_env}\" "
            f"-H 'Content-Type: application/json' -d '{body}' {endpoint}/v1/completions")
