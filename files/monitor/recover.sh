#!/bin/bash
# fimfleet recovery manager, run by a systemd timer (components/monitor.py explains the rule).
# Each round: one deep probe, then vLLM's own step metrics from the engine's /metrics.
#   probe ok                           -> healthy
#   probe failed, engine (re)started   -> starting: within GRACE_S of its start, never judged
#   probe failed, metrics moved        -> busy: the engine is finishing steps, never restarted
#   probe failed, metrics still        -> a failure; after FAILURE_THRESHOLD failures in a row
#                                         AND STALL_S seconds without a step, the engine is hung
# A hung engine is restarted; if the restart does not bring it back, the next verdict SIGKILLs
# that engine's processes only (its unit's cgroup or its container, never a name pattern) and
# clears that engine's stale shared memory.
# Usage: recover.sh ENV_FILE   (monitor.env.j2: ENGINE_UNIT, CONTAINER, SERVICE_USER,
#        STATE_DIR, FAILURE_THRESHOLD, GRACE_S, STALL_S, RESTART_TIMEOUT_S, METRICS_URL, METRICS_TIMEOUT_S + probe vars)
# Exit: 0 = probe ok, or a failure was counted/handled; 3 = configuration error (see fim-probe.sh).
set -uo pipefail
# shellcheck disable=SC1090
source "$1"
state=${STATE_DIR:-/run/fimfleet/monitor-${ENGINE_UNIT%.service}}
[ -d "$state" ] || mkdir -p "$state"
log() { echo "$*"; logger -t fimfleet-monitor -- "$ENGINE_UNIT: $*" 2>/dev/null || true; }
# A healthy round runs every few seconds for the engine's whole life, so it forks only for the
# probe and /metrics: state is read with `read`, the clock with printf's %(%s)T.
# counter FILE VAR: the number kept in $state/FILE into VAR, 0 when the file is missing or holds
# no number (a round killed while it wrote it); no fork.
counter() {
  local v=0
  { read -r v < "$state/$1"; } 2>/dev/null || true
  [[ $v =~ ^[0-9]+$ ]] || v=0
  printf -v "$2" '%s' "$v"
}
failures=0 progress_at=0 restarted=0 ok_at=0 stage=0
counter failures failures

