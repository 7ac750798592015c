#!/usr/bin/env bash
# The README's test command (called through ./fimfleet test, after bootstrap):
# unit tests with Pulumi mocks, integration tests with real nginx, real vLLM and a real
# `pulumi preview` of every stack, and the end-to-end deploy onto the local test VM.
# Extra arguments go to pytest (e.g. `./fimfleet test tests/unit`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "fimfleet test: $*" >&2; }

say "preparing the pinned vLLM CPU install (cached; the first run downloads about 3.5 GB)"
vllm_venv=$(toolchain/vllm/install.sh | sed -n 's/^VLLM_VENV=//p' | tail -n1)
[[ -x "$vllm_venv/bin/python" ]] || { say "the vLLM install did not produce a venv"; exit 1; }
export FIMFLEET_VLLM_PYTHON="$vllm_venv/bin/python"

say "running pytest $*"
exec "$root/.venv/bin/python" -m pytest "$@"
