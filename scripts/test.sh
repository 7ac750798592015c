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

# A test VM already running (a demo's, another run's) idles at most of a host core under
# emulation, and every emulated step of this run takes longer beside it: name each, with its stop.
while read -r pidfile; do
  say "note: a test VM is already running ($(dirname "$pidfile")): this run's VMs share the CPU with it and take longer. If nothing needs it, stop it with: python3 toolchain/testbed/vm.py stop --state $(dirname "$pidfile")"
done < <(ps -eo args= | sed -n 's/^[^ ]*qemu-system[^ ]* .* -pidfile \([^ ]*\).*/\1/p')

say "running pytest $*"
exec "$root/.venv/bin/python" -m pytest "$@"
