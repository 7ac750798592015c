#!/usr/bin/env bash
# Image variant "docker-engine": the docker variant with fimfleet's engine image already in
# dockerd's store, as on a host that pulled it before. It is pulled natively while the image
# is built, by the guest's own dockerd binary run in the chroot: inside the emulated VM the
# same pull took 1027 s of a fresh machine's CI (sha256, gunzip and untar under emulation).
# The store then names the image as the guest pulls it (FIMFLEET_PRELOAD_AS, 10.0.2.2:PORT/
# repo@sha256:...), so the runtime's pull step finds it present; a pull of another digest
# with the same layers downloads only its manifest and config (tests/e2e/test_local_docker.py).
# Env: FIMFLEET_PRELOAD_IMAGE (the same digest on the host's test registry), FIMFLEET_PRELOAD_AS.
set -euo pipefail
: "${FIMFLEET_PRELOAD_IMAGE:?set FIMFLEET_PRELOAD_IMAGE (repo@sha256:... on the test registry of the host)}"
: "${FIMFLEET_PRELOAD_AS:?set FIMFLEET_PRELOAD_AS (the same digest as the guest names it)}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
digest=${FIMFLEET_PRELOAD_IMAGE##*@}
[[ "$digest" =~ ^sha256:[0-9a-f]{64}$ && "${FIMFLEET_PRELOAD_AS##*@}" == "$digest" ]] \
  || { echo "docker-engine: give both images by the same digest (repo@sha256:...)" >&2; exit 2; }
case "${1:-}" in
  key) bash "$here/docker.sh" key; echo "preload $FIMFLEET_PRELOAD_IMAGE as $FIMFLEET_PRELOAD_AS" ;;
  apply)
    R="$2"
    bash "$here/docker.sh" apply "$R"
    sock=/run/fimfleet-preload/docker.sock
    mkdir -p "$R/run/fimfleet-preload"
    # In a mount namespace of its own, gone with dockerd: the tree bound onto itself (dockerd's
    # untar makes / private, which needs / to be a mount point) and a cgroup2 tree (dockerd will
    # not start without a devices cgroup or one). No networking, no iptables: this daemon only
    # pulls, from the host's loopback registry (127.0.0.0/8 registries are plain HTTP by default).
    # shellcheck disable=SC2016
    unshare --mount --propagation private sh -c 'mount --rbind "$1" "$1" && mount -t cgroup2 cgroup2 "$1/sys/fs/cgroup" &&
      exec chroot "$1" dockerd --host "unix://$2" --pidfile /run/fimfleet-preload/docker.pid \
        --exec-root /run/fimfleet-preload/exec --iptables=false --ip6tables=false --ip-masq=false --bridge=none' \
      sh "$R" "$sock" >"$R/run/fimfleet-preload/dockerd.log" 2>&1 &
    pid=$!
    stop() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
    trap 'stop; cat "$R/run/fimfleet-preload/dockerd.log" >&2' ERR
    for _ in $(seq 150); do
      chroot "$R" docker -H "unix://$sock" version >/dev/null 2>&1 && break
      kill -0 "$pid" 2>/dev/null || { echo "docker-engine: dockerd exited in the chroot" >&2; false; }
      sleep 0.2
    done
    echo "docker-engine: pulling $FIMFLEET_PRELOAD_IMAGE natively (about a minute)" >&2
    chroot "$R" docker -H "unix://$sock" pull -q "$FIMFLEET_PRELOAD_IMAGE" >&2
    id=$(chroot "$R" docker -H "unix://$sock" image inspect -f '{{.Id}}' "$FIMFLEET_PRELOAD_IMAGE")
    driver=$(chroot "$R" docker -H "unix://$sock" info -f '{{.Driver}}')
    trap - ERR
    stop
    # Name it as the guest does (the reference store, read by dockerd at start; it is stopped).
    python3 - "$R/var/lib/docker/image/$driver/repositories.json" "$FIMFLEET_PRELOAD_IMAGE" \
      "$FIMFLEET_PRELOAD_AS" "$id" <<'EOF'
import json, sys
path, pulled, guest, image_id = sys.argv[1:]
doc = json.load(open(path))
repos = doc.setdefault("Repositories", {})
repos.pop(pulled.split("@")[0], None)
repos[guest.split("@")[0]] = {guest: image_id}
with open(path, "w") as f:
    json.dump(doc, f)
EOF
    rm -rf "$R/run/fimfleet-preload" "$R/run/containerd" "$R/run/docker" ;;
  *) echo "usage: $0 key | apply ROOTFS" >&2; exit 2 ;;
esac
