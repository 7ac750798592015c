#!/bin/bash
# fimfleet recovery manager, run by a systemd timer. Counts failed deep probes in a row
# under /run; after FAILURE_THRESHOLD of them it restarts the engine, and if the restart
# does not bring it back it SIGKILLs that engine's processes only (its unit's cgroup or its
# container, never a name pattern) and clears that engine's stale shared memory.
# Usage: recover.sh ENV_FILE   (ENGINE_UNIT, CONTAINER, SERVICE_USER, FAILURE_THRESHOLD, GRACE_S, + probe vars)
# Exit: 0 = probe ok, or a failure was counted/handled; 3 = configuration error (see fim-probe.sh).
set -uo pipefail
# shellcheck disable=SC1090
source "$1"
state="/run/fimfleet/monitor-${ENGINE_UNIT%.service}"
mkdir -p "$state"
log() { echo "$*"; logger -t fimfleet-monitor -- "$ENGINE_UNIT: $*" 2>/dev/null || true; }
now=$(date +%s)
failures=$(cat "$state/failures" 2>/dev/null || echo 0)

rc=0; "$(dirname "$0")/fim-probe.sh" "$1" 2>"$state/last-error" || rc=$?
if [ "$rc" -eq 0 ]; then
  [ "$failures" -gt 0 ] && log "probe ok again after $failures failure(s)"
  echo 0 > "$state/failures"; echo "$now ok" > "$state/last"
  rm -f "$state/restarted-at" "$state/stage"
  exit 0
fi
# The ingress rejected the probe's key (401/403): a configuration error that no restart
# fixes. Report it (the round fails) and leave the engine and the failure count alone.
if [ "$rc" -eq 3 ]; then
  echo "$now config-error $(head -c 300 "$state/last-error")" > "$state/last"
  log "configuration error, NOT restarting $ENGINE_UNIT: $(head -c 200 "$state/last-error")"
  exit 3
fi
echo "$now fail $(head -c 300 "$state/last-error")" > "$state/last"

# An engine that is starting after our own restart is not failing yet.
restarted=$(cat "$state/restarted-at" 2>/dev/null || echo 0)
if [ $(( now - restarted )) -lt "$GRACE_S" ] && systemctl is-active -q "$ENGINE_UNIT"; then
  log "probe failed during the ${GRACE_S}s start grace: $(head -c 200 "$state/last-error")"
  exit 0
fi

failures=$((failures + 1)); echo "$failures" > "$state/failures"
log "probe failed ($failures/$FAILURE_THRESHOLD): $(head -c 200 "$state/last-error")"
[ "$failures" -lt "$FAILURE_THRESHOLD" ] && exit 0

systemctl is-active -q nginx || { log "nginx is down: restarting it"; systemctl restart nginx; }
stage=$(cat "$state/stage" 2>/dev/null || echo 0)
if [ "$stage" = 0 ]; then
  log "restarting $ENGINE_UNIT"
  timeout 90 systemctl restart "$ENGINE_UNIT" || log "restart did not finish in 90s"
  echo 1 > "$state/stage"
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
date +%s > "$state/restarted-at"
echo 0 > "$state/failures"
