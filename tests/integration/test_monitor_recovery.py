"""The node's deep probe and recovery manager against a REAL vLLM engine behind REAL nginx,
with each tier's REAL monitor settings (issue 10 item 7; issue 5 item 3).

Everything is real except systemd, which this machine does not have:

* vLLM CPU (cached venv, tiny random Qwen2 with a FIM tokenizer) on a high port, in its own
  process group, started and restarted by ``systemctl_shim.py`` (SIGTERM+SIGCONT, then
  SIGKILL after the stop timeout, as systemd does). It runs one sequence at a time
  (``--max-num-seqs 1``), so 16 streams put a probe behind 15 long generations;
* nginx rendered by ``components/ingress_render.py`` (TLS with a test CA, named keys);
* ``files/monitor/fim-probe.sh`` and ``recover.sh`` installed 0755, with the env file rendered
  by ``components/monitor.env_file`` from ``monitor.settings(cfg)``, where ``cfg`` is parsed
  from the stack file (its tier, its monitor and SLA sections) as a deploy does. One monitor
  per stack in SETTINGS_FROM, each with its own state dir. The test stands in for the timer:
  one round, then ``interval_s`` of rest (OnUnitInactiveSec), never overlapping.

Faults, each starting from a serving engine:

1. none: every probe ok, no systemctl call;
2. a wrong probe key: HTTP 401, a configuration error every round, never a restart;
3. 16 concurrent streams: probes time out while the engine produces tokens; every failed
   round is judged busy, none fails, nothing is restarted (over the longest detection bound);
4. a restart by someone else (a deploy): the start grace holds, nothing is restarted;
5. SIGSTOP of the EngineCore process only, which leaves /health at 200 (vLLM #39863): the
   engine is restarted within DETECT_BUDGET_S (60 s), once per tier's settings, and serves again.

Measured times are printed with ``pytest -s``; with FIMFLEET_RECORD_RESULTS=1 they are written to
benchmarks/results/monitor_recovery.json
(``FIMFLEET_RECORD_RESULTS=1 ./fimfleet test tests/integration/test_monitor_recovery.py -s``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from components import config, monitor
from tests.helpers import free_port, raw_config
from tests.integration import systemctl_shim as shim
from tests.integration.nginx_harness import Nginx, make_tls

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MONITOR_FILES = REPO / "files" / "monitor"
SHIM = HERE / "systemctl_shim.py"
RESULTS_FILE = REPO / "benchmarks" / "results" / "monitor_recovery.json"
SERVED = "tiny-qwen2-fim"

SETTINGS_FROM = ("local", "cpu-epyc-prod")
"""Stacks whose tier + monitor + SLA settings are exercised: the test VM and a production CPU tier."""
STOP_TIMEOUT_S = 30        # the shim's TimeoutStopSec before SIGKILL
START_BOUND_S = 300        # an engine start (the box is shared and busy)
LOAD_STREAMS = 16
QUEUE_FILL_S = 180          # the load's queue may take this long to fill on a loaded 2-core box
LOAD_MAX_TOKENS = 1000     # with --max-num-seqs 1, a queued probe waits for many of these
SLACK_S = 5                # process start-up of bash/curl on a loaded 2-core box
RESTART_VERBS = {"restart", "start", "stop", "kill"}
RESULTS: dict[str, object] = {}


def tier_settings(stack: str, tiny_model: Path) -> tuple[monitor.Settings, int]:
    """(monitor settings, start grace) that a deploy of `stack` renders."""
    doc = yaml.safe_load((REPO / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    tier = doc["fimfleet:tier"]
    sections = {k.split(":", 1)[1]: v for k, v in doc.items() if k in ("fimfleet:monitor", "fimfleet:sla")}
    if tier == "local-vm":  # the local stack's model is the tiny model, filled in by the demo
        sections["model"] = {"source": "local", "localPath": str(tiny_model), "servedName": SERVED}
    raw, secret = raw_config(tier, **sections)
    cfg = config.parse(raw, secret)
    return monitor.settings(cfg), cfg.runtime.start_timeout_s


@dataclass
class Round:
    start: float
    end: float
    rc: int
    out: str
    last: str
    failures: str
    last_error: str

    @property
    def verdict(self) -> str:
        return (self.last.split() + ["", ""])[1]

    def ok(self) -> bool:
        return self.rc == 0 and self.verdict == "ok"

    def __str__(self) -> str:
        return (f"[{self.start:.1f} +{self.end - self.start:.1f}s rc={self.rc} failures={self.failures}] "
                f"last={self.last[:160]!r} out={self.out.strip()[:300]!r}")


class Monitor:
    """One installed monitor (env file + state dir) with one stack's settings."""

    def __init__(self, node: MonitoredNode, stack: str, settings: monitor.Settings, grace_s: int):
        self.node, self.stack, self.s = node, stack, settings
        self.state = node.root / f"state-{stack}"
        self.key_file = node.root / f"{stack}.key"
        self.env_file = node.root / f"{stack}.env"
        self.grace_s = grace_s
        self.write_key(node.keys[stack])

    def write_key(self, key: str) -> None:
        self.key_file.write_text(key)
        self.key_file.chmod(0o600)

    def render(self) -> None:
        self.env_file.write_text(monitor.env_file(
            self.s, unit=self.node.unit, container="", service_user="", grace_s=self.grace_s,
            probe_url=f"https://127.0.0.1:{self.node.nginx.https_port}",
            metrics_url=f"http://127.0.0.1:{self.node.port}/metrics", key_file=str(self.key_file),
            ca_file=str(self.node.tls.ca), model=SERVED, state=str(self.state)))

    def _read(self, name: str) -> str:
        try:
            return (self.state / name).read_text().strip()
        except OSError:
            return ""

    def round(self) -> Round:
        t = time.time()
        r = subprocess.run([str(self.node.lib / "recover.sh"), str(self.env_file)], env=self.node.env,
                           capture_output=True, text=True, timeout=self.s.probe_timeout_s + 200)
        return Round(t, time.time(), r.returncode, r.stdout + r.stderr, self._read("last"),
                     self._read("failures"), self._read("last-error"))

    def drive(self, until, deadline: float, what: str) -> list[Round]:
        """Rounds with the timer's rest between them until ``until(round)``."""
        rounds: list[Round] = []
        while True:
            rounds.append(r := self.round())
            if until(r):
                return rounds
            if time.time() > deadline:
                pytest.fail(f"{self.stack}: {what}: not reached by the deadline. Rounds:\n"
                            + "\n".join(map(str, rounds[-15:])) + f"\ncalls: {self.node.calls()}\n"
                            f"engine log:\n{self.node.engine_tail()}")
            time.sleep(self.s.interval_s)

    def ensure_serving(self) -> None:
        self.drive(Round.ok, time.time() + START_BOUND_S, "engine serving before the fault")


