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
import base64
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_IMAGE = os.path.join(HERE, "build-image.sh")
CACHE_ROOT = os.environ.get("FIMFLEET_CACHE") or os.path.expanduser("~/.cache/fimfleet")
TB_CACHE = os.path.join(CACHE_ROOT, "testbed")
QEMU = os.environ.get("FIMFLEET_QEMU", "qemu-system-x86_64")
# Bump when the QEMU machine/device layout below changes: saved snapshots
# must be restored into an identical machine.
MACHINE_LAYOUT = "v1"
DEFAULT_MEM = os.environ.get("FIMFLEET_TESTBED_MEM", "8G")
DEFAULT_SMP = int(os.environ.get("FIMFLEET_TESTBED_SMP", "2"))
# TCG "max" has AVX2 (QEMU >= 7.2) but no AVX-512.
CPU_MODEL = os.environ.get("FIMFLEET_TESTBED_CPU", "max")
KERNEL_ARGS = "root=/dev/vda rw console=ttyS0,115200 " + os.environ.get("FIMFLEET_TESTBED_KERNEL_ARGS", "")
SSH_USER = "root"
T0 = time.monotonic()


class TestbedError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[vm {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True), flush=True)


# ------------------------------------------------------------------ helpers

def need(cmd: str, pkg: str) -> str:
    path = shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin:/usr/bin")
    if path:
        return path
    if shutil.which("apt-get") and os.geteuid() == 0:
        log(f"installing missing prerequisite {pkg}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], stdout=sys.stderr, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", pkg], stdout=sys.stderr, env=env)
        path = shutil.which(cmd)
        if path:
            return path
    raise TestbedError(f"missing '{cmd}': install it with 'apt-get install -y {pkg}'")


def image_dir(variant: str) -> str:
    """Build (or reuse) the image for `variant`; return its cache directory."""
    out = subprocess.run(["bash", BUILD_IMAGE, "--variant", variant], stdout=subprocess.PIPE,
                         text=True)
    if out.returncode != 0:
        raise TestbedError(f"build-image.sh --variant {variant} failed (exit {out.returncode})")
    d = out.stdout.strip().splitlines()[-1]
    if not os.path.isfile(os.path.join(d, "manifest.json")):
        raise TestbedError(f"build-image.sh returned {d}, which has no manifest.json")
    return d


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pid_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def mem_mib(mem: str) -> int:
    m = mem.strip().upper().rstrip("B")
    mult = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    if m and m[-1] in mult:
        return int(float(m[:-1]) * mult[m[-1]])
    return int(m)


def qemu_version() -> str:
    out = subprocess.run([need(QEMU, "qemu-system-x86"), "--version"], stdout=subprocess.PIPE,
                         text=True, check=True).stdout
    return out.splitlines()[0].strip()


# ------------------------------------------------------------------ QMP

class QMP:
    """Minimal QMP client over a unix socket."""

    def __init__(self, path: str, timeout: float = 30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TestbedError(f"QMP socket {path} did not come up")
                time.sleep(0.05)
        self.buf = b""
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise TestbedError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, name: str, **args):
        msg = {"execute": name}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            r = self._read()
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise TestbedError(f"QMP {name}: {r['error'].get('desc', r['error'])}")
            # else: an asynchronous event; ignore

    def hmp(self, line: str) -> str:
        return self.cmd("human-monitor-command", **{"command-line": line})

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ------------------------------------------------------------------ the VM

