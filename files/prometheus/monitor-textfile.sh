#!/bin/bash
# fimfleet: the deep probe's state as node_exporter textfile metrics, run by its own timer.
# files/monitor/recover.sh keeps, per engine unit, in /run/fimfleet/monitor-<unit without .service>:
#   failures      consecutive failed probes (reset by a good probe and after a restart)
#   last          "<epoch> ok" | "<epoch> fail <error>" | "<epoch> busy <error>" (failed, but the
#                 engine produced tokens: loaded, not hung) | "<epoch> starting <error>" (failed
#                 inside the engine's start grace) | "<epoch> config-error <error>"
#   stage         0 = next recovery is a restart, 1 = next one escalates to SIGKILL
#   restarted-at  epoch of its last restart, removed once a probe passes again
# This script only reads them. Because restarted-at disappears, it counts each new value
# itself (STATE_DIR), so restarts survive as a counter.
# Until its first probe, the monitor has no verdict: an engine without start.sh's stamp then is
# in its first start (the monitor is installed once it serves), so it counts as starting too.
# Usage: monitor-textfile.sh ENV_FILE   (TEXTFILE_DIR, STATE_DIR, RUN_DIR, MONITORS="node=unit ...",
#                                        CERTIFICATES="node=certificate file ...",
#                                        START_STAMPS="unit=start.sh's stamp file ...")
# Output: $TEXTFILE_DIR/fimfleet_monitor.prom, replaced atomically.
# It runs every few seconds for the node's whole life, so a round forks once (the final mv): state
# is read with `read`, and a certificate's end is read with openssl only when its file changed.
set -euo pipefail
# shellcheck disable=SC1090
source "$1"
THP_DIR=${THP_DIR:-/sys/kernel/mm/transparent_hugepage}
[[ -d $STATE_DIR && -d $TEXTFILE_DIR ]] || mkdir -p "$STATE_DIR" "$TEXTFILE_DIR"
umask 022

declare -A family=() samples=()
order=()
metric() { # NAME TYPE HELP: declares a family once, in output order
  order+=("$1"); family[$1]="# HELP $1 $3"$'\n'"# TYPE $1 $2"$'\n'
}
sample() { samples[$1]+="$1{$2} $3"$'\n'; }
number() { # FILE DEFAULT: n = the file's first word if it is a whole number, else DEFAULT
  local v=
  { read -r -n 64 v _ < "$1"; } 2>/dev/null || true
  if [[ $v =~ ^[0-9]+$ ]]; then n=$v; else n=$2; fi
}
not_after() { # PATH: the certificate's notAfter in epoch seconds; nothing when unreadable
  local end
  end=$(openssl x509 -enddate -noout -in "$1" 2>/dev/null) || return 0
  date -u -d "${end#notAfter=}" +%s 2>/dev/null || true
}

metric fimfleet_monitor_probe_ok gauge "1 if the last deep FIM probe got a completion, 0 if it failed or was rejected."
metric fimfleet_monitor_probe_busy gauge "1 if the last probe failed while the engine produced tokens (loaded, not hung)."
metric fimfleet_monitor_engine_starting gauge "1 if the last probe failed inside the engine's start grace, or the engine's first start runs: starting, not down."
metric fimfleet_monitor_probe_rejected gauge "1 if the ingress rejected the last probe (HTTP 401/403): a configuration error no restart fixes."
metric fimfleet_monitor_last_probe_timestamp_seconds gauge "When the last deep probe ran (0 = never)."
metric fimfleet_monitor_consecutive_failures gauge "Failed deep probes in a row, as counted by the recovery manager."
metric fimfleet_monitor_recovery_stage gauge "0 = the next recovery restarts the engine, 1 = it escalates to SIGKILL."
metric fimfleet_monitor_restarts_total counter "Engine restarts done by the recovery manager, counted by this exporter."
metric fimfleet_monitor_last_restart_timestamp_seconds gauge "When the recovery manager last restarted the engine (0 = never)."
metric fimfleet_thp_mode gauge "Transparent huge page setting in force (1 for the active mode)."
metric fimfleet_tls_certificate_not_after_seconds gauge "When the ingress's TLS certificate expires (absent: unreadable)."

