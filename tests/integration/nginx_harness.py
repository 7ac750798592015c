"""The real-nginx harness shared by the ingress integration tests: a test CA, the SSE upstream
(tests/integration/sse_upstream.py) and nginx rendered by components/ingress_render.py, all
on 127.0.0.1 with kernel-chosen ports. Every process runs in the foreground and is stopped
by PID. Import the fixtures (tls, upstream, keys, start_nginx, client) into a test module.
"""

from __future__ import annotations

import contextlib

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from components.ingress_render import MAIN_CONF, IngressSpec, access_log, ingress_install_plan  # noqa: E402
from components.nginx_base import NginxBase  # noqa: E402
from tests.helpers import free_port  # noqa: E402

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
UPSTREAM_SCRIPT = Path(__file__).with_name("sse_upstream.py")
SERVER_NAME = "fimfleet.test"

CHUNKS = 6                 # chunks per measured stream
CHUNK_DELAY_MS = 100       # upstream gap between chunks: buffering would hold chunks this long
FIRST_DELAY_MS = 50        # simulated prefill before chunk 0
RATE, BURST = 10, 5

# ./fimfleet bootstrap installs nginx; a missing binary is a failure, not a skip.
assert os.access(NGINX, os.X_OK), f"nginx binary not found at {NGINX}: run ./fimfleet bootstrap"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def children_of(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.add(int(entry))
    return kids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_process(proc: subprocess.Popen, first_signal: int, extra_pids: set[int] = frozenset()) -> None:
    """Stop ``proc`` (and leftover ``extra_pids``) by PID, escalating to SIGKILL."""
    for sig, grace in ((first_signal, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    for pid in extra_pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclasses.dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def make_tls(directory: Path) -> TlsFiles:
    """A test CA and a server certificate for fimfleet.test, 127.0.0.1 and ::1 (the product's own issuer)."""
    from components.tls import issue

    return write_tls(directory, issue(SERVER_NAME, [SERVER_NAME], ["127.0.0.1", "::1"], days=1))


def write_tls(directory: Path, pems: dict) -> TlsFiles:
    """The CA, certificate and key of `components.tls.issue` as files nginx and clients read."""
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_text(pems["caPem"])
    files.cert.write_text(pems["certPem"])
    files.key.write_text(pems["keyPem"])
    files.key.chmod(0o600)
    return files


class Upstream:
    """sse_upstream.py as a subprocess on 127.0.0.1 (port chosen by the kernel)."""

    def __init__(self, workdir: Path, first_delay_ms: int = FIRST_DELAY_MS):
        port_file = workdir / "upstream.port"
        self.log = open(workdir / "upstream.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(UPSTREAM_SCRIPT), "--port", "0", "--port-file", str(port_file),
             "--chunks", str(CHUNKS), "--delay-ms", str(CHUNK_DELAY_MS),
             "--first-delay-ms", str(first_delay_ms)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: port_file.exists() or self.proc.poll() is not None, 15, "sse_upstream port file")
            if self.proc.poll() is not None:
                raise RuntimeError(f"sse_upstream exited: {(workdir / 'upstream.log').read_text()}")
            self.port = int(port_file.read_text())
            wait_for(lambda: port_open("127.0.0.1", self.port), 10, "sse_upstream to listen")
        except Exception:
            self.stop()
            raise
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        self.log.close()


class Nginx:
    """A real nginx in the foreground under ``prefix`` (unprivileged layout)."""

    def __init__(self, prefix: Path, tls: TlsFiles, upstream_port: int, **overrides):
        self.prefix = prefix
        for sub in ("logs", "tmp"):
            (prefix / sub).mkdir(parents=True, exist_ok=True)
        self.https_port, self.http_port = free_port(), free_port()
        kwargs = dict(
            server_name=SERVER_NAME, tls_cert_path=str(tls.cert), tls_key_path=str(tls.key),
            upstream_port=upstream_port, api_keys={}, https_port=self.https_port,
            http_port=self.http_port, listen_addresses=("127.0.0.1", "::1"),
            rate_per_second=RATE, burst=BURST, metrics_allow_cidrs=("127.0.0.0/8", "::1/128"),
        )
        base = dict(conf_dir=str(prefix), log_dir=str(prefix / "logs"), pid_path=str(prefix / "nginx.pid"),
                    temp_dir=str(prefix / "tmp"), worker_processes=2,
                    # as root, workers would default to "nobody", which cannot enter the 0700 tmp dir
                    worker_user="root" if os.geteuid() == 0 else None)
        for name in [n for n in overrides if n in NginxBase.__dataclass_fields__]:
            base[name] = overrides.pop(name)
        kwargs.update(overrides)
        self.spec = IngressSpec(**kwargs, base=NginxBase(**base))
        self.proc: Optional[subprocess.Popen] = None
        self.seen_workers: set[int] = set()

    def _write(self) -> None:
        for f in ingress_install_plan(self.spec):
            path = Path(f.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f.content)
            path.chmod(f.mode)
        check = subprocess.run([NGINX, "-t", "-q", "-p", str(self.prefix), "-c", str(self.prefix / MAIN_CONF)],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr

    def start(self) -> "Nginx":
        self._write()
        self.stderr = open(self.prefix / "nginx.stderr", "wb")
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(self.prefix), "-c", str(self.prefix / MAIN_CONF), "-g", "daemon off;"],
            stdout=self.stderr, stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: self.proc.poll() is not None or (
                port_open("127.0.0.1", self.https_port) and len(children_of(self.proc.pid)) >= 2), 15,
                "nginx to listen")
            assert self.proc.poll() is None, f"nginx exited: {self.logs()}"
        except Exception:
            self.stop()
            raise
        self.seen_workers |= children_of(self.proc.pid)
        return self

    def reload(self, **overrides) -> None:
        """Re-render with ``overrides``, SIGHUP the master, wait until every old worker
        is gone and new ones serve (bounded)."""
        old = children_of(self.proc.pid)
        self.spec = dataclasses.replace(self.spec, **overrides)
        self._write()
        os.kill(self.proc.pid, signal.SIGHUP)
        wait_for(lambda: (kids := children_of(self.proc.pid)) and not (kids & old), 15,
                 f"nginx workers to be replaced after reload; logs: {self.logs()}")
        self.seen_workers |= children_of(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.seen_workers |= children_of(self.proc.pid)
            stop_process(self.proc, signal.SIGQUIT, self.seen_workers)
            self.stderr.close()
            self.proc = None

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"https://{'[::1]' if host == '::1' else host}:{self.https_port}{path}"

    def logs(self) -> str:
        out = []
        for name in ("nginx.stderr", "logs/fimfleet-error.log"):
            p = self.prefix / name
            if p.exists():
                out.append(f"--- {name}\n{p.read_text(errors='replace')}")
        return "\n".join(out)

    def access_log(self) -> list[dict]:
        path = Path(access_log(self.spec))
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    up = Upstream(tmp_path_factory.mktemp("upstream"))
    yield up
    up.stop()


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "carol")}


@pytest.fixture
def start_nginx(tmp_path, tls, upstream, keys):
    started: list[Nginx] = []

    def _start(name: str = "nginx", **overrides) -> Nginx:
        overrides.setdefault("api_keys", keys)
        overrides.setdefault("upstream_port", upstream.port)
        ngx = Nginx(tmp_path / name, tls, **overrides)
        started.append(ngx)
        return ngx.start()

    yield _start
    for ngx in started:
        ngx.stop()


@pytest.fixture
def client(tls):
    with httpx.Client(verify=tls.context(), timeout=httpx.Timeout(10.0)) as c:
        yield c


@contextlib.contextmanager
def vllm_behind_nginx(root: Path, vllm_server: dict, api_keys: dict[str, str], upstream_api_key: str):
    """Real nginx with fimfleet's ingress config and a test CA in front of the shared vLLM server;
    yields the endpoint, the CA PEM and the work directory."""
    tls = make_tls(root)
    port = int(vllm_server["base"].rsplit(":", 1)[1])
    nginx = Nginx(root / "nginx", tls, port, api_keys=api_keys, upstream_api_key=upstream_api_key,
                  rate_per_second=100, burst=100).start()
    try:
        yield {"endpoint": nginx.url("").rstrip("/"), "ca": tls.ca.read_text(), "dir": root}
    finally:
        nginx.stop()

