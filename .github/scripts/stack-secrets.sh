#!/usr/bin/env bash
# Puts one stack's secrets into the runner's copy of its stack file; they never come from,
# or go back into, the repository. Two sources:
#   - Pulumi ESC: FIMFLEET_ESC_ENVIRONMENT names an environment ("{stack}" is replaced by the
#     stack name) whose pulumiConfig holds fimfleet:sshPrivateKey, fimfleet:apiKeys, ... as secrets;
#   - GitHub secrets, passed in as FIMFLEET_SSH_PRIVATE_KEY and FIMFLEET_API_KEYS (a JSON object
#     of key name -> key), plus FIMFLEET_TLS_CERT / FIMFLEET_TLS_KEY / FIMFLEET_HF_TOKEN if the
#     stack uses them. Values go to `pulumi config set --secret` on stdin, never on a command line.
# Usage: stack-secrets.sh STACK   (pulumi must be logged in to the stack's backend)
set -euo pipefail
stack=${1:?usage: stack-secrets.sh STACK}
die() { echo "stack-secrets: $*" >&2; exit 1; }

pulumi stack select --create "$stack" >/dev/null

if [[ -n ${FIMFLEET_ESC_ENVIRONMENT:-} ]]; then
  pulumi config env add "${FIMFLEET_ESC_ENVIRONMENT//\{stack\}/$stack}" --yes --stack "$stack" >/dev/null
  exit 0
fi

[[ -n ${FIMFLEET_SSH_PRIVATE_KEY:-} ]] \
  || die "set the GitHub secret FIMFLEET_SSH_PRIVATE_KEY (or the variable FIMFLEET_ESC_ENVIRONMENT) for $stack"
[[ -n ${FIMFLEET_API_KEYS:-} ]] \
  || die "set the GitHub secret FIMFLEET_API_KEYS to a JSON object like {\"alice\": \"<key>\"} for $stack"
api_key() {  # api_key: the key names, one a line; api_key NAME: that key
  python3 -c 'import json, os, sys
keys = json.loads(os.environ["FIMFLEET_API_KEYS"])
assert isinstance(keys, dict) and keys and all(isinstance(v, str) for v in keys.values())
sys.stdout.write(keys[sys.argv[1]] if len(sys.argv) > 1 else "".join(k + "\n" for k in keys))' "$@"
}
api_key >/dev/null 2>&1 \
  || die "FIMFLEET_API_KEYS must be a JSON object of key name -> key, e.g. {\"alice\": \"<key>\"}"

set_secret() { pulumi config set --secret "$@" --stack "$stack" >/dev/null; }
printf '%s\n' "$FIMFLEET_SSH_PRIVATE_KEY" | set_secret fimfleet:sshPrivateKey
while IFS= read -r name; do
  api_key "$name" | set_secret --path "fimfleet:apiKeys.$name"
done < <(api_key)
for pair in tlsCert:FIMFLEET_TLS_CERT tlsKey:FIMFLEET_TLS_KEY hfToken:FIMFLEET_HF_TOKEN; do
  var=${pair#*:}
  if [[ -n ${!var:-} ]]; then printf '%s\n' "${!var}" | set_secret "fimfleet:${pair%%:*}"; fi
done
