#!/usr/bin/env bash
# Image variant "docker": the base image plus Debian's docker.io, enabled, so a booted snapshot
# holds a running dockerd. The GPU tiers' container arguments are checked against it (`docker
# create` + `docker inspect`, tests/e2e/test_docker_gpu_args.py): Docker's own parser and
# daemon, with no GPU. The local-docker e2e pulls fimfleet's engine image into it from the test
# registry on the host (toolchain/image/build.py), which the guest reaches as 10.0.2.2 over
# plain HTTP: the one insecure registry this test VM's dockerd allows.
# Installed natively in the chroot; inside the emulated VM apt crawls.
set -euo pipefail
registry="10.0.2.2:${FIMFLEET_REGISTRY_PORT:-5959}"
case "${1:-}" in
  key) echo "docker.io apparmor insecure-registry $registry" ;;
  apply)
    R="$2"
    DEBIAN_FRONTEND=noninteractive chroot "$R" apt-get install -y -q --no-install-recommends \
      docker.io apparmor iptables >/dev/null
    mkdir -p "$R/etc/docker"
    printf '{"insecure-registries": ["%s"]}\n' "$registry" > "$R/etc/docker/daemon.json"
    chroot "$R" systemctl enable -q docker.service containerd.service ;;
  *) echo "usage: $0 key | apply ROOTFS" >&2; exit 2 ;;
esac