declare -A stamp_of=()
for pair in ${START_STAMPS:-}; do
  stamp_of[${pair%%=*}]=${pair#*=}
done

for pair in $MONITORS; do
  node=${pair%%=*} unit=${pair#*=}
  dir="$RUN_DIR/monitor-${unit%.service}"
  labels="node=\"$node\",unit=\"$unit\""
  read -r ts status _ 2>/dev/null < "$dir/last" || { ts=0; status=none; }
  [[ $ts =~ ^[0-9]+$ ]] || ts=0
  stamp=${stamp_of[$unit]:-}
  if [ "$status" != none ]; then
    ok=0 busy=0 starting=0 rejected=0
    case $status in ok) ok=1 ;; busy) busy=1 ;; starting) starting=1 ;; config-error) rejected=1 ;; esac
    sample fimfleet_monitor_probe_ok "$labels" "$ok"
    sample fimfleet_monitor_probe_busy "$labels" "$busy"
    sample fimfleet_monitor_engine_starting "$labels" "$starting"
    sample fimfleet_monitor_probe_rejected "$labels" "$rejected"
  elif [ -n "$stamp" ] && [ ! -e "$stamp" ]; then
    sample fimfleet_monitor_engine_starting "$labels" 1
  fi
  sample fimfleet_monitor_last_probe_timestamp_seconds "$labels" "$ts"
  number "$dir/failures" 0; sample fimfleet_monitor_consecutive_failures "$labels" "$n"
  number "$dir/stage" 0; sample fimfleet_monitor_recovery_stage "$labels" "$n"
  mine="$STATE_DIR/${unit%.service}"
  number "$dir/restarted-at" 0; restarted=$n
  number "$mine.restarts" 0; count=$n
  number "$mine.last-restart" 0; last_restart=$n
  if [ "$restarted" != 0 ] && [ "$restarted" != "$last_restart" ]; then
    count=$((count + 1)) last_restart=$restarted
    echo "$count" > "$mine.restarts"
    echo "$restarted" > "$mine.last-restart"
  fi
  sample fimfleet_monitor_restarts_total "$labels" "$count"
  sample fimfleet_monitor_last_restart_timestamp_seconds "$labels" "$last_restart"
done

for pair in ${CERTIFICATES:-}; do
  node=${pair%%=*} path=${pair#*=}
  # What was read from the file, read again whenever the file is not older than that (a reissue rewrites it).
  cache="$STATE_DIR/certificate-$node" epoch='' was=''
  { read -r epoch was < "$cache"; } 2>/dev/null || true
  if [[ ! -e $path ]]; then
    epoch=''
  elif [[ $was != "$path" || ! $cache -nt $path ]]; then
    epoch=$(not_after "$path")
    echo "$epoch $path" > "$cache"
  fi
  [[ $epoch =~ ^[0-9]+$ ]] && sample fimfleet_tls_certificate_not_after_seconds "node=\"$node\",path=\"$path\"" "$epoch"
done

for setting in enabled defrag; do
  # the bracketed word is the mode in force; only these characters may become a label value
  line=''
  { read -r line < "$THP_DIR/$setting"; } 2>/dev/null || true
  [[ $line =~ \[([a-z_+]+)\] ]] && sample fimfleet_thp_mode "setting=\"$setting\",mode=\"${BASH_REMATCH[1]}\"" 1
done

out="$TEXTFILE_DIR/fimfleet_monitor.prom"
tmp="$out.$$.tmp"
for name in "${order[@]}"; do
  # a family without samples is left out
  [ -z "${samples[$name]:-}" ] || printf '%s%s' "${family[$name]}" "${samples[$name]}"
done > "$tmp"
mv -f "$tmp" "$out"
