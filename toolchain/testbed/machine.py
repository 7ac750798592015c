"""One QEMU (TCG) VM, its state directory and its ssh access (vm.py's subcommands drive it)."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

from common import (CPU_MODEL, KERNEL_ARGS, QEMU, QMP, SSH_USER, TestbedError,
                    free_port, image_dir, load_json, log, need, pid_alive, pid_cmdline, write_json)


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
