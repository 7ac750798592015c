"""What the real-engine benchmarks share: the pinned vLLM interpreter, the tiny FIM model and
one native vLLM CPU server, started the way tests/integration/conftest.py's ``vllm_server``
fixture starts it and stopped by its own process group, so a benchmark measures the engine
the tests prove. Imported as ``benchmarks._engine`` with the repository root on sys.path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx

from components.monitoring import vllm_histogram_args
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "toolchain" / "vllm" / "install.sh"
MAKE_MODEL = ROOT / "toolchain" / "tinymodel" / "make_tiny_model.py"
SERVED = "tiny-qwen2-fim"
API_KEY = "sk-fimfleet-bench-engine-key-0123456789"
"""A throwaway key for the benchmark engine (it listens on 127.0.0.1 only)."""
MAX_MODEL_LEN = 2048


def make_log(tag: str) -> Callable[[str], None]:
    """Progress to stderr, so stdout stays free for the result JSON."""

    def log(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def last_value(out: str, key: str) -> str:
    """The value of the last ``KEY=value`` line (install.sh and make_tiny_model.py print it last)."""
    for line in reversed(out.splitlines()):
        if line.startswith(key + "="):
            return line.split("=", 1)[1]
    raise RuntimeError(f"no {key}= line in:\n{out[-2000:]}")


def vllm_python() -> str:
    """FIMFLEET_VLLM_PYTHON, else the venv toolchain/vllm/install.sh builds or reuses (cached)."""
    env_py = os.environ.get("FIMFLEET_VLLM_PYTHON")
    if env_py and os.access(env_py, os.X_OK):
        return env_py
    why = f"FIMFLEET_VLLM_PYTHON={env_py!r} is not executable" if env_py else "FIMFLEET_VLLM_PYTHON is not set"
    try:
        r = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}:\n{r.stderr[-3000:]}")
        py = Path(last_value(r.stdout, "VLLM_VENV")) / "bin" / "python"
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"no vLLM interpreter: {why}, and {INSTALL} failed ({exc}); set "
                           "FIMFLEET_VLLM_PYTHON to the python of a vLLM CPU venv or fix the install") from exc
    if not os.access(py, os.X_OK):
        raise RuntimeError(f"no vLLM interpreter: {why}, and {INSTALL} named {py}, which is not executable")
    return str(py)


def tiny_model(py: str) -> Path:
    r = subprocess.run([py, str(MAKE_MODEL)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py failed:\n{r.stderr[-3000:]}")
    return Path(last_value(r.stdout, "TINY_MODEL_DIR"))


def vllm_versions(py: str) -> tuple[Optional[str], Optional[str]]:
    """(vllm, torch) versions of the interpreter, for the result's machine facts."""
    out = subprocess.run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                         capture_output=True, text=True, timeout=120).stdout.split()
    return (out[0] if out else None), (out[1] if len(out) > 1 else None)


def _on_sigterm(*_: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def arm_sigterm() -> None:
    """SIGTERM (e.g. from timeout(1)) becomes SystemExit, so the finally blocks stop the engine."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM the process's own group, SIGKILL what is left after a bounded wait; only what we started."""
    prev = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
    pgid = proc.pid
    try:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the engine core and workers may outlive the API server
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        signal.signal(signal.SIGTERM, prev)


class Engine:
    """Native vLLM on 127.0.0.1 with conftest's env and flags; kv_gib and dtype vary per benchmark."""

    def __init__(self, py: str, model: Path, *, kv_gib: int = 1, dtype: str = "bfloat16",
                 extra_args: Sequence[str] = (), log: Callable[[str], None] = make_log("vllm"),
                 cpus: Optional[str] = None):
        # cpus: a taskset(1) list, so that engines on one machine stand for nodes with their own cores
        self.py, self.model, self.kv_gib, self.dtype, self.cpus = py, model, kv_gib, dtype, cpus
        self.extra_args, self.log = list(extra_args), log
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        fd, name = tempfile.mkstemp(prefix=f"vllm-kv{kv_gib}-{dtype}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        """Kept when a run fails (for the reader); ``discard_log`` after a good run."""
        self.t0 = 0.0
        self.healthy_s: Optional[float] = None

    def command(self) -> list[str]:
        return [self.py, "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", str(self.model), "--served-model-name", SERVED,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--dtype", self.dtype, "--max-model-len", str(MAX_MODEL_LEN),
                "--api-key", API_KEY,
                # the TTFT buckets fimfleet gives its engines, as in the tests
                *vllm_histogram_args(), *self.extra_args]

    def start(self) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore::DeprecationWarning")
        self.t0 = time.monotonic()
        with open(self.log_path, "wb") as fh:
            pin = ["taskset", "-c", self.cpus] if self.cpus else []
            self.proc = subprocess.Popen([*pin, *self.command()], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.log(f"vLLM pid {self.proc.pid} on {self.base} (KVCACHE_SPACE={self.kv_gib}, {self.dtype}"
                 f"{', cpus ' + self.cpus if self.cpus else ''}), "
                 f"log {self.log_path}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {self.proc.returncode}:\n{self.log_text()[-3000:]}")

    def wait_healthy(self, timeout_s: float = 600) -> None:
        while time.monotonic() - self.t0 < timeout_s:
            self.check_alive()
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self.healthy_s = time.monotonic() - self.t0
                    self.log(f"vLLM healthy after {self.healthy_s:.1f}s")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy after {timeout_s:g}s:\n{self.log_text()[-3000:]}")

    def attach(self, base: str) -> None:
        """Use an engine someone else started (serving SERVED with API_KEY); ``stop`` leaves it running."""
        self.base = base.rstrip("/")
        httpx.get(self.base + "/health", timeout=5).raise_for_status()
        self.log(f"attached to {self.base}")

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_group(self.proc)
        self.log(f"vLLM process group {self.proc.pid} stopped")

    def discard_log(self) -> None:
        self.log_path.unlink(missing_ok=True)
