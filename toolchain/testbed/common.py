"""The testbed's shared parts: paths, settings, logging, process helpers and the QMP client."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
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
    # The image is keyed by its pins: this machine's pip settings (PIP_FIND_LINKS=/opt/wheels here,
    # a directory the chroot lacks: 166 warnings per vllm build) must not reach the chroot's pip.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    out = subprocess.run(["bash", BUILD_IMAGE, "--variant", variant], stdout=subprocess.PIPE,
                         text=True, env=env)
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
