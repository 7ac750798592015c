#!/usr/bin/env bash
# Cached install of the scanners the ingress tests run (gixy-ng, sslyze) into their own venv,
# exactly the pinned set in requirements.txt (--no-deps, then `pip check`).
#   toolchain/scanners/install.sh    build or reuse; the last stdout line is SCANNERS_VENV=<path>
# Cache: ${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}/scanners/<key>/venv, <key> = hash of the pins
# and the Python version. Env: FIMFLEET_CACHE, FIMFLEET_PYTHON (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"
py="${FIMFLEET_PYTHON:-python3}"
log() { printf '[scanners-install] %s\n' "$*" >&2; }
key="$({ grep -vE '^[[:space:]]*(#|$)' "$req"; "$py" --version; } | sha256sum | cut -c1-12)"
base="${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}/scanners/$key"
venv="$base/venv"
mkdir -p "$base"
exec 9>"$base/lock"
flock 9  # concurrent test runs share one install
if [ ! -f "$base/complete" ]; then
  log "creating $venv"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req" >&2 \
    || { log "pip install failed: is PyPI reachable?"; exit 1; }
  "$venv/bin/pip" check >&2 || { log "the pinned set is inconsistent: fix $req"; exit 1; }
  touch "$base/complete"
fi
echo "SCANNERS_VENV=$venv"
