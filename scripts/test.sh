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

if (($# > 0)); then
  say "running pytest $*"
  exec "$root/.venv/bin/python" -m pytest "$@"
fi

# The whole suite: three pytest runs at once. Each VM deploy mostly waits on its emulated guest, so
# the single-VM e2e, the two-VM fleet e2e and everything else (unit, integration, preview) share
# the machine's cores instead of taking turns. Every line a lane prints carries its name.
declare -A lanes=(
  [vm]="tests/e2e/test_local_deploy.py tests/e2e/test_local_docker.py"
  [fleet]="tests/e2e/test_local_fleet.py"
)
rest=(tests)
for files in "${lanes[@]}"; do for f in $files; do rest+=("--ignore=$f"); done; done
logs=$(mktemp -d)
declare -A pids=()
lane() {  # name, pytest args...
  local name=$1; shift
  ( set +e; "$root/.venv/bin/python" -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$logs/$name.log" | sed -u "s/^/[$name] /"
    exit "${PIPESTATUS[0]}" ) &
  pids[$name]=$!
}
say "running pytest in three lanes at once: vm (${lanes[vm]}), fleet (${lanes[fleet]}), rest (everything else)"
# shellcheck disable=SC2086  # the lanes' file lists split on spaces
{ lane vm -v ${lanes[vm]}; lane fleet -v ${lanes[fleet]}; lane rest "${rest[@]}"; }
rc=0
for name in vm fleet rest; do
  if wait "${pids[$name]}"; then status=passed; else status="FAILED (exit $?)"; rc=1; fi
  say "lane $name: $status: $(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$logs/$name.log" | tail -n1 | tr -d '=')"
done
rm -rf "$logs"
exit "$rc"
