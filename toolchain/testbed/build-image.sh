#!/usr/bin/env bash
# Build (or reuse) the fimfleet test "VPS" disk image: a debootstrapped Debian
# bookworm with systemd, openssh-server and the stock Debian kernel, booted by
# vm.py with QEMU TCG and direct kernel boot.
#
#   build-image.sh [--variant NAME] [--force] [--prune] [--print-dir] [--quiet]
#
#   --variant NAME  base (default) or variants/NAME.sh on top of the base rootfs
#   --force         rebuild even if cached
#   --prune         delete this variant's builds from older recipes (unless in use)
#   --print-dir     only print the cache dir (exit 0 if built, 3 if not)
#
# Output: the image directory is printed as the LAST line of stdout; progress
# goes to stderr. Everything is cached under
#   ${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}/testbed/<variant>-<hash>/
# where <hash> covers this script, the package list, the disk size and the
# variant script (plus whatever the variant prints for `NAME.sh key`). An
# unchanged recipe is a no-op that returns in well under a second.
#
# Variants: toolchain/testbed/variants/NAME.sh is called as
#   NAME.sh key            -> print extra cache-key material (hash of inputs)
#   NAME.sh apply ROOTFS   -> extra build steps against the rootfs directory
# `apply` runs with /proc, /sys, /dev mounted in ROOTFS, apt's archive cache
# bound, and a policy-rc.d that stops services from starting; use
# `chroot "$ROOTFS" ...` for commands inside. A variant starts from a copy of
# the cached base rootfs, so it never re-runs debootstrap. Anything it mounts
# below ROOTFS (e.g. a bind-mounted wheelhouse) is unmounted afterwards.
#
# Needs root, debootstrap, e2fsprogs (>= 1.43), qemu-utils; missing packages
# are apt-get installed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
CACHE_ROOT="${FIMFLEET_CACHE:-$HOME/.cache/fimfleet}"
TB_CACHE="$CACHE_ROOT/testbed"

SUITE=bookworm
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security
DISK_SIZE="${FIMFLEET_TESTBED_DISK_SIZE:-20G}"
GUEST_HOSTNAME=fimfleet-vps
# What a fresh minimal VPS has. NOT nginx or docker: the product installs those.
PACKAGES=(
  systemd systemd-sysv udev dbus libpam-systemd
  openssh-server openssh-sftp-server
  linux-image-amd64
  python3 python3-venv
  curl ca-certificates netbase
  apparmor iproute2 procps kmod sudo
)

VARIANT=base
FORCE=0
PRUNE=0
PRINT_DIR=0
QUIET=0

T0=$(date +%s)
log() { [ "$QUIET" = 1 ] || printf '[testbed %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { printf 'build-image.sh: error: %s\n' "$*" >&2; exit 1; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SELF"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --variant) VARIANT="${2:?--variant needs a name}"; shift 2 ;;
    --variant=*) VARIANT="${1#*=}"; shift ;;
    --force) FORCE=1; shift ;;
    --prune) PRUNE=1; shift ;;
    --print-dir) PRINT_DIR=1; shift ;;
    -q|--quiet) QUIET=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ "$VARIANT" =~ ^[a-z0-9][a-z0-9_-]*$ ]] || die "bad variant name '$VARIANT' (use [a-z0-9_-])"
VARIANT_SCRIPT=""
if [ "$VARIANT" != base ]; then
  VARIANT_SCRIPT="$HERE/variants/$VARIANT.sh"
  [ -f "$VARIANT_SCRIPT" ] || die "unknown variant '$VARIANT': $VARIANT_SCRIPT does not exist"
fi

