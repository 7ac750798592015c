#!/usr/bin/env bash
# The rendered GPU preflight against a REAL NVIDIA driver (issue 10 item 1).
#
#   benchmarks/gpu/preflight_on_device.sh render [DIR]   on this machine (needs .venv): renders
#       files/host/preflight.sh.j2 for every GPU tier into DIR (default benchmarks/gpu/rendered),
#       from a stack config parsed by components/config.py, as a deploy does.
#   benchmarks/gpu/preflight_on_device.sh run [DIR]      on the GPU machine (bash, nvidia-smi):
#       runs each rendered script the way RemoteStep does (bash -s, set -euo pipefail), against
#       the real /proc and nvidia-smi, and writes the outputs and a summary to ${OUT:-DIR/out}.
#
# Verdict (exit 1 on any miss): no bash error such as "integer expression expected"; the
# GPU check itself parses nvidia-smi. On an H200 host: the gpu-h100 tier finds 1 usable GPU
# (an H200 serves an H100 tier), the gpu-l40s tier refuses it as another model. CPU, RAM
# and NUMA problems are this machine's real facts and are only recorded.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cmd=${1:-run}
dir=${2:-$root/benchmarks/gpu/rendered}

if [ "$cmd" = render ]; then
  mkdir -p "$dir"
  cd "$root"
  .venv/bin/python - "$dir" <<'PY'
import sys
from pathlib import Path
from components import config, host, tiers
from tests.helpers import raw_config
for name, t in tiers.TIERS.items():
    if t.device == "gpu":
        raw, secret = raw_config(name)
        Path(sys.argv[1], f"{name}.sh").write_text(host.preflight_script(config.parse(raw, secret)))
        print(f"rendered {sys.argv[1]}/{name}.sh")
PY
  exit 0
fi

out=${OUT:-$dir/out}
mkdir -p "$out"
smi=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>&1) || true
printf '%s\n' "$smi" > "$out/nvidia-smi.txt"
first_gpu=${smi%%,*}
status=0
summary="["
for script in "$dir"/*.sh; do
  tier=$(basename "$script" .sh)
  rc=0
  { printf 'set -euo pipefail\n'; cat "$script"; } | bash -s >"$out/$tier.out" 2>"$out/$tier.err" || rc=$?
  gpu_problem=$(grep -E 'usable GPU|nvidia-smi' "$out/$tier.err" || true)
  verdict=ok
  if grep -qE 'expression expected|syntax error|command not found|unbound variable' "$out/$tier.err"; then
    verdict="bash error"
  elif [ "$tier" = gpu-h100 ] && [[ $first_gpu =~ H(100|200) ]] && [ -n "$gpu_problem" ]; then
    verdict="H100/H200 refused for the H100 tier"
  elif [ "$tier" = gpu-l40s ] && [[ $first_gpu =~ H(100|200) ]] && ! grep -q "not one of: L40S" "$out/$tier.err"; then
    verdict="a Hopper GPU was not refused as another model for the L40S tier"
  fi
  [ "$verdict" = ok ] || status=1
  echo "== $tier: exit $rc, verdict: $verdict"; cat "$out/$tier.out" "$out/$tier.err"
  summary+=$(printf '{"tier": "%s", "exit": %d, "verdict": "%s", "gpuProblem": "%s"},' \
    "$tier" "$rc" "$verdict" "$(printf '%s' "$gpu_problem" | tr '\n"' ' _' | head -c 300)")
done
printf '%s]\n' "${summary%,}" | tee "$out/summary.json"
exit "$status"
