"""The node's deep probe and recovery manager against a REAL vLLM engine behind REAL nginx.

Issue #5 item 3. Everything is real except systemd, which this machine does not have:

* vLLM CPU (cached venv, tiny random Qwen2 with a FIM tokenizer) on a high port, in its
  own process group, started and restarted by ``systemctl_shim.py``, which stands in for
  ``systemctl`` (it manages that one "unit" by its process group and logs every call;
  SIGTERM+SIGCONT then SIGKILL after the stop timeout, as systemd does);
* nginx rendered by ``components/ingress_render.py`` (TLS with a test CA, one named key);
* ``files/monitor/fim-probe.sh`` and ``files/monitor/recover.sh``, installed 0755 into a
  temp lib dir as on a host, with the env file rendered from ``monitor.env.j2``. The test
  stands in for the systemd timer: one ``recover.sh ENV_FILE`` round every
  ROUND_INTERVAL_S, never overlapping (a oneshot service does not overlap either).

Faults, in this order (each test starts from a serving engine):

1. none: HEALTHY_ROUNDS rounds, every probe ok, and NO restart/kill/start call;
2. a wrong key in the probe's key file: nginx answers 401, the probe exits 3 (configuration
   error), recover.sh logs it and exits 3 every round, the failure count stays 0 and the
   engine is NEVER restarted (a restart cannot fix a key);
3. SIGSTOP of the engine's process group: probes time out, after FAILURE_THRESHOLD
   failures recover.sh restarts the unit, and a real completion is served again within
   RECOVERY_BOUND_S of the fault;
4. SIGKILL of the engine's process group: same, within the same bound.

Measured detection (fault -> restart call) and recovery (fault -> first ok probe) times
are printed with ``pytest -s``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import systemctl_shim as shim  # noqa: E402
from components import templates  # noqa: E402
from test_nginx_ingress import Nginx, free_port, make_tls  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(420)]

MONITOR_FILES = REPO / "files" / "monitor"
SHIM = HERE / "systemctl_shim.py"
SERVED = "tiny-qwen2-fim"

ROUND_INTERVAL_S = 2       # the timer (15 s on a host; short here to keep the run lean)
FAILURE_THRESHOLD = 2
PROBE_TIMEOUT_S = 5
GRACE_S = 120              # engine start grace after our own restart (~40-60 s here)
STOP_TIMEOUT_S = 30        # the shim's TimeoutStopSec before SIGKILL
START_BOUND_S = 300        # first start of the engine (the box is shared and busy)
RECOVERY_BOUND_S = 180     # fault -> a real completion served again through nginx
HEALTHY_ROUNDS = 5
BAD_KEY_ROUNDS = FAILURE_THRESHOLD + 2

RESTART_VERBS = {"restart", "start", "stop", "kill"}
RESULTS: dict[str, dict] = {}


# ----------------------------------------------------------------------- fixtures


@dataclass
class Round:
    start: float   # time.time()
    end: float
    rc: int
    out: str
    last: str
    failures: str
    last_error: str

    def ok(self) -> bool:
        return self.rc == 0 and self.last.split()[1:2] == ["ok"]

    def __str__(self) -> str:
        return (f"[{self.start:.1f} +{self.end - self.start:.1f}s rc={self.rc} failures={self.failures}] "
                f"last={self.last!r} out={self.out.strip()!r}")


class MonitoredNode:
    """Engine (via the systemctl shim) + nginx + the installed monitor scripts."""

    def __init__(self, root: Path, vllm_python: str, model: Path):
        self.root = root
        self.unit = f"fimfleet-montest-{secrets.token_hex(3)}.service"
        self.state = Path("/run/fimfleet") / f"monitor-{self.unit.removesuffix('.service')}"
        self.shim_dir = root / "shim"
        self.bin = root / "bin"
        self.lib = root / "lib"
        for d in (self.shim_dir, self.bin, self.lib):
            d.mkdir()
        assert os.access(SHIM, os.X_OK), f"{SHIM} must be executable (git mode 100755)"
        for name in ("systemctl", "logger"):
            (self.bin / name).symlink_to(SHIM)
        self.env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                    "FIMFLEET_SYSTEMCTL_SHIM_DIR": str(self.shim_dir)}
        self.env.pop("PYTHONPATH", None)

        self.port = free_port()
        self.engine_log = root / "engine.log"
        engine_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
                      if k in os.environ}
        engine_env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
                          PYTHONWARNINGS="ignore::DeprecationWarning")
        (self.shim_dir / "unit.json").write_text(json.dumps({
            "unit": self.unit, "env": engine_env, "cwd": str(root), "log": str(self.engine_log),
            "stop_timeout_s": STOP_TIMEOUT_S,
            "argv": [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry",
                     "--model", str(model), "--served-model-name", SERVED,
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024"],
        }))

        self.tls = make_tls(root)
        self.key = secrets.token_urlsafe(24)
        self.nginx: Nginx | None = None

        # install the scripts as Monitor does on a host (0755 in a lib dir)
        for f in ("fim-probe.sh", "recover.sh"):
            shutil.copy(MONITOR_FILES / f, self.lib / f)
            (self.lib / f).chmod(0o755)
        self.key_file = root / "monitor.key"
        self.write_key(self.key)
        self.env_file = root / "monitor.env"

    # --- processes

    def start(self) -> None:
        t0 = time.monotonic()
        self.systemctl("start", self.unit)
        deadline = t0 + START_BOUND_S
        while not self._health():
            assert self.active(), f"engine exited during start:\n{self.engine_tail()}"
            assert time.monotonic() < deadline, f"engine not healthy after {START_BOUND_S}s:\n{self.engine_tail()}"
            time.sleep(1)
        RESULTS["first_start_s"] = round(time.monotonic() - t0, 1)
        self.nginx = Nginx(self.root / "nginx", self.tls, self.port, api_keys={"monitor": self.key}).start()
        self.env_file.write_text(templates.render(
            "monitor/monitor.env.j2", unit=self.unit, container="", service_user="",
            failure_threshold=FAILURE_THRESHOLD, grace_s=GRACE_S,
            probe_url=f"https://127.0.0.1:{self.nginx.https_port}", key_file=str(self.key_file),
            ca_file=str(self.tls.ca), probe_timeout_s=PROBE_TIMEOUT_S, model=SERVED))

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        pgids = [int(x) for x in (self.shim_dir / "pgids").read_text().split()] if (
            self.shim_dir / "pgids").exists() else []
        for pgid in pgids:  # every engine group this test ever started, by id
            if shim.group_members(pgid):
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    shim._killpg(pgid, sig)
        for pgid in pgids:
            if not shim._wait_gone(pgid, 20):
                shim._killpg(pgid, signal.SIGKILL)
                shim._wait_gone(pgid, 10)
        shutil.rmtree(self.state, ignore_errors=True)

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", *args], env=self.env, capture_output=True, text=True, timeout=120)

    def active(self) -> bool:
        return self.systemctl("is-active", "-q", self.unit).returncode == 0

    def _health(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_tail(self) -> str:
        return self.engine_log.read_text(errors="replace")[-3000:] if self.engine_log.exists() else ""

    def main_pid(self) -> int:
        return int((self.shim_dir / "main.pid").read_text())

    def write_key(self, key: str) -> None:
        self.key_file.write_text(key)
        self.key_file.chmod(0o600)

    # --- monitor

    def _read(self, name: str) -> str:
        try:
            return (self.state / name).read_text().strip()
        except OSError:
            return ""

    def round(self) -> Round:
        t = time.time()
        r = subprocess.run([str(self.lib / "recover.sh"), str(self.env_file)], env=self.env,
                           capture_output=True, text=True, timeout=PROBE_TIMEOUT_S + 150)
        return Round(t, time.time(), r.returncode, r.stdout + r.stderr, self._read("last"),
                     self._read("failures"), self._read("last-error"))

    def drive(self, until, deadline: float, what: str) -> list[Round]:
        """One round every ROUND_INTERVAL_S (never overlapping) until ``until(round)``."""
        rounds: list[Round] = []
        while True:
            r = self.round()
            rounds.append(r)
            if until(r):
                return rounds
            if time.time() > deadline:
                history = "\n".join(map(str, rounds[-15:]))
                pytest.fail(f"{what}: not reached by the deadline. Rounds:\n{history}\n"
                            f"calls: {self.calls()}\nengine log:\n{self.engine_tail()}")
            time.sleep(max(0.0, ROUND_INTERVAL_S - (time.time() - r.start)))

    def calls(self, since: float = 0.0) -> list[dict]:
        path = self.shim_dir / "calls.log"
        if not path.exists():
            return []
        return [c for c in map(json.loads, path.read_text().splitlines()) if c["t"] >= since]

    def restarts(self, since: float) -> list[dict]:
        return [c for c in self.calls(since) if set(c["argv"]) & RESTART_VERBS]

    def completion(self, max_tokens: int = 4) -> dict:
        body = {"model": SERVED, "prompt": "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n<|fim_middle|>",
                "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(verify=self.tls.context(), timeout=60) as c:
            r = c.post(self.nginx.url("/v1/completions"), json=body,
                       headers={"Authorization": f"Bearer {self.key}"})
        assert r.status_code == 200, r.text
        return r.json()

    def ensure_serving(self) -> None:
        """Precondition of each fault: probes pass (bounded)."""
        self.drive(Round.ok, time.time() + RECOVERY_BOUND_S, "engine serving before the fault")


@pytest.fixture(scope="module")
def node(tmp_path_factory, vllm_python, tiny_model):
    n = MonitoredNode(tmp_path_factory.mktemp("monitor"), vllm_python, tiny_model)
    try:
        n.start()
        yield n
    finally:
        n.stop()
        print(f"\nmonitor recovery measurements: {json.dumps(RESULTS)}")


def assert_real_completion(node: MonitoredNode) -> str:
    out = node.completion(max_tokens=4)
    assert out["model"] == SERVED
    assert out["usage"]["completion_tokens"] == 4, out
    text = out["choices"][0]["text"]
    assert text, out
    return text


def run_fault(node: MonitoredNode, sig: signal.Signals, name: str) -> list[Round]:
    """Inject ``sig`` into the engine's group; drive rounds until a restart and an ok probe."""
    node.ensure_serving()
    pid0 = node.main_pid()
    t0 = time.time()
    os.killpg(pid0, sig)

    rounds = node.drive(lambda r: r.ok() and bool(node.restarts(t0)), t0 + RECOVERY_BOUND_S,
                        f"recovery from {name}")
    recovered = rounds[-1].end - t0
    restarts = node.restarts(t0)
    # exactly one plain restart: no escalation to SIGKILL was needed
    assert [c["argv"] for c in restarts] == [["restart", node.unit]], restarts
    detected = restarts[0]["t"] - t0
    # the counter reached the threshold before the restart, not earlier
    before = [r for r in rounds if r.start <= restarts[0]["t"]]  # up to the restarting round
    assert [r.failures for r in before] == [str(i) for i in range(1, FAILURE_THRESHOLD)] + ["0"], \
        "\n".join(map(str, rounds))
    assert all(not r.ok() for r in before)
    assert node.main_pid() != pid0
    assert not shim.group_members(pid0), "the faulted engine group survived the restart"
    assert recovered <= RECOVERY_BOUND_S
    text = assert_real_completion(node)
    RESULTS[name] = {"detected_s": round(detected, 1), "recovered_s": round(recovered, 1),
                     "restart_call_s": round(restarts[0]["end"] - restarts[0]["t"], 1),
                     "restart_note": restarts[0]["note"], "rounds": len(rounds),
                     "first_error": before[0].last_error[:160]}
    print(f"\n{name}: {RESULTS[name]}; completion {text!r}")
    return before