# ---------------------------------------------------------------- cache key
sha() { sha256sum | cut -c1-64; }
key_material() {
  printf 'fimfleet-testbed-recipe v1\n'
  printf 'script %s\n' "$(sha <"$SELF")"
  printf 'suite %s mirror %s security %s\n' "$SUITE" "$MIRROR" "$SECURITY_MIRROR"
  printf 'packages %s\n' "${PACKAGES[*]}"
  printf 'disk %s\n' "$DISK_SIZE"
  printf 'variant %s\n' "$VARIANT"
  if [ -n "$VARIANT_SCRIPT" ]; then
    printf 'variant-script %s\n' "$(sha <"$VARIANT_SCRIPT")"
    printf 'variant-key %s\n' "$(printf '%s' "$VARIANT_KEY" | sha)"
  fi
}
VARIANT_KEY=""
if [ -n "$VARIANT_SCRIPT" ]; then
  VARIANT_KEY="$(TESTBED_DIR="$HERE" FIMFLEET_CACHE="$CACHE_ROOT" bash "$VARIANT_SCRIPT" key)" \
    || die "variant '$VARIANT': '$VARIANT_SCRIPT key' failed (exit $?)"
fi
KEY_MATERIAL="$(key_material)"
KEY="$VARIANT-$(printf '%s' "$KEY_MATERIAL" | sha | cut -c1-16)"
OUT="$TB_CACHE/$KEY"

if [ "$PRINT_DIR" = 1 ]; then
  echo "$OUT"
  [ -f "$OUT/manifest.json" ] && exit 0 || exit 3
fi
# Delete this variant's builds from older recipes, unless a running process
# (a VM using it as kernel/backing file) still refers to them.
prune() {
  local d
  for d in "$TB_CACHE/$VARIANT"-*; do
    [ -d "$d" ] && [ "$d" != "$OUT" ] || continue
    [[ "$(basename "$d")" =~ ^$VARIANT-[0-9a-f]{16}$ ]] || continue
    if grep -qsF "$d/" /proc/[0-9]*/cmdline; then log "prune: keeping $d (in use)"; continue; fi
    if awk -v p="$d/" 'index($2, p) == 1 { f = 1 } END { exit !f }' /proc/self/mounts; then
      log "prune: keeping $d (has mounts)"; continue
    fi
    log "prune: deleting $d"; rm -rf "$d"
  done
}
if [ "$FORCE" = 0 ] && [ -f "$OUT/manifest.json" ]; then
  log "image $KEY is cached: $OUT"
  [ "$PRUNE" = 0 ] || prune
  echo "$OUT"
  exit 0
fi

# ---------------------------------------------------------------- prereqs
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot and mounts need it): rerun with sudo"
[ "$(uname -m)" = x86_64 ] || die "host must be x86_64 (found $(uname -m))"

declare -A PKG_FOR=(
  [debootstrap]=debootstrap [mkfs.ext4]=e2fsprogs [qemu-img]=qemu-utils
  [flock]=util-linux [chroot]=coreutils [sha256sum]=coreutils [mknod]=coreutils
  [python3]=python3 [ssh-keygen]=openssh-client
)
need_install=()
for cmd in "${!PKG_FOR[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 \
    || need_install+=("${PKG_FOR[$cmd]}")
done
if [ "${#need_install[@]}" -gt 0 ]; then
  mapfile -t need_install < <(printf '%s\n' "${need_install[@]}" | sort -u)
  log "installing missing prerequisites: ${need_install[*]}"
  if command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_install[@]}"; } >&2 \
      || die "missing ${need_install[*]} and apt-get install failed: run 'apt-get update && apt-get install -y ${need_install[*]}'"
  else
    die "missing ${need_install[*]}: install them (Debian: apt-get install -y ${need_install[*]})"
  fi
fi
export PATH="$PATH:/usr/sbin:/sbin"
# mkfs.ext4 -d needs e2fsprogs >= 1.43. Capture first: `mkfs.ext4 -V | grep -q` under pipefail fails
# at random when grep exits at its first match and mkfs.ext4's second line gets SIGPIPE.
mkfs_version=$(mkfs.ext4 -V 2>&1 || true)
grep -qE 'mke2fs 1\.(4[3-9]|[5-9][0-9])' <<<"$mkfs_version" \
  || die "mkfs.ext4 from e2fsprogs >= 1.43 is needed for -d: apt-get install -y e2fsprogs"

mkdir -p "$TB_CACHE" "$TB_CACHE/debs/partial"
exec 9>"$TB_CACHE/.lock-$KEY"
if ! flock -n 9; then
  log "another build of $KEY is running; waiting for it"
  flock 9