# What the engine core last reported through its own /metrics (loopback, no key): token
# counters, KV cache use and request gauges. They change only when the engine finishes a
# step (a decode step or a prefill chunk); empty when /metrics does not answer in time.
engine_sample() {
  curl -sS -m "$METRICS_TIMEOUT_S" "$METRICS_URL" 2>/dev/null | awk '
    /^vllm:(prompt_tokens_total|generation_tokens_total|kv_cache_usage_perc|num_requests_running|num_requests_waiting)[{ ]/ {
      s = s $NF " " } END { printf "%s", s }'
}

rc=0; "${0%/*}/fim-probe.sh" "$1" 2>"$state/last-error" || rc=$?
sample=$(engine_sample || true)
prev=''
{ IFS= read -r prev < "$state/engine-sample"; } 2>/dev/null || true
# Keep the last real reading when /metrics did not answer: the next round compares against it,
# not against nothing (which would look like movement).
[ -n "$sample" ] && printf '%s' "$sample" > "$state/engine-sample"
printf -v now '%(%s)T' -1
counter progress-at progress_at
[ "$progress_at" != 0 ] || echo "$now" > "$state/progress-at"
if [ "$rc" -eq 0 ]; then
  [ "$failures" -gt 0 ] && log "probe ok again after $failures failure(s)"
  echo 0 > "$state/failures"; echo "$now ok" > "$state/last"; echo "$now" > "$state/progress-at"; echo "$now" > "$state/ok-at"
  if [ -e "$state/restarted-at" ] || [ -e "$state/stage" ]; then rm -f "$state/restarted-at" "$state/stage"; fi
  exit 0
fi
# The ingress rejected the probe's key (401/403): a configuration error that no restart
# fixes. Report it (the round fails) and leave the engine and the failure count alone.
if [ "$rc" -eq 3 ]; then
  echo "$now config-error $(head -c 300 "$state/last-error")" > "$state/last"
  log "configuration error, NOT restarting $ENGINE_UNIT: $(head -c 200 "$state/last-error")"
  exit 3
fi
# The engine finished steps since the last round: the probe waited behind real work. Busy, not hung.
if [ -n "$sample" ] && [ "$sample" != "$prev" ]; then
  echo "$now" > "$state/progress-at"; echo 0 > "$state/failures"
  echo "$now busy $(head -c 300 "$state/last-error")" > "$state/last"
  log "probe failed but the engine is working (vLLM metrics '${prev:-none}' -> '$sample'): busy, not restarting"
  exit 0
fi
# An engine that is starting is not failing yet: after our own restart, or after any other
# start of its unit that no probe has passed since (a deploy's start.sh, an operator's restart).
# Both times have whole seconds: a start in the second of the last passed probe came after it
# (no engine serves within a second of its start), so it is a start too.
counter restarted-at restarted
counter ok-at ok_at
entered=$(systemctl show -p ActiveEnterTimestamp --value "$ENGINE_UNIT" 2>/dev/null || true)
entered=$( { [ -n "$entered" ] && date -d "$entered" +%s; } 2>/dev/null || echo 0)
if [ "$entered" -gt "$restarted" ] && [ "$entered" -ge "$ok_at" ]; then
  restarted=$entered
fi
if [ $(( now - restarted )) -lt "$GRACE_S" ] && systemctl is-active -q "$ENGINE_UNIT"; then
  # recorded as starting, not failing: Prometheus's down and probe alerts wait while it is
  echo "$now starting $(head -c 300 "$state/last-error")" > "$state/last"
  log "probe failed during the ${GRACE_S}s start grace: $(head -c 200 "$state/last-error")"
  exit 0
fi
echo "$now fail $(head -c 300 "$state/last-error")" > "$state/last"

failures=$((failures + 1)); echo "$failures" > "$state/failures"
counter progress-at progress_at
stalled=$(( now - progress_at ))
seen=${sample:+unchanged}
log "probe failed ($failures/$FAILURE_THRESHOLD), engine idle for ${stalled}s (hung at ${STALL_S}s; vLLM metrics ${seen:-gave no answer within ${METRICS_TIMEOUT_S}s}): $(head -c 200 "$state/last-error")"
[ "$failures" -lt "$FAILURE_THRESHOLD" ] && exit 0
[ "$stalled" -lt "$STALL_S" ] && exit 0

systemctl is-active -q nginx || { log "nginx is down: restarting it"; systemctl restart nginx; }
counter stage stage
if [ "$stage" = 0 ]; then
  log "hung: restarting $ENGINE_UNIT"
  echo 1 > "$state/stage"  # first: a round cut short during the restart escalates at the next verdict
  timeout "$RESTART_TIMEOUT_S" systemctl restart "$ENGINE_UNIT" || log "restart did not finish in ${RESTART_TIMEOUT_S}s"
else
  log "escalating: SIGKILL to the processes of $ENGINE_UNIT, clearing its shared memory, starting it again"
  [ -n "${CONTAINER:-}" ] && docker kill --signal KILL "$CONTAINER" >/dev/null 2>&1
  systemctl kill --signal=SIGKILL "$ENGINE_UNIT"
  sleep 2
  [ -n "${SERVICE_USER:-}" ] && find /dev/shm -maxdepth 1 -user "$SERVICE_USER" -delete 2>/dev/null
  systemctl reset-failed "$ENGINE_UNIT" 2>/dev/null
  systemctl start "$ENGINE_UNIT"
  echo 0 > "$state/stage"
fi
date +%s | tee "$state/restarted-at" > "$state/progress-at"
echo 0 > "$state/failures"