# ----------------------------------------------------------------------- tests


def test_healthy_engine_is_never_restarted(node):
    assert_real_completion(node)  # warm-up
    t0 = time.time()
    rounds = [node.round()]
    for _ in range(HEALTHY_ROUNDS - 1):
        time.sleep(ROUND_INTERVAL_S)
        rounds.append(node.round())
    assert all(r.ok() and r.failures == "0" for r in rounds), "\n".join(map(str, rounds))
    assert node.restarts(t0) == []
    assert [c["argv"] for c in node.calls(t0)] == [], "a healthy round should not even ask systemctl"
    RESULTS["healthy_probe_round_s"] = round(max(r.end - r.start for r in rounds), 2)


def test_bad_key_is_a_config_error_and_never_restarts(node):
    node.ensure_serving()
    pid0 = node.main_pid()
    t0 = time.time()
    node.write_key("sk-wrong-" + secrets.token_hex(8))
    try:
        rounds = [node.round()]
        for _ in range(BAD_KEY_ROUNDS - 1):
            time.sleep(ROUND_INTERVAL_S)
            rounds.append(node.round())
    finally:
        node.write_key(node.key)
    history = "\n".join(map(str, rounds))
    for r in rounds:
        assert r.rc == 3, history                      # the round fails visibly
        assert "HTTP 401" in r.last_error, history     # nginx's answer, in last-error
        assert r.last.split()[1] == "config-error", history
        assert r.failures == "0", history              # not counted as an engine failure
        assert "NOT restarting" in r.out, history
    assert node.restarts(t0) == [], node.calls(t0)
    assert node.main_pid() == pid0 and node.active()
    journal = (node.shim_dir / "journal.log").read_text()
    assert f"{node.unit}: configuration error, NOT restarting" in journal
    # the key fixed: the next round is ok, still without a restart
    assert node.round().ok()
    assert node.restarts(t0) == []
    RESULTS["bad_key"] = {"rounds": len(rounds), "restarts": 0, "last_error": rounds[0].last_error[:160]}


def test_sigstopped_engine_is_restarted_and_serves_again(node):
    before = run_fault(node, signal.SIGSTOP, "sigstop")
    assert any("curl exit 28" in r.last_error for r in before), "\n".join(map(str, before))


def test_killed_engine_is_restarted_and_serves_again(node):
    before = run_fault(node, signal.SIGKILL, "sigkill")
    assert any("HTTP 502" in r.last_error for r in before), "\n".join(map(str, before))
