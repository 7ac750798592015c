"""End-to-end tests of the local test "VPS" (toolchain/testbed): plain pytest, no Pulumi.

They restore a VM from the cached RAM snapshot into a temporary state directory,
talk to it over ssh and stop it. The first run on a machine builds the image
(about 3 min) and the snapshot (about 1-2 min); later runs restore in seconds.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTBED = REPO / "toolchain" / "testbed"
VM_PY = TESTBED / "vm.py"
BUILD_IMAGE = TESTBED / "build-image.sh"
# Small guest RAM keeps the tests light; it gets its own cached snapshot.
MEM = os.environ.get("FIMFLEET_TEST_VM_MEM", "2G")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (debootstrap, chroot)"),
    pytest.mark.skipif(sys.platform != "linux", reason="the testbed needs Linux"),
]


def vm(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(VM_PY), *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"vm.py {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def vm_json(*args: str, timeout: float = 600) -> dict:
    return json.loads(vm(*args, timeout=timeout).stdout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="session")
def snapshot() -> dict:
    """The cached snapshot (built once per image recipe; a no-op afterwards)."""
    return vm_json("snapshot", "--mem", MEM, timeout=3600)


@pytest.fixture(scope="module")
def running_vm(snapshot, tmp_path_factory):
    state = tmp_path_factory.mktemp("testbed") / "vm"
    info = vm_json("restore", "--state", str(state), "--mem", MEM, "--forward", "8080",
                   timeout=300)
    yield info
    vm("stop", "--state", str(state), "--purge", check=False, timeout=120)


def test_build_image_is_cached_noop():
    t = time.monotonic()
    r = subprocess.run(["bash", str(BUILD_IMAGE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=3600)
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip().splitlines()[-1])
    assert (out / "manifest.json").is_file()
    assert (out / "rootfs.qcow2").is_file() and (out / "vmlinuz").is_file()
    # Second call must be a no-op that takes seconds.
    t = time.monotonic()
    r2 = subprocess.run(["bash", str(BUILD_IMAGE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, timeout=60)
    assert r2.returncode == 0 and r2.stdout.strip().splitlines()[-1] == str(out)
    assert time.monotonic() - t < 10


def test_restore_ssh_stop_lifecycle(snapshot, tmp_path):
    state = tmp_path / "vm"
    t = time.monotonic()
    info = vm_json("restore", "--state", str(state), "--mem", MEM, timeout=300)
    restore_s = time.monotonic() - t
    pid = info["pid"]
    overlay = Path(info["overlay"])
    assert info["running"] is True and pid and pid_alive(pid)
    assert info["mode"] == "restore" and info["snapshot"] == snapshot["dir"]
    assert overlay.is_file() and overlay.parent == state
    assert info["ssh"]["host"] == "127.0.0.1" and info["ssh"]["user"] == "root"
    assert Path(info["ssh"]["key"]).parent == state
    # Restoring is meant to take seconds, not a cold boot's minute or more.
    assert restore_s < 90, f"restore took {restore_s:.1f}s"

    # The JSON's ssh_command works on its own, with this VM's own key.
    r = subprocess.run(info["ssh_command"] + ["--", "echo hello-from-$(hostname)"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hello-from-fimfleet-vps"
    # ...and the snapshot's key no longer gets in.
    r = subprocess.run(
        ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
         "-o", f"IdentityFile={snapshot['key']}", "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "ControlPath=none",
         "-p", str(info["ssh"]["port"]), "root@127.0.0.1", "true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode != 0

    # vm.py ssh passes the exit code through.
    assert vm("ssh", "--state", str(state), "--", "exit 7", check=False).returncode == 7

    stopped = vm_json("stop", "--state", str(state), timeout=120)
    assert stopped["running"] is False and stopped["stopped_pid"] == pid
    assert not pid_alive(pid)
    assert not overlay.exists()
    assert not (state / "qemu.pid").exists()
    assert vm_json("status", "--state", str(state))["running"] is False
    # Stopping twice is harmless.
    assert vm_json("stop", "--state", str(state))["running"] is False


def test_guest_is_a_tunable_vps(running_vm):
    res = json.loads(vm("check", "--state", running_vm["state_dir"], timeout=300).stdout)
    assert res["pid1"] == "systemd"
    assert res["systemd"] in ("running", "degraded")
    assert res["sysctl_swappiness"] == "ok"
    assert res["thp_writable"] == "ok"
    assert res["avx2"] > 0 and res["avx512f"] == 0
    assert res["nproc"] == 2
    # the restore reset the guest clock to the host's
    assert abs(res["clock_skew_s"]) < 5, res


def test_forwarded_port_reaches_guest(running_vm):
    host_port = running_vm["ports"]["8080"]
    vm("ssh", "--state", running_vm["state_dir"], "--",
       "systemd-run --unit=fimfleet-test-http python3 -m http.server 8080 --directory /etc",
       timeout=120)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{host_port}/hostname", timeout=10) as r:
                assert r.read().decode().strip() == "fimfleet-vps"
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_status_json_shape(running_vm):
    st = vm_json("status", "--state", running_vm["state_dir"])
    for key in ("state_dir", "running", "pid", "ssh", "ports", "ssh_command", "overlay",
                "serial_log", "qmp_socket", "image", "variant", "mem", "smp"):
        assert key in st, key
    assert st["running"] is True
    assert st["ports"]["22"] == st["ssh"]["port"]
    assert set(st["ssh"]) >= {"host", "port", "user", "key", "known_hosts", "host_key"}
    assert Path(st["serial_log"]).exists()  # empty after a restore: nothing new printed
    assert shutil.which("ssh")
