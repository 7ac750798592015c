#!/usr/bin/env bash
# Runs benchmarks/probe_vs_server_ttft.py against a real vLLM CPU engine on this machine
# (the pinned venv and the tiny model, both cached) and records the result in
# benchmarks/results/probe_vs_server_ttft.json. The engine is stopped by its own process group.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/toolchain/vllm/install.sh" | sed -n 's/^VLLM_VENV=//p' | tail -n1)
model=$("$venv/bin/python" "$root/toolchain/tinymodel/make_tiny_model.py" | sed -n 's/^TINY_MODEL_DIR=//p' | tail -n1)
port=${PORT:-18123}
log=$(mktemp)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \
  setsid "$venv/bin/python" -m vllm.entrypoints.launchers.api_server.entry --model "$model" \
  --served-model-name tiny-qwen2-fim --host 127.0.0.1 --port "$port" --enforce-eager --dtype bfloat16 \
  --max-model-len 2048 >"$log" 2>&1 &
pid=$!
trap 'kill -TERM -- "-$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
  curl -fsS -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 1
done
mkdir -p "$root/benchmarks/results"
"$root/.venv/bin/python" "$root/benchmarks/probe_vs_server_ttft.py" --endpoint "http://127.0.0.1:$port" --no-key \
  --model tiny-qwen2-fim --samples "${SAMPLES:-40}" --json | tee "$root/benchmarks/results/probe_vs_server_ttft.json"