class MonitoredNode:
    """Engine (via the systemctl shim) + nginx + the installed scripts; one Monitor per stack."""

    def __init__(self, root: Path, vllm_python: str, model: Path):
        self.root = root
        self.unit = f"fimfleet-montest-{secrets.token_hex(3)}.service"
        self.shim_dir, self.bin, self.lib = root / "shim", root / "bin", root / "lib"
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
        engine_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER") if k in os.environ}
        engine_env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
                          PYTHONWARNINGS="ignore::DeprecationWarning")
        (self.shim_dir / "unit.json").write_text(json.dumps({
            "unit": self.unit, "env": engine_env, "cwd": str(root), "log": str(self.engine_log),
            "stop_timeout_s": STOP_TIMEOUT_S,
            "argv": [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry",
                     "--model", str(model), "--served-model-name", SERVED, "--host", "127.0.0.1",
                     "--port", str(self.port), "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "1024",
                     "--max-num-seqs", "1"],
        }))
        self.tls = make_tls(root)
        self.keys = {stack: secrets.token_urlsafe(24) for stack in SETTINGS_FROM}
        self.nginx: Nginx | None = None
        for f in ("fim-probe.sh", "recover.sh"):
            shutil.copy(MONITOR_FILES / f, self.lib / f)
            (self.lib / f).chmod(0o755)
        self.monitors = {stack: Monitor(self, stack, *tier_settings(stack, model)) for stack in SETTINGS_FROM}

    def start(self) -> None:
        t0 = time.monotonic()
        self.systemctl("start", self.unit)
        self.wait_healthy(t0 + START_BOUND_S)
        RESULTS["first_start_s"] = round(time.monotonic() - t0, 1)
        self.nginx = Nginx(self.root / "nginx", self.tls, self.port,
                           api_keys={s.replace("-", "_"): k for s, k in self.keys.items()}).start()
        for m in self.monitors.values():
            m.render()

    def wait_healthy(self, deadline: float) -> None:
        while not self.health():
            assert self.active(), f"engine exited during start:\n{self.engine_tail()}"
            assert time.monotonic() < deadline, f"engine not healthy in time:\n{self.engine_tail()}"
            time.sleep(1)

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

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", *args], env=self.env, capture_output=True, text=True, timeout=120)

    def active(self) -> bool:
        return self.systemctl("is-active", "-q", self.unit).returncode == 0

    def health(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_tail(self) -> str:
        return self.engine_log.read_text(errors="replace")[-3000:] if self.engine_log.exists() else ""

    def main_pid(self) -> int:
        return int((self.shim_dir / "main.pid").read_text())

    def engine_core_pid(self) -> int:
        """The EngineCore process of the running engine (vLLM names it with setproctitle)."""
        for pid in shim.group_members(self.main_pid()):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "EngineCore" in title:
                return pid
        raise AssertionError(f"no EngineCore process in group {self.main_pid()}")

    def calls(self, since: float = 0.0) -> list[dict]:
        path = self.shim_dir / "calls.log"
        if not path.exists():
            return []
        return [c for c in map(json.loads, path.read_text().splitlines()) if c["t"] >= since]

    def restarts(self, since: float) -> list[dict]:
        return [c for c in self.calls(since) if set(c["argv"]) & RESTART_VERBS]

    def completion(self, stack: str, max_tokens: int = 4) -> dict:
        body = {"model": SERVED, "prompt": "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n<|fim_middle|>",
                "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(verify=self.tls.context(), timeout=60) as c:
            r = c.post(self.nginx.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {self.keys[stack]}"})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def node(tmp_path_factory, vllm_python, tiny_model):
    n = MonitoredNode(tmp_path_factory.mktemp("monitor"), vllm_python, tiny_model)
    RESULTS["settings"] = {s: {**m.s.__dict__, "detection_bound_s": m.s.detection_bound_s}
                           for s, m in n.monitors.items()}
    try:
        n.start()
        yield n
    finally:
        n.stop()
        print(f"\nmonitor recovery measurements: {json.dumps(RESULTS)}")
        if os.environ.get("FIMFLEET_RECORD_RESULTS") and {"sigstop_local", "sigstop_cpu-epyc-prod", "busy_load"} <= RESULTS.keys():
            RESULTS_FILE.write_text(json.dumps({"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                **RESULTS}, indent=2) + "\n")


def assert_real_completion(node: MonitoredNode, stack: str) -> str:
    out = node.completion(stack, max_tokens=4)
    assert out["model"] == SERVED and out["usage"]["completion_tokens"] == 4, out
    assert out["choices"][0]["text"], out
    return out["choices"][0]["text"]


# ----------------------------------------------------------------------- tests


def test_every_settings_bound_fits_the_budget(node):
    for stack, m in node.monitors.items():
        assert m.s.detection_bound_s <= monitor.DETECT_BUDGET_S, (stack, m.s)


def test_healthy_engine_is_never_restarted(node):
    t0 = time.time()
    for stack, m in node.monitors.items():
        assert_real_completion(node, stack)
        rounds = [m.round() for _ in range(3)]
        assert all(r.ok() and r.failures == "0" for r in rounds), "\n".join(map(str, rounds))
    assert node.calls(t0) == [], "a healthy round should not even ask systemctl"


def test_bad_key_is_a_config_error_and_never_restarts(node):
    m = node.monitors["cpu-epyc-prod"]
    m.ensure_serving()
    pid0, t0 = node.main_pid(), time.time()
    m.write_key("sk-wrong-" + secrets.token_hex(8))
    try:
        rounds = [m.round() for _ in range(m.s.failure_threshold + 1)]
    finally:
        m.write_key(node.keys["cpu-epyc-prod"])
    history = "\n".join(map(str, rounds))
    for r in rounds:
        assert r.rc == 3 and "HTTP 401" in r.last_error and r.verdict == "config-error", history
        assert r.failures in ("", "0") and "NOT restarting" in r.out, history
    assert node.restarts(t0) == [] and node.main_pid() == pid0
    assert f"{node.unit}: configuration error, NOT restarting" in (node.shim_dir / "journal.log").read_text()
    assert m.round().ok()


class Load:
    """LOAD_STREAMS clients streaming long completions straight from the engine, back to back."""

    def __init__(self, node: MonitoredNode):
        self.url = f"http://127.0.0.1:{node.port}/v1/completions"
        self.stop = threading.Event()
        self.tokens = [0] * LOAD_STREAMS
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(LOAD_STREAMS)]

    def _stream(self, i: int) -> None:
        """One stream after another, each on a new connection. One CI run saw two streams end in
        "Server disconnected without sending a response" with the engine untouched: what a client
        gets when it reuses a kept-alive connection the server is closing (vLLM's idle close is
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; the ingress keeps its upstream idle time under it).
        Not reproduced here in 3 runs with reuse, 2 of them beside CPU hogs. On a new connection the same
        error can only be the server's, and each error says when it came."""
        body = {"model": SERVED, "prompt": f"<|fim_prefix|>def load_{i}(x):\n    <|fim_suffix|>\n<|fim_middle|>",
                "max_tokens": LOAD_MAX_TOKENS, "temperature": 0.8, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=httpx.Timeout(10, read=300), headers={"Connection": "close"}) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", self.url, json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                self.tokens[i] += 1
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as e:
                    if not self.stop.is_set():
                        self.errors.append(f"{e!r} {time.monotonic() - self.t0:.1f} s into the load")

    def __enter__(self) -> Load:
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def waiting_requests(node: MonitoredNode) -> float:
    text = httpx.get(f"http://127.0.0.1:{node.port}/metrics", timeout=5).text
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("vllm:num_requests_waiting{"))


def test_busy_engine_under_16_streams_is_never_restarted(node):
    for m in node.monitors.values():
        m.ensure_serving()
    pid0 = node.main_pid()
    duration = max(m.s.detection_bound_s for m in node.monitors.values()) + 10
    results: dict[str, list[Round]] = {}
    with Load(node) as load:
        # Not the measure, the precondition: on this 2-core machine the API server streams one
        # generation while it accepts the other 15, and the queue took from seconds to over 60 s
        # to fill (the test's whole call 82-132 s across runs; one run failed here at 60).
        deadline = time.time() + QUEUE_FILL_S
        while waiting_requests(node) < LOAD_STREAMS - 2:  # the queue is full: probes wait behind it
            assert time.time() < deadline, f"load did not queue: {load.errors[:3]}"
            time.sleep(0.5)
        t0 = time.time()

        def run(stack: str, m: Monitor) -> None:
            results[stack] = m.drive(lambda r: r.end - t0 > duration, t0 + duration + 120, "load")

        workers = [threading.Thread(target=run, args=(s, m)) for s, m in node.monitors.items()]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        tokens = sum(load.tokens)
    assert node.restarts(t0) == [], node.calls(t0)
    assert node.main_pid() == pid0 and not load.errors, load.errors[:3]
    summary = {}
    for stack, rounds in results.items():
        history = "\n".join(map(str, rounds))
        verdicts = [r.verdict for r in rounds]
        # A working engine whose /metrics answered never counts as failing. A round in which
        # /metrics itself gave no answer under the load has no evidence of progress and may
        # count; the stall rule still keeps it from a restart (asserted above).
        blind = [r for r in rounds if r.verdict == "fail" and "gave no answer" in r.out]
        assert all(r.verdict != "fail" or r in blind for r in rounds), history
        assert "busy" in verdicts, history                   # the probe did fail behind the load ...
        assert all(r.failures in ("", "0") or r in blind for r in rounds), history
        summary[stack] = {"rounds": len(rounds), "busy": verdicts.count("busy"), "ok": verdicts.count("ok")}
    RESULTS["busy_load"] = {"streams": LOAD_STREAMS, "seconds": duration, "tokens_streamed": tokens, **summary}
    print(f"\nbusy load: {RESULTS['busy_load']}")


def test_an_engine_a_deploy_restarts_is_left_to_start(node):
    """A restart the monitor did not make (a deploy's start.sh, an operator) opens the same start
    grace as its own: the engine's failed probes while it starts are never judged hung."""
    m = node.monitors[SETTINGS_FROM[0]]
    m.ensure_serving()
    assert node.systemctl("restart", node.unit).returncode == 0
    t0 = time.time()
    rounds = m.drive(Round.ok, t0 + START_BOUND_S, "serving again after a deploy's restart")
    history = "\n".join(map(str, rounds))
    assert node.restarts(t0) == [], history
    assert any("start grace" in r.out for r in rounds), f"no round saw the engine starting:\n{history}"
    # what Prometheus reads (monitor-textfile.sh): starting, not failing, so no alert pages for it
    assert any(r.verdict == "starting" for r in rounds) and "fail" not in [r.verdict for r in rounds], history


def test_the_exercised_settings_bracket_every_stacks(tiny_model):
    """Every stack's monitor settings differ from an exercised one at most in the probe timeout,
    inside the exercised range; tests/unit/test_monitor.py holds each tier's bound to 60 s. So the
    restart-within-the-bound and no-restart-when-busy proofs below stand for every stack."""
    exercised = [tier_settings(s, tiny_model)[0] for s in SETTINGS_FROM]
    lo, hi = min(e.probe_timeout_s for e in exercised), max(e.probe_timeout_s for e in exercised)
    for path in sorted((REPO / "stacks").glob("Pulumi.*.yaml")):
        stack = path.name.split(".")[1]
        s = tier_settings(stack, tiny_model)[0]
        assert lo <= s.probe_timeout_s <= hi and any(
            dataclasses.replace(e, probe_timeout_s=s.probe_timeout_s) == s for e in exercised), (stack, s, exercised)
        assert s.detection_bound_s <= monitor.DETECT_BUDGET_S, (stack, s)


@pytest.mark.parametrize("stack", SETTINGS_FROM)
def test_stopped_engine_core_is_restarted_within_the_budget(node, stack):
    """vLLM #39863: a stopped EngineCore leaves /health at 200; the tier's settings restart it in time.
    The restarted engine is shown serving once (for the first stack); the last one only has to start."""
    m = node.monitors[stack]
    m.ensure_serving()
    pid0, core = node.main_pid(), node.engine_core_pid()
    t0 = time.time()
    os.kill(core, signal.SIGSTOP)
    assert node.health(), "with only EngineCore stopped, /health must still answer 200"
    rounds = m.drive(lambda r: bool(node.restarts(t0)), t0 + monitor.DETECT_BUDGET_S + 60, "restart after SIGSTOP")
    restarts = node.restarts(t0)
    assert [c["argv"] for c in restarts] == [["restart", node.unit]], restarts
    detected = restarts[0]["t"] - t0
    history = "\n".join(map(str, rounds))
    assert detected <= monitor.DETECT_BUDGET_S, history
    assert detected <= m.s.detection_bound_s + SLACK_S, history   # the bound the settings promise holds
    assert [r.verdict for r in rounds] == ["fail"] * len(rounds), history
    assert "hung: restarting" in rounds[-1].out, history
    assert not shim.group_members(pid0), "the stopped engine group survived the restart"
    assert node.active() and node.main_pid() != pid0
    result = RESULTS[f"sigstop_{stack}"] = {
        "restart_after_s": round(detected, 1), "bound_s": m.s.detection_bound_s,
        "restart_call_s": round(restarts[0]["end"] - restarts[0]["t"], 1), "rounds": len(rounds),
        "first_error": rounds[0].last_error[:160]}
    if stack == SETTINGS_FROM[0]:
        recovered = m.drive(Round.ok, time.time() + START_BOUND_S, "serving again after the restart")
        result.update(serving_again_after_s=round(recovered[-1].end - t0, 1),
                      completion=assert_real_completion(node, stack))
    print(f"\nsigstop {stack}: {result}")