fi
if [ "$FORCE" = 0 ] && [ -f "$OUT/manifest.json" ]; then
  log "image $KEY was built by a concurrent run: $OUT"
  echo "$OUT"; exit 0
fi

WORK="$TB_CACHE/.build-$KEY-$$"
ROOTFS="$WORK/rootfs"

# ---------------------------------------------------------------- mounts
mounted_under() {  # print mount points below $1 (deepest first)
  awk -v p="$1/" 'index($2, p) == 1 { print $2 }' /proc/self/mounts | sort -r
}
umount_all() {
  local m
  for m in $(mounted_under "$1"); do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
}
chroot_mount() {
  local r="$1"
  mount -t proc proc "$r/proc"
  mount -t sysfs sysfs "$r/sys"
  # A private tmpfs /dev (not a bind of the host's) so a stray rm -rf cannot hit host devices.
  mount -t tmpfs -o mode=0755,size=16m devtmpfs-fimfleet "$r/dev"
  mknod -m 666 "$r/dev/null" c 1 3; mknod -m 666 "$r/dev/zero" c 1 5
  mknod -m 666 "$r/dev/full" c 1 7; mknod -m 666 "$r/dev/random" c 1 8
  mknod -m 666 "$r/dev/urandom" c 1 9; mknod -m 666 "$r/dev/tty" c 5 0
  mkdir -p "$r/dev/pts" "$r/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$r/dev/pts"
  ln -sf pts/ptmx "$r/dev/ptmx"
  mount -t tmpfs -o mode=1777 shm "$r/dev/shm"
  ln -sf /proc/self/fd "$r/dev/fd"
  mkdir -p "$r/var/cache/apt/archives"
  mount --bind "$TB_CACHE/debs" "$r/var/cache/apt/archives"
  printf '#!/bin/sh\nexit 101\n' >"$r/usr/sbin/policy-rc.d"; chmod 755 "$r/usr/sbin/policy-rc.d"
  # Build-time only: dpkg without fsync (the image is made from the tree afterwards).
  printf 'force-unsafe-io\n' >"$r/etc/dpkg/dpkg.cfg.d/zz-fimfleet-build-unsafe-io"
}
chroot_umount() {
  umount_all "$1"
  rm -f "$1/usr/sbin/policy-rc.d" "$1/etc/dpkg/dpkg.cfg.d/zz-fimfleet-build-unsafe-io"
}
cleanup() {
  local rc=$?
  if [ -d "$WORK" ]; then
    umount_all "$WORK"
    if [ -n "$(mounted_under "$WORK")" ]; then
      echo "build-image.sh: warning: mounts remain under $WORK; not deleting it" >&2
    else
      rm -rf "$WORK"
    fi
  fi
  [ $rc = 0 ] || echo "build-image.sh: error: build of $KEY failed (exit $rc); see messages above" >&2
}
trap cleanup EXIT
trap 'exit 130' INT TERM

in_chroot() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 HOME=/root "$@"; }

rm -rf "$WORK"; mkdir -p "$WORK"
log "building image $KEY (variant $VARIANT) in $WORK"

# ---------------------------------------------------------------- rootfs
if [ "$VARIANT" = base ]; then
  log "debootstrap $SUITE (minbase) from $MIRROR"
  debootstrap --variant=minbase --cache-dir="$TB_CACHE/debs" "$SUITE" "$ROOTFS" "$MIRROR" \
    >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log above; is $MIRROR reachable?)"; }

  log "configuring apt, initramfs and base files"
  cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    >"$ROOTFS/etc/apt/apt.conf.d/90fimfleet-no-recommends"
  # Small initramfs: only what direct kernel boot on virtio needs (MODULES=most
  # makes a much bigger initrd that takes seconds to unpack under TCG).
  mkdir -p "$ROOTFS/etc/initramfs-tools/conf.d"
  printf 'MODULES=list\n' >"$ROOTFS/etc/initramfs-tools/conf.d/fimfleet.conf"
  printf '%s\n' virtio_pci virtio_blk virtio_net virtio_rng ext4 >>"$ROOTFS/etc/initramfs-tools/modules"
  printf 'do_symlinks = no\n' >"$ROOTFS/etc/kernel-img.conf"

  chroot_mount "$ROOTFS"
  log "apt-get install ${PACKAGES[*]}"
  { in_chroot apt-get update -q && in_chroot apt-get install -y -q "${PACKAGES[@]}"; } \
    >"$WORK/apt.log" 2>&1 \
    || { tail -n 30 "$WORK/apt.log" >&2; die "apt-get install in the chroot failed (log above)"; }

  log "configuring hostname, fstab, ssh, networkd, console"
  echo "$GUEST_HOSTNAME" >"$ROOTFS/etc/hostname"
  cat >"$ROOTFS/etc/hosts" <<EOF