class VM:
    def __init__(self, state: str):
        self.state = os.path.abspath(state)
        self.info_path = os.path.join(self.state, "info.json")
        self.pidfile = os.path.join(self.state, "qemu.pid")
        self.overlay = os.path.join(self.state, "disk.qcow2")
        self.serial = os.path.join(self.state, "serial.log")
        self.key = os.path.join(self.state, "id_ed25519")
        self.known_hosts = os.path.join(self.state, "known_hosts")
        qmp = os.path.join(self.state, "qmp.sock")
        if len(qmp) > 100:  # sun_path limit is 108 bytes
            h = hashlib.sha256(self.state.encode()).hexdigest()[:16]
            qmp = os.path.join(tempfile.gettempdir(), f"fimfleet-qmp-{h}.sock")
        self.qmp_path = qmp
        mux = os.path.join(self.state, "ssh.mux")
        if len(mux) > 90:  # ssh appends a random suffix while it binds
            h = hashlib.sha256(self.state.encode()).hexdigest()[:16]
            mux = os.path.join(tempfile.gettempdir(), f"fimfleet-ssh-{h}.mux")
        self.mux_path = mux

    # -- info
    def info(self) -> dict:
        if not os.path.exists(self.info_path):
            raise TestbedError(f"no VM state in {self.state} (info.json missing)")
        return load_json(self.info_path)

    def pid(self) -> int | None:
        try:
            with open(self.pidfile) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        # Only trust the pid if it is still our qemu (pids get reused).
        if pid_alive(pid) and self.qmp_path in pid_cmdline(pid):
            return pid
        return None

    def running(self) -> bool:
        return self.pid() is not None

    def status(self) -> dict:
        info = self.info()
        pid = self.pid()
        info["running"] = pid is not None
        info["pid"] = pid
        return info

    # -- ssh
    def ensure_key(self) -> None:
        if not os.path.exists(self.key):
            subprocess.run([need("ssh-keygen", "openssh-client"), "-q", "-t", "ed25519", "-N", "",
                            "-C", f"fimfleet-testbed@{os.path.basename(self.state)}",
                            "-f", self.key], check=True)
        os.chmod(self.key, 0o600)

    def pubkey(self) -> str:
        with open(self.key + ".pub") as f:
            return f.read().strip()

    @staticmethod
    def ssh_argv_for(port: int, key: str, known_hosts: str, connect_timeout: int = 10,
                     control_path: str | None = None) -> list[str]:
        """ssh argv (without the command). With control_path, connections are
        multiplexed over one master (ControlPersist): a fresh ssh login costs
        about 3 s of emulated CPU in the guest, a multiplexed one a few ms."""
        mux = (["-o", "ControlMaster=auto", "-o", f"ControlPath={control_path}",
                "-o", "ControlPersist=60"] if control_path else
               ["-o", "ControlMaster=no", "-o", "ControlPath=none"])
        return [
            "ssh", "-F", "/dev/null",  # ignore user/system ssh_config (SendEnv LANG etc.)
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", f"IdentityFile={key}",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "LogLevel=ERROR", "-o", f"ConnectTimeout={connect_timeout}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=8", *mux,
            "-p", str(port), f"{SSH_USER}@127.0.0.1",
        ]

    def ssh_argv(self, key: str | None = None, connect_timeout: int = 10,
                 mux: bool = True) -> list[str]:
        info = self.info()
        return self.ssh_argv_for(info["ssh"]["port"], key or self.key, self.known_hosts,
                                 connect_timeout,
                                 self.mux_path if mux and key in (None, self.key) else None)

    def close_mux(self) -> None:
        if os.path.exists(self.mux_path):
            subprocess.run(["ssh", "-F", "/dev/null", "-o", f"ControlPath={self.mux_path}",
                            "-O", "exit", "fimfleet-testbed"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=10)
            if os.path.lexists(self.mux_path):
                os.unlink(self.mux_path)

    def ssh_run(self, command: str, timeout: float = 600, key: str | None = None,
                input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        argv = self.ssh_argv(key=key) + ["--", command]
        r = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise TestbedError(f"ssh command failed (exit {r.returncode}): {command!r}: "
                               f"{r.stderr.strip()[-500:]}")
        return r

    def wait_ssh(self, timeout: float = 600, key: str | None = None) -> float:
        t = time.monotonic()
        deadline = t + timeout
        argv = self.ssh_argv(key=key, connect_timeout=5, mux=False) + ["--", "true"]
        while True:
            if not self.running():
                raise TestbedError(f"qemu is not running (see {self.serial} and "
                                   f"{os.path.join(self.state, 'qemu.log')})")
            try:
                r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, timeout=30)
                if r.returncode == 0:
                    return time.monotonic() - t
                err = r.stderr.strip()
            except subprocess.TimeoutExpired:
                err = "ssh timed out"
            if time.monotonic() > deadline:
                raise TestbedError(f"ssh did not answer within {timeout:.0f}s ({err}); "
                                   f"see {self.serial}")
            time.sleep(1)

    # -- qemu
    def _qemu_argv(self, image: str, manifest: dict, mem: str, smp: int,
                   fwd: list[tuple[int, int]], append: str, incoming: str | None) -> list[str]:
        hostfwd = ",".join(f"hostfwd=tcp:127.0.0.1:{h}-:{g}" for h, g in fwd)
        argv = [
            need(QEMU, "qemu-system-x86"),
            "-name", f"fimfleet-testbed,debug-threads=on",
            "-nodefaults", "-no-user-config",
            "-machine", "pc", "-accel", "tcg,thread=multi", "-cpu", CPU_MODEL,
            "-smp", str(smp), "-m", mem,
            "-kernel", os.path.join(image, manifest["vmlinuz"]),
            "-initrd", os.path.join(image, manifest["initrd"]),
            "-append", append,
            "-drive", f"file={self.overlay},format=qcow2,if=none,id=root,cache=unsafe,discard=unmap",
            "-device", "virtio-blk-pci,drive=root",
            "-netdev", f"user,id=net0,{hostfwd}",
            "-device", "virtio-net-pci,netdev=net0",
            "-device", "virtio-rng-pci",
            "-display", "none", "-vga", "none",
            "-chardev", f"file,id=ser0,path={self.serial}", "-serial", "chardev:ser0",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-pidfile", self.pidfile, "-daemonize",
        ]
        if incoming:
            argv += ["-incoming", incoming]
        return argv

    def launch(self, *, variant: str, mem: str, smp: int, forwards: list[str], backing: str,
               mode: str, incoming: str | None = None, snapshot: str | None = None,
               image: str | None = None, ssh_port: int = 0) -> dict:
        """Create the overlay, pick ports and start qemu (daemonized)."""
        if self.running():
            raise TestbedError(f"a VM is already running in {self.state} (pid {self.pid()}); "
                               f"stop it first")
        os.makedirs(self.state, exist_ok=True)
        image = image or image_dir(variant)
        manifest = load_json(os.path.join(image, "manifest.json"))
        self.ensure_key()
        self.close_mux()
        for p in (self.overlay, self.pidfile, self.qmp_path):
            if os.path.lexists(p):
                os.unlink(p)
        subprocess.run([need("qemu-img", "qemu-utils"), "create", "-q", "-f", "qcow2",
                        "-F", "qcow2", "-b", backing, self.overlay], check=True)
        wanted = parse_forwards(forwards)
        key_b64 = base64.b64encode(self.pubkey().encode()).decode()
        append = f"{KERNEL_ARGS.strip()} fimfleet.authorized_key={key_b64}"
        qemu_log = os.path.join(self.state, "qemu.log")
        for attempt in range(5):
            ports = {22: ssh_port or free_port()}
            fwd = [(ports[22], 22)]
            for host, guest in wanted:
                ports[guest] = host or free_port()
                fwd.append((ports[guest], guest))
            argv = self._qemu_argv(image, manifest, mem, smp, fwd, append, incoming)
            with open(qemu_log, "w") as lf:
                lf.write(" ".join(argv) + "\n")
                lf.flush()
                r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf)
            if r.returncode == 0:
                break
            with open(qemu_log) as lf:
                err = lf.read().strip().splitlines()[-1:]
            if "host forwarding" in " ".join(err) and attempt < 4 and not ssh_port and not any(h for h, _ in wanted):
                continue  # port race: pick new ports
            raise TestbedError(f"qemu failed to start: {' '.join(err)} (full log: {qemu_log})")
        with open(self.known_hosts, "w") as f:
            f.write(f"[127.0.0.1]:{ports[22]} {manifest['host_key']}\n")
        info = {
            "name": os.path.basename(self.state),
            "state_dir": self.state,
            "mode": mode,
            "variant": manifest["variant"],
            "image": image,
            "image_key": manifest["key"],
            "snapshot": snapshot,
            "mem": mem,
            "smp": smp,
            "ssh": {
                "host": "127.0.0.1", "port": ports[22], "user": SSH_USER,
                "key": self.key, "public_key": self.pubkey(),
                "known_hosts": self.known_hosts, "host_key": manifest["host_key"],
            },
            "ports": {str(g): h for g, h in sorted(ports.items())},
            "ssh_command": self.ssh_argv_for(ports[22], self.key, self.known_hosts,
                                             control_path=self.mux_path),
            "overlay": self.overlay,
            "pidfile": self.pidfile,
            "qmp_socket": self.qmp_path,
            "serial_log": self.serial,
            "qemu_log": qemu_log,
            "started_at": time.time(),
            "timings": {},
        }
        write_json(self.info_path, info)
        return info

    def update_info(self, **kv) -> dict:
        info = self.info()
        for k, v in kv.items():
            if k == "timings":
                info["timings"].update(v)
            else:
                info[k] = v
        write_json(self.info_path, info)
        return info

    def qmp(self, timeout: float = 30.0) -> QMP:
        return QMP(self.qmp_path, timeout)

    def stop(self, timeout: float = 15.0, purge: bool = False) -> dict:
        pid = self.pid()
        try:
            self.close_mux()
        except (OSError, subprocess.SubprocessError):
            pass
        if pid is not None:
            try:
                q = self.qmp(timeout=5)
                try:
                    q.cmd("quit")
                except (TestbedError, OSError):
                    pass  # the connection drops as qemu exits
                q.close()
            except (TestbedError, OSError):
                pass
            deadline = time.monotonic() + timeout
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if not pid_alive(pid):
                    break
                os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if pid_alive(pid):
                raise TestbedError(f"qemu pid {pid} did not exit")
        for p in (self.overlay, self.pidfile, self.qmp_path):
            if os.path.lexists(p):
                os.unlink(p)
        if purge:
            shutil.rmtree(self.state, ignore_errors=True)
            return {"state_dir": self.state, "running": False, "stopped_pid": pid, "purged": True}
        if os.path.exists(self.info_path):
            info = self.update_info(stopped_at=time.time())
        else:
            info = {"state_dir": self.state}
        info.update(running=False, pid=None, stopped_pid=pid, purged=False)
        return info


def parse_forwards(specs: list[str]) -> list[tuple[int, int]]:
    """'443' -> (0, 443) (free host port); '8443:443' -> (8443, 443)."""
    out = []
    for s in specs or []:
        for part in s.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                if ":" in part:
                    h, g = part.split(":", 1)
                    out.append((int(h), int(g)))
                else:
                    out.append((0, int(part)))
            except ValueError:
                raise TestbedError(f"bad --forward '{part}': use GUEST or HOST:GUEST (tcp ports)")
    if any(g == 22 for _, g in out):
        raise TestbedError("guest port 22 is always forwarded; do not pass it to --forward")
    return out


# ------------------------------------------------------------------ snapshots

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
