"""End to end, the docker runtime (issue 14): the real CLI deploys the `local-docker` stack
onto a test VM whose dockerd pulls fimfleet's own engine image by digest from a real registry.

The image is built here (toolchain/image, cached by its pins) and pushed to Debian's
docker-registry on the host, which the guest reaches as 10.0.2.2. To keep CI time, the VM is
restored from a snapshot (scripts/engine_snapshot.py, docker-engine variant: that digest already in
its dockerd) in which the runtime's own steps started its container once, so the first `up` adopts it.
What stays real, in order: `up` through nginx and the SLA gate → the container's own health
check streams a token → a SIGSTOPped engine is stopped and its container started again by the
monitor → a new digest (the same layers, one more label) is pulled and rolls the container,
and the SLA gate runs again: the one engine start of this module → destroy removes the
container, every image it pulled (the host's own stays), and the unit.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from components import runtime
from scripts import local_deploy as ld
from tests.e2e.local_stack import (DOCKER_STACK, DOCKER_VARIANT, Node, docker_config, docker_engine, journal_cursor, live,
                                   one_completion, shown, unit_journal)
from tests.helpers import image_build

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(5400)]

STACK = DOCKER_STACK
CONTAINER = "vllm-node"
UNIT = runtime.unit_name("node")


@pytest.fixture(scope="module")
def node(tmp_path_factory, request):
    n = Node(tmp_path_factory.mktemp("e2e-docker"), stack=STACK)
    mp = pytest.MonkeyPatch()
    mp.setenv("FIMFLEET_BACKEND_URL", f"file://{n.tmp / 'state'}")
    try:  # a setup that fails part-way leaves no VM or registry running
        with live(request):
            paths = ld.prepare()
            engine = docker_engine()
        n.build, n.image_id, n.image = engine.build, engine.build.config_digest(engine.pushed), engine.image
        docker_config(n.config_file, n.state, paths["model_dir"], engine)
        with live(request):
            ld.start_vm(n.state, paths["wheelhouse"], serving_config=n.config_file, variant=DOCKER_VARIANT,
                        variant_env=engine.variant_env)
        t0 = time.monotonic()
        n.first_up = n.pulumi("up", "--yes", "--skip-preview")
        n.up_seconds = time.monotonic() - t0
        yield n
        n.pulumi("destroy", "--yes")
    finally:
        ld.stop_vm(n.state)
        image_build().stop_registry()  # `image push` may have started it before a failure
        mp.undo()


def inspect(node, what: str = CONTAINER) -> dict:
    code, out, err = node.ssh(f"docker inspect {shlex.quote(what)}")
    assert code == 0, err
    return json.loads(out)[0]


def wait_for(node, script: str, want, timeout_s: float, what: str) -> str:
    """Poll `script` on the VM until want(stdout) holds; its last output."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, out, _ = node.ssh(script)
        if want(out.strip()):
            return out.strip()
        assert time.monotonic() < deadline, f"{what}: still {out.strip()[-1500:]!r} after {timeout_s:.0f} s"
        time.sleep(5)


def runtime_step(node, name: str) -> dict:
    state = json.loads(ld.fimfleet_pulumi("stack", "export", "-s", STACK))
    return next(r for r in state["deployment"]["resources"] if r["urn"].endswith(f"::{name}"))


def test_01_up_runs_the_pulled_digest_and_passes_the_sla(node):
    assert node.first_up.returncode == 0, shown(node.first_up)
    out = node.outputs()
    assert out["slaPassed"] is True, out.get("slaReport")
    c = inspect(node)
    assert c["State"]["Running"] and c["Config"]["Image"] == node.image, c["Config"]["Image"]
    # What runs is the config the registry's manifest names, and the engine is not root.
    assert c["Image"] == node.image_id, (c["Image"], node.image_id)
    assert c["Config"]["User"] == f"{runtime.CONTAINER_UID}:{runtime.CONTAINER_UID}"
    code, _, err = node.ssh(f"systemctl is-active -q {UNIT}")
    assert code == 0, err
    one_completion(node)
    # Adopted, not started again: the container from the snapshot serves exactly these unit files.
    step = runtime_step(node, "node-runtime-service")
    assert json.loads(step["outputs"]["stdout"].strip().splitlines()[-1]) == {"ready_after_s": 0, "adopted": True}


def test_02_the_containers_own_health_check_streams_a_token(node):
    """docker's health state comes from files/image/health.py: one streamed token, not /health."""
    status = wait_for(node, f"docker inspect -f '{{{{.State.Health.Status}}}}' {CONTAINER}",
                      lambda s: s == "healthy", 240, "container health")
    assert status == "healthy"
    log = inspect(node)["State"]["Health"]["Log"]
    assert log and log[-1]["ExitCode"] == 0, log


