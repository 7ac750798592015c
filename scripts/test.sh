#!/usr/bin/env bash
# The README's test command (called through ./fimfleet test, after bootstrap):
# unit tests with Pulumi mocks, integration tests with real nginx, real vLLM and a real
# `pulumi preview` of every stack, and the end-to-end deploy onto the local test VM.
#
# With no arguments the end-to-end tests run beside the others: they mostly wait on the
# emulated VM, and run one after the other the two took about 48 minutes. Each run has its
# own pytest temp directory; the e2e log streams to .work/e2e.log and is shown once the
# unit and integration tests are done. The exit status fails if either run fails.
# Extra arguments go to a single pytest run (e.g. `./fimfleet test tests/unit`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
say() { echo "fimfleet test: $*" >&2; }

say "preparing the pinned vLLM CPU install (cached; the first run downloads about 3.5 GB)"
vllm_venv=$(toolchain/vllm/install.sh | sed -n 's/^VLLM_VENV=//p' | tail -n1)
[[ -x "$vllm_venv/bin/python" ]] || { say "the vLLM install did not produce a venv"; exit 1; }
export FIMFLEET_VLLM_PYTHON="$vllm_venv/bin/python"
py="$root/.venv/bin/python"

if (($#)); then
  say "running pytest $*"
  exec "$py" -m pytest "$@"
fi

mkdir -p .work
log=.work/e2e.log
say "running the end-to-end tests in the background (log: $log), beside the unit and integration tests"
"$py" -m pytest tests/e2e --basetemp=.work/pytest-e2e -p no:cacheprovider >"$log" 2>&1 &
e2e=$!
trap 'kill "$e2e" 2>/dev/null || true' INT TERM

rc=0
"$py" -m pytest tests/unit tests/integration --basetemp=.work/pytest-main || rc=$?
say "unit and integration tests: exit $rc; the end-to-end tests so far, then live until they end:"
tail -n +1 -f --pid="$e2e" "$log" &
tailer=$!
e2e_rc=0
wait "$e2e" || e2e_rc=$?
wait "$tailer" 2>/dev/null || true
say "unit and integration tests: exit $rc; end-to-end tests: exit $e2e_rc"
((rc == 0 && e2e_rc == 0))
