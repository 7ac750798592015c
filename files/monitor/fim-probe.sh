#!/bin/bash
# fimfleet deep probe: one real one-token FIM completion through the local ingress, with a key
# and a hard timeout. /health stays 200 while an engine hangs; this does not.
# Usage: fim-probe.sh ENV_FILE   (PROBE_URL, PROBE_KEY_FILE, PROBE_CA, MODEL, PROBE_TIMEOUT_S)
set -euo pipefail
# shellcheck disable=SC1090
source "$1"
body=$(printf '{"model": "%s", "prompt": "<|fim_prefix|>def probe_%s(x):\\n    return <|fim_suffix|>\\n<|fim_middle|>", "max_tokens": 1, "temperature": 0}' "$MODEL" "$(date +%s%N)")
out=$(curl -sS --fail-with-body -m "$PROBE_TIMEOUT_S" --cacert "$PROBE_CA" \
  -H "Authorization: Bearer $(cat "$PROBE_KEY_FILE")" -H 'Content-Type: application/json' \
  -d "$body" "$PROBE_URL/v1/completions") || { echo "probe failed: ${out:-no answer within ${PROBE_TIMEOUT_S}s}" >&2; exit 1; }
case "$out" in *'"choices"'*) exit 0 ;; *) echo "probe got no completion: ${out:0:200}" >&2; exit 1 ;; esac
