"""The image's HEALTHCHECK: exit 0 only when the engine streams one completed token.

/health answers while the engine is wedged (a stuck scheduler, a stopped worker); a real
completion does not. It streams, as the editors do. The engine's port: FIMFLEET_ENGINE_PORT,
else 8000 (vLLM's default).
"""

import json
import os
import sys
import urllib.request

BASE = f"http://127.0.0.1:{os.environ.get('FIMFLEET_ENGINE_PORT', '8000')}"


def one_token() -> str:
    """'' when one token streamed, else why not."""
    with urllib.request.urlopen(BASE + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "prompt": "def", "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(BASE + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, usage = None, None
    with urllib.request.urlopen(req, timeout=50) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"the engine sent an error: {event['error']}"
            if event.get("choices"):
                text = (text or "") + (event["choices"][0].get("text") or "")
            usage = event.get("usage") or usage
    if text is None:
        return "no token streamed"
    if usage and usage.get("completion_tokens") != 1:
        return f"{usage.get('completion_tokens')} tokens completed, wanted 1"
    return ""


def main() -> int:
    try:
        why = one_token()
    except Exception as e:  # any failure is "unhealthy"; docker inspect's health log shows why
        why = f"{type(e).__name__}: {e}"
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
