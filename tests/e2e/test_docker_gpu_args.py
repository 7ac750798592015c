"""The GPU tiers' engine containers as Docker itself reads them (issue 14): the `docker run`
of each tier's rendered unit, turned into `docker create` on a test VM whose dockerd is real
(the testbed's `docker` image variant), then `docker inspect`ed. No GPU is needed to create a
container, only to start it, so this checks what the CLI and the daemon make of every flag:
device requests, shared memory, memlock, read-only root, dropped capabilities.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components import config, runtime
from components.tiers import TIERS
from tests.helpers import raw_config

REPO = Path(__file__).resolve().parents[2]
VM_PY = REPO / "toolchain" / "testbed" / "vm.py"
MEM = os.environ.get("FIMFLEET_TEST_VM_MEM", "2G")
IMAGE = "fimfleet-test/empty:1"
"""An empty image (`docker import` of an empty tarball): creating needs an image, not a runnable one."""
GPU_TIERS = sorted(name for name, t in TIERS.items() if t.device == "gpu" and not t.test_only)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def vm_json(*args: str, timeout: float = 3600) -> dict:
    r = subprocess.run([sys.executable, str(VM_PY), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"vm.py {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def sh(tmp_path_factory):
    """A shell on a fresh VM of the `docker` variant (restored from its booted snapshot)."""
    state = tmp_path_factory.mktemp("docker") / "vm"
    info = vm_json("restore", "--variant", "docker", "--state", str(state), "--mem", MEM)

    def run(script: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run(info["ssh_command"] + ["--", script], capture_output=True, text=True, timeout=timeout)
        assert not check or r.returncode == 0, f"{script[:200]}: exit {r.returncode}\n{r.stderr[-2000:]}"
        return r

    try:
        deadline = time.monotonic() + 180
        while run("docker info >/dev/null 2>&1", check=False).returncode != 0:
            assert time.monotonic() < deadline, run("systemctl status docker --no-pager", check=False).stdout
            time.sleep(2)
        run(f"docker image inspect {IMAGE} >/dev/null 2>&1 || tar -cf - --files-from /dev/null | docker import - {IMAGE}")
        yield run
    finally:
        subprocess.run([sys.executable, str(VM_PY), "stop", "--state", str(state), "--purge"],
                       capture_output=True, timeout=120)


def docker_run_argv(unit_file: str) -> list[str]:
    """ExecStart of the engine's unit, its continuation lines joined, split as systemd does."""
    line = next(ln for ln in unit_file.replace("\\\n", " ").splitlines() if ln.startswith("ExecStart="))
    argv = shlex.split(line[len("ExecStart="):])
    assert argv[:2] == ["/usr/bin/docker", "run"], argv[:4]
    return argv


def create(sh, cfg: config.StackConfig, name: str) -> tuple[dict, runtime.RenderedRuntime]:
    """The rendered `docker run` as `docker create` under `name`, with the env file in place."""
    r = runtime.render(cfg, "node")
    argv = docker_run_argv(r.unit_file)
    image = runtime.image_ref(cfg)
    at, named = argv.index(image), argv.index("--name")
    argv = ["docker", "create", *argv[2:named + 1], name, *argv[named + 2:at], IMAGE, *argv[at + 1:]]
    env_path = runtime.unit_paths("node")[2]
    sh(f"mkdir -p {shlex.quote(os.path.dirname(env_path))} && printf %s {shlex.quote(r.env_file)} > {shlex.quote(env_path)}"
       f" && docker rm -f {name} >/dev/null 2>&1; {shlex.join(argv)} >/dev/null")
    return json.loads(sh(f"docker inspect {name}").stdout)[0], r