127.0.0.1 localhost
127.0.1.1 $GUEST_HOSTNAME
::1 localhost ip6-localhost ip6-loopback
EOF
  printf '/dev/vda / ext4 rw,noatime,errors=remount-ro 0 0\n' >"$ROOTFS/etc/fstab"
  printf 'LANG=C.UTF-8\n' >"$ROOTFS/etc/default/locale"
  : >"$ROOTFS/etc/machine-id"   # "uninitialized": each cold boot gets its own id
  rm -f "$ROOTFS/var/lib/dbus/machine-id"

  # sshd: root with keys only.
  cat >"$ROOTFS/etc/ssh/sshd_config.d/10-fimfleet.conf" <<'EOF'
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
EOF
  install -d -m 700 "$ROOTFS/root/.ssh"
  in_chroot passwd -l root >/dev/null

  # Key injection: vm.py passes fimfleet.authorized_key=<base64 of a pubkey
  # line> on the kernel command line; this unit adds it before sshd starts.
  cat >"$ROOTFS/usr/local/sbin/fimfleet-seed" <<'EOF'
#!/bin/sh
# Adds the ssh public key given on the kernel command line to root's keys.
set -eu
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    fimfleet.authorized_key=*)
      key="$(printf '%s' "${arg#*=}" | base64 -d)"
      install -d -m 700 /root/.ssh
      touch /root/.ssh/authorized_keys
      chmod 600 /root/.ssh/authorized_keys
      grep -qxF "$key" /root/.ssh/authorized_keys || printf '%s\n' "$key" >>/root/.ssh/authorized_keys
      ;;
  esac
done
EOF
  chmod 755 "$ROOTFS/usr/local/sbin/fimfleet-seed"
  cat >"$ROOTFS/etc/systemd/system/fimfleet-seed.service" <<'EOF'
[Unit]
Description=fimfleet testbed: ssh key from the kernel command line
Before=ssh.service
After=local-fs.target

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/fimfleet-seed

[Install]
WantedBy=multi-user.target
EOF

  # Network: systemd-networkd, DHCP on the QEMU user-mode NIC. slirp's DNS is 10.0.2.3.
  cat >"$ROOTFS/etc/systemd/network/10-fimfleet-user.network" <<'EOF'
[Match]
Type=ether
Name=en* eth*

[Network]
DHCP=ipv4
IPv6AcceptRA=no
EOF
  printf 'nameserver 10.0.2.3\n' >"$ROOTFS/etc/resolv.conf"

  in_chroot systemctl enable systemd-networkd.service fimfleet-seed.service \
    serial-getty@ttyS0.service >/dev/null 2>&1
  # Background apt/fsck jobs would grab the dpkg lock or burn emulated CPU mid-test.
  for u in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
    in_chroot systemctl disable "$u" >/dev/null 2>&1 || true
  done

  rm -f "$ROOTFS"/var/cache/apt/*.bin
  chroot_umount "$ROOTFS"
else
  log "building base image first"
  BASE_OUT="$(FIMFLEET_CACHE="$CACHE_ROOT" bash "$SELF" --variant base $([ "$QUIET" = 1 ] && echo --quiet) | tail -n 1)"
  [ -d "$BASE_OUT/rootfs" ] || die "base image $BASE_OUT has no rootfs/ to start variant '$VARIANT' from"
  log "copying base rootfs from $BASE_OUT"
  cp -a --reflink=auto "$BASE_OUT/rootfs" "$ROOTFS"
  chroot_mount "$ROOTFS"
  log "variant $VARIANT: $VARIANT_SCRIPT apply"
  ROOTFS="$ROOTFS" TESTBED_DIR="$HERE" FIMFLEET_CACHE="$CACHE_ROOT" \
    bash "$VARIANT_SCRIPT" apply "$ROOTFS" >&2 \
    || die "variant '$VARIANT' step failed: $VARIANT_SCRIPT apply"
  rm -f "$ROOTFS"/var/cache/apt/*.bin
  chroot_umount "$ROOTFS"
fi
[ -z "$(mounted_under "$ROOTFS")" ] || die "mounts remain under $ROOTFS after the chroot steps"

# ---------------------------------------------------------------- kernel
KVER="$(ls "$ROOTFS/lib/modules" | sort -V | tail -n 1)"
[ -n "$KVER" ] && [ -f "$ROOTFS/boot/vmlinuz-$KVER" ] && [ -f "$ROOTFS/boot/initrd.img-$KVER" ] \
  || die "no kernel/initrd found in $ROOTFS/boot"
cp "$ROOTFS/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
cp "$ROOTFS/boot/initrd.img-$KVER" "$WORK/initrd.img"
cp "$ROOTFS/etc/ssh/ssh_host_ed25519_key.pub" "$WORK/ssh_host_ed25519_key.pub"
log "kernel $KVER, initrd $(du -h "$WORK/initrd.img" | cut -f1)"

# ---------------------------------------------------------------- disk
log "mkfs.ext4 -d ($DISK_SIZE, $(du -sh "$ROOTFS" | cut -f1) of files)"
# Zero inode tables/journal now so the guest kernel does no lazy init writes.
mkfs.ext4 -q -F -L fimfleet-root -d "$ROOTFS" \
  -E lazy_itable_init=0,lazy_journal_init=0 "$WORK/rootfs.raw" "$DISK_SIZE" >&2 \
  || die "mkfs.ext4 -d failed"
log "converting to qcow2"
qemu-img convert -f raw -O qcow2 "$WORK/rootfs.raw" "$WORK/rootfs.qcow2" || die "qemu-img convert failed"
rm -f "$WORK/rootfs.raw"
# Base keeps rootfs/ (variants copy it); a variant's tree is not needed again.
[ "$VARIANT" = base ] || rm -rf "$ROOTFS"
chmod 0444 "$WORK/rootfs.qcow2"

printf '%s\n' "$KEY_MATERIAL" >"$WORK/key-material.txt"
BUILD_SECONDS=$(( $(date +%s) - T0 ))
python3 - "$WORK" "$KEY" "$VARIANT" "$KVER" "$BUILD_SECONDS" "$DISK_SIZE" "${PACKAGES[@]}" <<'EOF'
import json, os, sys, time
work, key, variant, kver, secs, disk, *pkgs = sys.argv[1:]
json.dump({
    "key": key, "variant": variant, "kernel": kver,
    "vmlinuz": "vmlinuz", "initrd": "initrd.img", "disk": "rootfs.qcow2",
    "root_device": "/dev/vda", "disk_size": disk,
    "host_key": open(os.path.join(work, "ssh_host_ed25519_key.pub")).read().strip(),
    "packages": pkgs, "build_seconds": int(secs),
    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}, open(os.path.join(work, "manifest.json.tmp"), "w"), indent=2)
EOF
mv "$WORK/manifest.json.tmp" "$WORK/manifest.json"   # written last: marks the build complete

# Publish atomically. The rootfs/ tree is kept: variants start from it.
if [ -e "$OUT" ]; then mv "$OUT" "$WORK.old"; fi
mv "$WORK" "$OUT"
[ -e "$WORK.old" ] && { umount_all "$WORK.old"; rm -rf "$WORK.old"; }
log "done in ${BUILD_SECONDS}s: $OUT ($(du -h "$OUT/rootfs.qcow2" | cut -f1) qcow2)"
[ "$PRUNE" = 0 ] || prune
echo "$OUT"