def test_03_a_stopped_engine_is_killed_and_its_container_started_again(node):
    """The monitor's recovery on a SIGSTOP: the engine's API server (the child of the container's
    init) stops answering, the monitor restarts the unit, whose stop wakes it with SIGCONT before
    docker's SIGTERM, so it shuts down instead of waiting out the stop timeout for SIGKILL, and
    the unit runs a new one. The new engine then starts; test_04's roll replaces it and waits
    for it, so the module pays for one engine start."""
    before = inspect(node)
    cursor = journal_cursor(node.state)
    code, engine, err = node.ssh(f"pgrep -o -P {before['State']['Pid']}")  # PID 1 is docker's init
    assert code == 0, err
    engine = engine.strip()
    code, _, err = node.ssh(f"kill -STOP {engine}")
    assert code == 0, err
    new_id = wait_for(node, f"docker inspect -f '{{{{.Id}}}}' {CONTAINER} 2>/dev/null || true",
                      lambda s: s and s != before["Id"], 420, "a new engine container")
    after = inspect(node, new_id)
    assert after["State"]["Running"] and after["Config"]["Image"] == node.image
    _, journal, _ = node.ssh("journalctl -t fimfleet-monitor --no-pager -o cat | tail -n 20")
    assert f"hung: restarting {UNIT}" in journal, journal
    code, _, _ = node.ssh(f"test -d /proc/{engine}")
    assert code != 0, "the stopped engine process still exists"
    stopped = unit_journal(node.state, UNIT, cursor)
    assert "Application shutdown complete" in stopped and "status=137" not in stopped, stopped[-3000:]


def test_04_a_new_digest_rolls_the_container_and_the_sla_runs_again(node):
    report_before = node.outputs()["slaReport"]
    node.build.registry()  # idempotent: the guest pulls the new digest from it too
    pushed = node.build.relabel(node.image.replace(node.build.GUEST_REGISTRY, node.build.REGISTRY, 1),
                                "org.fimfleet.roll", "2")
    node.rolled = pushed.replace(node.build.REGISTRY, node.build.GUEST_REGISTRY, 1)
    assert node.rolled != node.image
    node.pulumi("config", "set", "--path", "fimfleet:runtime.image", node.rolled, check=True)
    cursor = journal_cursor(node.state)
    t0 = time.monotonic()
    proc = node.pulumi("up", "--yes", "--skip-preview")
    node.roll_seconds = time.monotonic() - t0
    assert proc.returncode == 0, shown(proc)
    assert "node-runtime-image" in proc.stdout and "node-runtime-service" in proc.stdout, shown(proc)
    c = inspect(node)
    assert c["State"]["Running"] and c["Config"]["Image"] == node.rolled
    assert c["Config"]["Labels"].get("org.fimfleet.roll") == "2"
    # test_03's engine was still starting: it ends on SIGTERM, not by SIGKILL after the stop timeout.
    rolled = unit_journal(node.state, UNIT, cursor)
    assert "status=137" not in rolled, rolled[-3000:]
    step = runtime_step(node, "node-runtime-service")
    started = json.loads(step["outputs"]["stdout"].strip().splitlines()[-1])
    assert started["adopted"] is False and started["ready_after_s"] > 0, started
    out = node.outputs()
    assert out["slaPassed"] is True and out["slaReport"] != report_before, out["slaReport"]
    one_completion(node)
    # The previous image stays until destroy: a rollback needs no pull. Only the one this step
    # pulled is fimfleet's: the first was in dockerd's store before (the docker-engine variant).
    _, listed, _ = node.ssh(f"cat {runtime.pulled_list('node')}")
    assert listed.split() == [node.rolled], listed


def test_05_destroy_removes_the_container_every_pulled_image_and_the_unit(node):
    """...and keeps the image the host had before fimfleet came (the variant's preloaded one)."""
    proc = node.pulumi("destroy", "--yes")
    assert proc.returncode == 0, shown(proc)
    images = list(dict.fromkeys([node.image, getattr(node, "rolled", node.image)]))
    code, out, err = node.ssh(
        # the session runs under set -e: every probe that may fail ends in || true
        f"command -v docker >/dev/null || echo no-docker; docker ps -aq --filter name={CONTAINER}; for i in {' '.join(map(shlex.quote, images))}; do "
        f"docker image inspect \"$i\" >/dev/null 2>&1 && echo \"left: $i\" || true; done; "
        f"ls /etc/systemd/system/{UNIT} {runtime.HEALTH_SCRIPT} {runtime.pulled_list('node')} 2>/dev/null || true; "
        f"systemctl is-active {UNIT} || true")
    assert code == 0, err
    assert out.splitlines() == [f"left: {node.image}", "inactive"], out
