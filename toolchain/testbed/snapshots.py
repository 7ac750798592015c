"""RAM-and-disk snapshots of a booted VM: made once per image and machine layout, restored in seconds."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time

from common import (KERNEL_ARGS, MACHINE_LAYOUT, TestbedError, image_dir, load_json, log,
                    mem_mib, pid_cmdline, qemu_version, write_json)
from machine import VM


def snapshot_dir(image: str, mem: str, smp: int) -> str:
    manifest = load_json(os.path.join(image, "manifest.json"))
    # The QEMU command line with per-VM paths and ports fixed: any change to the
    # machine layout (devices, cpu, memory) gives a different snapshot.
    layout = VM("/fimfleet-layout")._qemu_argv(image, manifest, mem, smp, [(1, 22)], KERNEL_ARGS,
                                               None)
    sig = "\n".join([MACHINE_LAYOUT, qemu_version(), manifest["key"], json.dumps(layout)])
    h = hashlib.sha256(sig.encode()).hexdigest()[:12]
    return os.path.join(image, "snapshots", f"{mem_mib(mem)}M-{smp}cpu-{h}")


def wait_booted(vm: VM, timeout: float = 600, key: str | None = None) -> str:
    """Wait for systemd to finish booting; return its state (running/degraded)."""
    r = vm.ssh_run("timeout %d systemctl is-system-running --wait || true" % int(timeout),
                   timeout=timeout + 30, key=key)
    return r.stdout.strip()


def _freeze(vm: VM, dest: str) -> str:
    """Stop the running VM and write its RAM to dest/mem.state and its disk to
    dest/snapshot-disk.qcow2 (the backing file of every restore). Returns the RAM file."""
    vm.ssh_run("sync; echo 3 > /proc/sys/vm/drop_caches; sync")
    vm.close_mux()  # no ssh session may be open in the saved state
    time.sleep(2)   # let sshd/logind tear the session down
    os.makedirs(dest, exist_ok=True)
    mem_state = os.path.join(dest, "mem.state")
    q = vm.qmp()
    q.cmd("stop")
    q.cmd("migrate", uri=f"exec:cat > {mem_state}")
    next_log = time.monotonic() + 15
    while True:
        st = q.cmd("query-migrate")
        if st.get("status") == "completed":
            break
        if st.get("status") in ("failed", "cancelled"):
            raise TestbedError(f"migrate to file failed: {st}")
        if time.monotonic() > next_log:
            done = (st.get("ram") or {}).get("transferred", 0)
            log(f"snapshot: {done / 2**20:.0f} MiB of RAM written so far")
            next_log = time.monotonic() + 15
        time.sleep(0.2)
    try:
        q.cmd("quit")
    except (TestbedError, OSError):
        pass
    q.close()
    deadline = time.monotonic() + 30
    while vm.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    if vm.running():
        raise TestbedError("qemu did not exit after the snapshot was saved")
    os.rename(vm.overlay, os.path.join(dest, "snapshot-disk.qcow2"))
    os.chmod(os.path.join(dest, "snapshot-disk.qcow2"), 0o444)
    return mem_state


def make_snapshot(variant: str, mem: str, smp: int, force: bool = False) -> dict:
    image = image_dir(variant)
    sdir = snapshot_dir(image, mem, smp)
    manifest_path = os.path.join(sdir, "manifest.json")
    if not force and os.path.exists(manifest_path):
        return load_json(manifest_path)
    os.makedirs(os.path.dirname(sdir), exist_ok=True)
    with open(sdir + ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if not force and os.path.exists(manifest_path):
            return load_json(manifest_path)
        tmp = f"{sdir}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        vm = VM(tmp)
        t0 = time.monotonic()
        log(f"snapshot: cold-booting {variant} ({mem}, {smp} vCPU) in {tmp}")
        try:
            vm.launch(variant=variant, mem=mem, smp=smp, forwards=[], mode="snapshot-builder",
                      image=image, backing=os.path.join(image, "rootfs.qcow2"))
            ssh_s = vm.wait_ssh()
            log(f"snapshot: ssh answered after {ssh_s:.1f}s; waiting for boot to finish")
            state = wait_booted(vm)
            boot_s = time.monotonic() - t0
            log(f"snapshot: system {state} after {boot_s:.1f}s; dropping caches")
            mem_state = _freeze(vm, tmp)
            vm.stop()  # the frozen disk and the key the guest trusts stay in tmp
            save_s = time.monotonic() - t0 - boot_s
        except BaseException:
            try:
                vm.stop()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        info = vm.info()
        snap = {
            "dir": sdir,
            "variant": variant,
            "image": image,
            "image_key": info["image_key"],
            "mem": mem,
            "mem_mib": mem_mib(mem),
            "smp": smp,
            "qemu": qemu_version(),
            "machine_layout": MACHINE_LAYOUT,
            "disk": os.path.join(sdir, "snapshot-disk.qcow2"),
            "mem_state": os.path.join(sdir, "mem.state"),
            "mem_state_bytes": os.path.getsize(mem_state),
            "key": os.path.join(sdir, "id_ed25519"),
            "system_state": state,
            "boot_seconds": round(boot_s, 1),
            "save_seconds": round(save_s, 1),
            "created_at": time.time(),
        }
        for junk in ("qmp.sock", "qemu.pid"):
            if os.path.lexists(os.path.join(tmp, junk)):
                os.unlink(os.path.join(tmp, junk))
        write_json(os.path.join(tmp, "manifest.json"), snap)
        if os.path.exists(sdir):
            shutil.rmtree(sdir)
        os.rename(tmp, sdir)
        log(f"snapshot: saved {snap['mem_state_bytes'] / 2**20:.0f} MiB RAM state in "
            f"{save_s:.1f}s: {sdir}")
        prune_snapshots(sdir)
        return snap


def save_running(vm: VM, sdir: str, label: dict) -> dict:
    """Freeze a running VM (restored, then provisioned, e.g. with a serving engine) into a
    snapshot of its own at sdir; `label` says what it holds. The VM is gone afterwards."""
    if not vm.running():
        raise TestbedError(f"the VM in {vm.state} is not running")
    info = vm.info()
    tmp = f"{sdir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    log(f"snapshot: saving the running VM {vm.state} as {sdir}")
    try:
        mem_state = _freeze(vm, tmp)
        shutil.copy(vm.key, os.path.join(tmp, "id_ed25519"))  # the key the saved guest trusts
        vm.stop()
    except BaseException:
        vm.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    snap = {k: info[k] for k in ("variant", "image", "image_key", "mem", "smp")}
    snap.update(dir=sdir, parent=info.get("snapshot"), label=label, mem_mib=mem_mib(info["mem"]),
                qemu=qemu_version(), machine_layout=MACHINE_LAYOUT,
                disk=os.path.join(sdir, "snapshot-disk.qcow2"), mem_state=os.path.join(sdir, "mem.state"),
                mem_state_bytes=os.path.getsize(mem_state), key=os.path.join(sdir, "id_ed25519"),
                save_seconds=round(time.monotonic() - t0, 1), created_at=time.time())
    write_json(os.path.join(tmp, "manifest.json"), snap)
    shutil.rmtree(sdir, ignore_errors=True)
    os.rename(tmp, sdir)
    log(f"snapshot: saved {snap['mem_state_bytes'] / 2**20:.0f} MiB RAM state in {snap['save_seconds']}s: {sdir}")
    return snap


def prune_snapshots(keep: str) -> None:
    """Delete snapshots of the same size made by an older machine layout, unless in use."""
    parent, name = os.path.split(keep)
    prefix = name.rsplit("-", 1)[0] + "-"
    in_use = ""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        in_use += pid_cmdline(int(pid)) + "\n"
    for other in os.listdir(parent):
        path = os.path.join(parent, other)
        if (other.startswith(prefix) and path != keep and os.path.isdir(path)
                and "." not in other and path + "/" not in in_use):
            log(f"snapshot: deleting stale {path}")
            shutil.rmtree(path, ignore_errors=True)


def restore(vm: VM, variant: str, mem: str, smp: int, forwards: list[str],
            create: bool = True, snapshot: str | None = None, ssh_port: int = 0) -> dict:
    """Start a VM from the image's booted snapshot, or from `snapshot` (one save_running made)."""
    t0 = time.monotonic()
    if snapshot:
        sdir = os.path.abspath(snapshot)
        if not os.path.exists(os.path.join(sdir, "manifest.json")):
            raise TestbedError(f"no snapshot in {sdir} (manifest.json missing)")
        saved = load_json(os.path.join(sdir, "manifest.json"))
        variant, mem, smp = saved["variant"], saved["mem"], saved["smp"]
    image = image_dir(variant)
    sdir = sdir if snapshot else snapshot_dir(image, mem, smp)
    if not os.path.exists(os.path.join(sdir, "manifest.json")):
        if not create:
            raise TestbedError(f"no snapshot for {variant} {mem} {smp} vCPU: "
                               f"run 'vm.py snapshot --variant {variant} --mem {mem}'")
        make_snapshot(variant, mem, smp)
        t0 = time.monotonic()
    snap = load_json(os.path.join(sdir, "manifest.json"))
    info = vm.launch(variant=variant, mem=mem, smp=smp, forwards=forwards, mode="restore", ssh_port=ssh_port,
                     image=image, backing=snap["disk"], snapshot=sdir,
                     incoming=f"exec:cat {snap['mem_state']}")
    q = vm.qmp()
    try:
        deadline = time.monotonic() + 120
        while True:
            st = q.cmd("query-status")["status"]
            if st not in ("inmigrate", "prelaunch"):
                break
            if time.monotonic() > deadline:
                raise TestbedError(f"incoming migration did not finish (status {st})")
            time.sleep(0.05)
        mig = q.cmd("query-migrate")
        if mig.get("status") not in (None, "completed"):
            raise TestbedError(f"incoming migration failed: {mig}")
        loaded_s = time.monotonic() - t0
        q.cmd("cont")
    finally:
        q.close()
    # The guest still trusts the snapshot's key and its clock is at snapshot
    # time. In one ssh session: install this VM's own key (only), then set the
    # clock from the host the moment the guest says it is ready (so the ssh
    # handshake does not count as clock error), then reseed the guest RNG,
    # which is a byte-for-byte copy of the snapshot's.
    guest = (
        "set -e; umask 077; IFS= read -r newkey; "
        "printf '%s\\n' \"$newkey\" > /root/.ssh/authorized_keys.new; "
        "mv /root/.ssh/authorized_keys.new /root/.ssh/authorized_keys; "
        "echo ready; read -r t seed; date -u -s \"@$t\" > /dev/null; "
        "printf '%s' \"$seed\" | python3 -c 'import fcntl, os, sys; "
        "fd = os.open(\"/dev/urandom\", os.O_WRONLY); os.write(fd, bytes.fromhex(sys.stdin.read())); "
        "fcntl.ioctl(fd, 0x5207)' > /dev/null 2>&1 & echo done"
    )
    argv = vm.ssh_argv(key=snap["key"], mux=False) + ["--", guest]
    deadline = time.monotonic() + 120
    while True:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            p.stdin.write(vm.pubkey() + "\n")
            p.stdin.flush()
            ready = p.stdout.readline().strip()
            line = f"{time.time():.6f} {os.urandom(64).hex()}\n" if ready == "ready" else ""
            out, err = p.communicate(input=line, timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired) as e:
            p.kill()
            out, err = p.communicate()
            err = f"{err} {e}"
        if ready == "ready" and p.returncode == 0 and "done" in out:
            break
        if time.monotonic() > deadline or not vm.running():
            raise TestbedError(f"post-restore ssh setup failed: {err.strip()[-400:]}")
        time.sleep(0.5)
    total_s = time.monotonic() - t0
    info = vm.update_info(timings={"restore_load_s": round(loaded_s, 2),
                                   "restore_to_ssh_s": round(total_s, 2)})
    log(f"restored from {sdir}: state loaded in {loaded_s:.1f}s, ssh ready in {total_s:.1f}s")
    return info
