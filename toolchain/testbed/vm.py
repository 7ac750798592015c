#!/usr/bin/env python3
"""fimfleet testbed: a local QEMU (TCG) VM that plays a fresh VPS.

Subcommands (all print JSON on stdout; progress goes to stderr):

  start     boot a fresh VM (cold boot) on a throwaway qcow2 overlay
  restore   start a VM from the saved RAM snapshot (made on demand), in seconds
  snapshot  boot once, save disk + RAM state for `restore` (no-op if cached)
  wait-ssh  wait until sshd in the guest answers
  ssh       run a command in the guest (exit code passes through)
  status    JSON description of the VM (running or not)
  stop      stop the VM by its pidfile and delete its overlay
  check     run the guest self-checks (systemd, sysctl, THP, avx2, apt)
  hmp       run a QEMU human-monitor command (e.g. 'info status')

All state of one VM lives in one directory (--state DIR, default
$FIMFLEET_CACHE/testbed/vms/<--name>): overlay disk.qcow2, id_ed25519 (the
per-VM ssh key), known_hosts, qemu.pid, qmp.sock, serial.log, info.json.

Python 3 standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEFAULT_MEM, DEFAULT_SMP, TB_CACHE, TestbedError, emit, image_dir, log  # noqa: E402
from machine import VM  # noqa: E402
from snapshots import make_snapshot, restore, save_running  # noqa: E402


# ------------------------------------------------------------------ checks

CHECK_SCRIPT = r"""
set -u
echo "systemd=$(systemctl is-system-running 2>/dev/null)"
echo "pid1=$(cat /proc/1/comm)"
echo "kernel=$(uname -r)"
echo "avx2=$(grep -c avx2 /proc/cpuinfo)"
echo "avx512f=$(grep -c avx512f /proc/cpuinfo)"
echo "nproc=$(nproc)"
echo "mem_kib=$(awk '/MemTotal/ {print $2}' /proc/meminfo)"
old=$(sysctl -n vm.swappiness)
if sysctl -w vm.swappiness=10 >/dev/null 2>&1 && [ "$(sysctl -n vm.swappiness)" = 10 ]; then
  echo "sysctl_swappiness=ok"; else echo "sysctl_swappiness=FAIL"; fi
sysctl -w vm.swappiness="$old" >/dev/null 2>&1
thp=/sys/kernel/mm/transparent_hugepage/enabled
cur=$(sed 's/.*\[\(.*\)\].*/\1/' $thp)
if echo madvise > $thp 2>/dev/null && grep -q '\[madvise\]' $thp; then
  echo "thp_writable=ok"; else echo "thp_writable=FAIL"; fi
echo "$cur" > $thp 2>/dev/null
echo "apparmor=$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null || echo missing)"
echo "guest_epoch=$(date +%s.%N)"
if [ "${APT:-0}" = 1 ]; then
  s=$(date +%s)
  if apt-get update -q >/tmp/apt-update.log 2>&1; then echo "apt_update=ok"; else echo "apt_update=FAIL"; fi
  echo "apt_update_s=$(( $(date +%s) - s ))"
