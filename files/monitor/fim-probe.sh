#!/bin/bash
# fimfleet deep probe: one real one-token FIM completion through the local ingress, with a key
# and a hard timeout. /health stays 200 while an engine hangs; this does not.
# Usage: fim-probe.sh ENV_FILE   (PROBE_URL, PROBE_KEY_FILE, PROBE_CA, PROBE_BODY, PROBE_TIMEOUT_S)
# Exit: 0 = a completion came back; 1 = no answer, an error or no completion (engine or
# ingress trouble); 3 = the ingress REJECTED the probe (HTTP 401/403: wrong probe key or
# ACL). A restart cannot fix 3, so recover.sh reports it and leaves the engine alone.
set -euo pipefail
# shellcheck disable=SC1090
source "$1"
# The request in the model's FIM format, rendered by components/monitor.py from the model spec;
# a fresh nonce each round (the clock in microseconds), so the probe never rides the prefix cache.
body=${PROBE_BODY//@NONCE@/${EPOCHREALTIME/./}}
# An unreadable key file sends no key: the ingress's 401 reports it (exit 3), no restart does.
key=
{ IFS= read -r key < "$PROBE_KEY_FILE"; } 2>/dev/null || true
rc=0
# The key goes to curl on stdin (`-H @-`), never in its argv, which every local user can read.
out=$(curl -sS -m "$PROBE_TIMEOUT_S" --cacert "$PROBE_CA" -w '\n%{http_code}' \
  -H @- -H 'Content-Type: application/json' \
  -d "$body" "$PROBE_URL/v1/completions" <<< "Authorization: Bearer $key") || rc=$?
status=${out##*$'\n'}; out=${out%$'\n'*}
[ "$rc" -eq 0 ] || { echo "probe failed: curl exit $rc, no answer within ${PROBE_TIMEOUT_S}s" >&2; exit 1; }
case "$status" in
  200) ;;
  401|403) echo "probe rejected with HTTP $status (configuration error: probe key or ACL; an engine restart cannot fix it): ${out:0:200}" >&2; exit 3 ;;
  *) echo "probe failed: HTTP $status: ${out:0:200}" >&2; exit 1 ;;
esac
case "$out" in *'"choices"'*) exit 0 ;; *) echo "probe got no completion: ${out:0:200}" >&2; exit 1 ;; esac
