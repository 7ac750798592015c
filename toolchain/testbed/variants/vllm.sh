#!/usr/bin/env bash
# Image variant "vllm": the base image plus the pinned vLLM CPU venv at /opt/fimfleet/vllm,
# installed natively in the chroot from the wheelhouse (inside the emulated VM the same
# install takes about 17 minutes). The venv carries the stamp that the runtime's install
# step looks for, so `pulumi up` finds it and skips, as on a re-run. Everything else
# (nginx, jemalloc, libnuma...) is left to fimfleet, as on a fresh VPS; Prometheus and
# node_exporter are pre-installed but not running (the e2e would otherwise spend minutes on apt).
# Env: FIMFLEET_WHEELHOUSE (toolchain/vllm/install.sh wheelhouse), FIMFLEET_VLLM_LOCK.
set -euo pipefail
: "${FIMFLEET_WHEELHOUSE:?set FIMFLEET_WHEELHOUSE (toolchain/vllm/install.sh wheelhouse prints it)}"
: "${FIMFLEET_VLLM_LOCK:?set FIMFLEET_VLLM_LOCK (toolchain/vllm/requirements-cpu.lock)}"
VENV=/opt/fimfleet/vllm
case "${1:-}" in
  key)
    sha256sum < "$FIMFLEET_VLLM_LOCK"
    (cd "$FIMFLEET_WHEELHOUSE" && find . -name '*.whl' -printf '%P %s\n' | sort) | sha256sum ;;
  apply)
    R="$2"
    mkdir -p "$R/mnt/wheelhouse" "$R$(dirname "$VENV")"
    mount --bind "$FIMFLEET_WHEELHOUSE" "$R/mnt/wheelhouse"
    trap 'umount "$R/mnt/wheelhouse" 2>/dev/null || true' EXIT
    cp "$FIMFLEET_VLLM_LOCK" "$R/tmp/requirements.lock"
    chroot "$R" python3 -m venv "$VENV"
    chroot "$R" "$VENV/bin/pip" install -q --no-index --no-deps --disable-pip-version-check \
      --no-warn-script-location --find-links /mnt/wheelhouse -r /tmp/requirements.lock
    # The same stamp files/runtime/install-venv.sh.j2 computes from the uploaded lock.
    sha256sum "$R/tmp/requirements.lock" | cut -c1-16 > "$R$VENV/.fimfleet-lock"
    rm -f "$R/tmp/requirements.lock"
    # Debian's Prometheus and node_exporter, which the Monitoring steps would otherwise fetch
    # through the VM's slow user-mode network and unpack under emulation. Installed, not running:
    # fimfleet's steps write their settings and start them, as on a VPS that had them already.
    DEBIAN_FRONTEND=noninteractive chroot "$R" apt-get install -y -q --no-install-recommends \
      prometheus prometheus-node-exporter >/dev/null
    chroot "$R" systemctl disable -q prometheus prometheus-node-exporter ;;
  *) echo "usage: $0 key | apply ROOTFS" >&2; exit 2 ;;
esac
