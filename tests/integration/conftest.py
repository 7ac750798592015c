"""Shared real-engine fixtures: the pinned vLLM CPU install, the tiny FIM model, and one
vLLM server for the session (stopped by its own process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from components.monitoring import vllm_histogram_args
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "toolchain" / "vllm" / "install.sh"
MAKE_MODEL = REPO / "toolchain" / "tinymodel" / "make_tiny_model.py"
SERVED = "tiny-qwen2-fim"
API_KEY = "sk-fimfleet-test-engine-key-0123456789"
"""A throwaway key for the test engine (a constant: this module may be imported twice)."""
HEALTH_TIMEOUT_S = 600  # about 30-60 s natively; generous for a shared 2-core box


def _last_line_value(out: str, key: str) -> str:
    for line in reversed(out.splitlines()):
        if line.startswith(key + "="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no {key}= line in output:\n{out[-2000:]}")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    py = os.environ.get("FIMFLEET_VLLM_PYTHON")
    if py and os.access(py, os.X_OK):
        return py
    r = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"install.sh failed:\n{r.stderr[-3000:]}"
    return str(Path(_last_line_value(r.stdout, "VLLM_VENV")) / "bin" / "python")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    r = subprocess.run([vllm_python, str(MAKE_MODEL)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"make_tiny_model.py failed:\n{r.stderr[-3000:]}"
    d = Path(_last_line_value(r.stdout, "TINY_MODEL_DIR"))
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    return d


@pytest.fixture(scope="session")
def vllm_server(vllm_python: str, tiny_model: Path, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    cmd = [
        vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(tiny_model), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
        "--api-key", API_KEY,
        # the TTFT buckets fimfleet gives its engines, so Prometheus's p99 is not a bucket artifact
        *vllm_histogram_args(),
    ]
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        healthy = None
        while time.monotonic() - t0 < HEALTH_TIMEOUT_S:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    healthy = time.monotonic() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if healthy is None:
            pytest.fail(f"vLLM not healthy after {HEALTH_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
        print(f"\nvLLM healthy after {healthy:.1f}s (pid {proc.pid}, log {log_path})")
        yield {"base": base, "pid": proc.pid, "log": log_path, "healthy_s": healthy}
    finally:
        # Stop only what we started: the server's own process group (API server,
        # engine core, worker), by id.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(proc.pid, signal.SIGKILL)