fi
"""


def run_checks(vm: VM, apt: bool) -> dict:
    before = time.time()
    r = vm.ssh_run(f"APT={1 if apt else 0} bash -s", input=CHECK_SCRIPT, timeout=1800)
    after = time.time()
    res = {}
    for line in r.stdout.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            res[k] = int(v) if v.lstrip("-").isdigit() else v
    # The guest read its clock somewhere between `before` and `after`.
    g = float(res.pop("guest_epoch", "nan"))
    res["clock_skew_s"] = round(g - after if g > after else (g - before if g < before else 0.0), 3)
    res["check_seconds"] = round(after - before, 2)
    ok = (res.get("systemd") in ("running", "degraded") and res.get("pid1") == "systemd"
          and res.get("sysctl_swappiness") == "ok" and res.get("thp_writable") == "ok"
          and isinstance(res.get("avx2"), int) and res["avx2"] > 0
          and (not apt or res.get("apt_update") == "ok"))
    res["ok"] = ok
    return res


# ------------------------------------------------------------------ CLI

def default_state(name: str) -> str:
    return os.path.join(TB_CACHE, "vms", name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vm.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, machine=True):
        p.add_argument("--state", help="VM state directory (default: cache/testbed/vms/NAME)")
        p.add_argument("--name", default="default", help="VM name when --state is not given")
        if machine:
            p.add_argument("--variant", default="base", help="image variant (default: base)")
            p.add_argument("--mem", default=DEFAULT_MEM, help=f"guest RAM (default {DEFAULT_MEM})")
            p.add_argument("--smp", type=int, default=DEFAULT_SMP, help="vCPUs (default 2)")

    p = sub.add_parser("start", help="cold-boot a fresh VM")
    common(p)
    p.add_argument("--forward", action="append", default=[], metavar="[HOST:]GUEST",
                   help="extra tcp forward 127.0.0.1:HOST -> guest GUEST (HOST auto if omitted)")
    p.add_argument("--wait", action="store_true", help="wait for ssh before returning")
    p.add_argument("--timeout", type=float, default=600)

    p = sub.add_parser("restore", help="start a VM from the saved RAM snapshot")
    common(p)
    p.add_argument("--forward", action="append", default=[], metavar="[HOST:]GUEST")
    p.add_argument("--no-create", action="store_true",
                   help="fail instead of creating a missing snapshot")
    p.add_argument("--snapshot", help="restore this saved snapshot directory (see `save`) instead")
    p.add_argument("--ssh-port", type=int, default=0,
                   help="host port for the guest's sshd (default: a free one), e.g. to replace a VM in place")

    p = sub.add_parser("save", help="freeze the running VM into a snapshot directory of its own")
    common(p, machine=False)
    p.add_argument("--to", required=True, help="the snapshot directory to write")
    p.add_argument("--label", default="{}", help="JSON that says what the snapshot holds")

    p = sub.add_parser("snapshot", help="create the RAM snapshot (no-op when cached)")
    common(p)
    p.add_argument("--force", action="store_true", help="recreate even if cached")

    p = sub.add_parser("wait-ssh", help="wait until ssh answers")
    common(p, machine=False)
    p.add_argument("--timeout", type=float, default=600)

    p = sub.add_parser("ssh", help="run a command in the guest")
    common(p, machine=False)
    p.add_argument("command", nargs=argparse.REMAINDER, help="command (after --)")

    p = sub.add_parser("status", help="print the VM's JSON description")
    common(p, machine=False)

    p = sub.add_parser("stop", help="stop the VM (by pidfile) and delete its overlay")
    common(p, machine=False)
    p.add_argument("--purge", action="store_true", help="also delete the state directory")

    p = sub.add_parser("check", help="guest self-checks (systemd, sysctl, THP, avx2)")
    common(p, machine=False)
    p.add_argument("--apt", action="store_true", help="also run apt-get update in the guest")

    p = sub.add_parser("hmp", help="run a QEMU monitor (HMP) command, e.g. 'info status'")
    common(p, machine=False)
    p.add_argument("line", nargs="+")

    a = ap.parse_args(argv)
    vm = VM(a.state or default_state(a.name))
    try:
        if a.cmd == "start":
            t0 = time.monotonic()
            info = vm.launch(variant=a.variant, mem=a.mem, smp=a.smp, forwards=a.forward,
                             mode="cold", backing=os.path.join(image_dir(a.variant),
                                                               "rootfs.qcow2"))
            log(f"qemu started (pid {vm.pid()}), ssh on 127.0.0.1:{info['ssh']['port']}")
            if a.wait:
                vm.wait_ssh(a.timeout)
                s = time.monotonic() - t0
                log(f"ssh answered {s:.1f}s after start")
                info = vm.update_info(timings={"cold_boot_to_ssh_s": round(s, 2)})
            emit(vm.status())
        elif a.cmd == "restore":
            restore(vm, a.variant, a.mem, a.smp, a.forward, create=not a.no_create, snapshot=a.snapshot,
                    ssh_port=a.ssh_port)
            emit(vm.status())
        elif a.cmd == "save":
            emit(save_running(vm, os.path.abspath(a.to), json.loads(a.label)))
        elif a.cmd == "snapshot":
            emit(make_snapshot(a.variant, a.mem, a.smp, force=a.force))
        elif a.cmd == "wait-ssh":
            s = vm.wait_ssh(a.timeout)
            log(f"ssh answered after {s:.1f}s of waiting")
            emit(vm.status())
        elif a.cmd == "ssh":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not vm.running():
                raise TestbedError(f"the VM in {vm.state} is not running")
            argv = vm.ssh_argv()
            if not cmd and sys.stdin.isatty():
                argv.insert(1, "-t")
            os.execvp("ssh", argv + (["--"] + cmd if cmd else []))
        elif a.cmd == "status":
            emit(vm.status())
        elif a.cmd == "stop":
            emit(vm.stop(purge=a.purge))
        elif a.cmd == "check":
            res = run_checks(vm, a.apt)
            emit(res)
            return 0 if res["ok"] else 1
        elif a.cmd == "hmp":
            if not vm.running():
                raise TestbedError("VM is not running")
            q = vm.qmp()
            try:
                print(q.hmp(" ".join(a.line)), end="")
            finally:
                q.close()
    except TestbedError as e:
        print(f"vm.py {a.cmd}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
