#!/usr/bin/env bash
# The README's main job (called through ./fimfleet demo, after bootstrap): build or restore
# the local test VM, deploy the `local` stack onto it with `pulumi up`, and print the
# endpoint, the SLA report and the Continue.dev config.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
exec "$root/.venv/bin/python" -m scripts.local_deploy "$@"
