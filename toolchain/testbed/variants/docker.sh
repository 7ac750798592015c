#!/usr/bin/env bash
# Image variant "docker": the base image plus Debian's docker.io, enabled, so a booted snapshot
# holds a running dockerd. The GPU tiers' container arguments are checked against it (`docker
# create` + `docker inspect`, tests/e2e/test_docker_gpu_args.py): Docker's own parser and
# daemon, with no GPU. Installed natively in the chroot; inside the emulated VM apt crawls.
# No outside inputs beyond Debian's archive (the script's own text is in the image key).
set -euo pipefail
case "${1:-}" in
  key) echo "docker.io apparmor" ;;
  apply)
    R="$2"
    DEBIAN_FRONTEND=noninteractive chroot "$R" apt-get install -y -q --no-install-recommends \
      docker.io apparmor iptables >/dev/null
    chroot "$R" systemctl enable -q docker.service containerd.service ;;
  *) echo "usage: $0 key | apply ROOTFS" >&2; exit 2 ;;
esac