def hardening_problems(c: dict, shm_gib: int, gpus: str, cap_add: tuple) -> list[str]:
    """What the engine container must be, read back from `docker inspect`."""
    hc, out = c["HostConfig"], []
    wants_gpu = {"count": -1 if gpus == "all" else int(gpus or 0), "capabilities": [["gpu"]]}
    got_gpu = [{"count": d.get("Count"), "capabilities": d.get("Capabilities")} for d in hc.get("DeviceRequests") or []]
    if got_gpu != ([wants_gpu] if gpus else []):
        out.append(f"device requests {got_gpu}, want {wants_gpu}")
    if hc.get("IpcMode") != "host" and hc.get("ShmSize") != shm_gib * 2**30:
        out.append(f"shm {hc.get('ShmSize')} (ipc {hc.get('IpcMode')}), want {shm_gib} GiB")
    if {"Name": "memlock", "Soft": -1, "Hard": -1} not in (hc.get("Ulimits") or []):
        out.append(f"ulimits {hc.get('Ulimits')}, want memlock unlimited")
    if not hc.get("ReadonlyRootfs") or "/tmp" not in (hc.get("Tmpfs") or {}):
        out.append(f"read-only root {hc.get('ReadonlyRootfs')}, tmpfs {hc.get('Tmpfs')}")
    if hc.get("CapDrop") != ["ALL"] or sorted(hc.get("CapAdd") or []) != sorted(cap_add):
        out.append(f"capabilities: drop {hc.get('CapDrop')}, add {hc.get('CapAdd')}; want drop ALL, add {list(cap_add)}")
    if "no-new-privileges" not in (hc.get("SecurityOpt") or []):
        out.append(f"security options {hc.get('SecurityOpt')}, want no-new-privileges")
    if hc.get("NetworkMode") != "host":
        out.append(f"network {hc.get('NetworkMode')}, want host")
    if hc.get("Init") is not True:  # a Python PID 1 would ignore docker stop's SIGTERM during the start
        out.append(f"init {hc.get('Init')}, want docker's init as PID 1")
    return out


@pytest.mark.parametrize("tier", GPU_TIERS)
def test_each_gpu_tiers_engine_container_is_what_docker_creates(sh, tier):
    raw, secret = raw_config(tier)
    cfg = config.parse(raw, secret)
    c, r = create(sh, cfg, f"fimfleet-{tier}")
    need = r.launch.container
    assert hardening_problems(c, need.shm_size_gib, need.gpus, need.cap_add) == []
    hc = c["HostConfig"]
    assert hc["Memory"] == hc["MemorySwap"] == runtime.memory_max_mib(cfg) * 2**20
    assert f"{runtime.STATE_DIR}:{runtime.STATE_DIR}:ro" in hc["Binds"]
    assert f"{runtime.WRITABLE_DIR}:{runtime.WRITABLE_DIR}" in hc["Binds"]
    # HF_HOME and HOME are inside the one writable mount, at the same paths as on the host
    env = dict(e.split("=", 1) for e in c["Config"]["Env"])
    assert env["HOME"].startswith(runtime.WRITABLE_DIR + "/") and env["HF_HOME"].startswith(runtime.WRITABLE_DIR + "/")
    # the engine's arguments reach the image's entry point unchanged, and health is checked
    assert c["Config"]["Cmd"] == list(r.launch.args)
    assert c["Config"]["Healthcheck"]["Test"] == ["CMD-SHELL", f"python3 {runtime.HEALTH_SCRIPT}"]
    assert f"{runtime.HEALTH_SCRIPT}:{runtime.HEALTH_SCRIPT}:ro" in hc["Binds"]
    assert env["FIMFLEET_ENGINE_PORT"] == str(cfg.engine.port)
    # any image runs as the uid that owns the writable mount on the host, never as root
    assert c["Config"]["User"] == f"{runtime.CONTAINER_UID}:{runtime.CONTAINER_UID}"
    assert c["Config"]["Image"] == IMAGE


def test_the_checks_see_a_container_without_the_hardening(sh):
    """Negative control: a bare `docker create` fails every check above."""
    sh(f"docker rm -f fimfleet-bare >/dev/null 2>&1; docker create --name fimfleet-bare {IMAGE} /bin/true >/dev/null")
    c = json.loads(sh("docker inspect fimfleet-bare").stdout)[0]
    found = hardening_problems(c, 16, "all", ())
    assert len(found) == 8, found
