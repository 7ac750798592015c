"""Integration tests: the REAL nginx, rendered by components/ingress_render.py, in
front of tests/integration/sse_upstream.py, all on 127.0.0.1.

Every nginx runs in the foreground (``-g 'daemon off;'``) under a temp prefix with
high ports, and is stopped by PID in teardown, as is the upstream. Clients verify
TLS against a test CA generated here (never ``verify=False``).

Streaming is proven by measurement: the upstream stamps every SSE chunk with
``time.monotonic()`` right before it writes it (CLOCK_MONOTONIC is system-wide), the
client stamps it on arrival, and the difference must stay within a few ms while
chunks are 100 ms apart. A negative control renders ``proxy_buffering on`` and
shows the same check fails.

Print the measured numbers with ``pytest -s``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import statistics
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

from components.ingress_render import INGRESS_FILE_MODES, MAIN_CONF, IngressSpec, render_ingress  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
UPSTREAM_SCRIPT = Path(__file__).with_name("sse_upstream.py")
SERVER_NAME = "fimfleet.test"

CHUNKS = 6                 # chunks per measured stream
CHUNK_DELAY_MS = 100       # upstream gap between chunks: buffering would hold chunks this long
FIRST_DELAY_MS = 50        # simulated prefill before chunk 0
MAX_CHUNK_LAG_S = 0.020    # per-chunk (client receive - upstream send), median over streams
HARD_CHUNK_LAG_S = CHUNK_DELAY_MS / 2000  # no single chunk may be held half a gap
MAX_TTFT_OVERHEAD_S = 0.020
RATE, BURST = 10, 5

# ./fimfleet bootstrap installs nginx; a missing binary is a failure, not a skip.
assert os.access(NGINX, os.X_OK), f"nginx binary not found at {NGINX}: run ./fimfleet bootstrap"


# ----------------------------------------------------------------------- helpers


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    pems = issue(SERVER_NAME, [SERVER_NAME], ["127.0.0.1", "::1"], days=1)
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_text(pems["caPem"])
    files.cert.write_text(pems["certPem"])
    files.key.write_text(pems["keyPem"])
    files.key.chmod(0o600)
    return files


class Upstream:
    """sse_upstream.py as a subprocess on 127.0.0.1 (port chosen by the kernel)."""

    def __init__(self, workdir: Path):
        port_file = workdir / "upstream.port"
        self.log = open(workdir / "upstream.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(UPSTREAM_SCRIPT), "--port", "0", "--port-file", str(port_file),
             "--chunks", str(CHUNKS), "--delay-ms", str(CHUNK_DELAY_MS),
             "--first-delay-ms", str(FIRST_DELAY_MS)],
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
            conf_dir=str(prefix), log_dir=str(prefix / "logs"), pid_path=str(prefix / "nginx.pid"),
            temp_dir=str(prefix / "tmp"), worker_processes=2,
            # as root, workers would default to "nobody", which cannot enter the 0700 tmp dir
            worker_user="root" if os.geteuid() == 0 else None,
        )
        kwargs.update(overrides)
        self.spec = IngressSpec(**kwargs)
        self.proc: Optional[subprocess.Popen] = None
        self.seen_workers: set[int] = set()

    def _write(self) -> None:
        for name, content in render_ingress(self.spec).items():
            path = self.prefix / name
            path.write_text(content)
            path.chmod(INGRESS_FILE_MODES[name])
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
        path = self.prefix / "logs" / "fimfleet-access.log"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@dataclasses.dataclass
class StreamTiming:
    status: int
    t_request: float
    events: list  # (seq, sent_monotonic, received_monotonic)
    headers: httpx.Headers

    @property
    def ttft(self) -> float:
        return self.events[0][2] - self.t_request

    @property
    def lags(self) -> list[float]:
        return [recv - sent for _, sent, recv in self.events]


def stream_completion(client: httpx.Client, url: str, headers: dict, chunks: int = CHUNKS) -> StreamTiming:
    """POST a streaming completion; time-stamp every SSE event as its bytes arrive."""
    body = {"model": "sse-test", "prompt": "<|fim_prefix|>def f(<|fim_suffix|>)<|fim_middle|>",
            "max_tokens": chunks, "stream": True}
    events, buf, done = [], b"", False
    t_request = time.monotonic()
    with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            return StreamTiming(resp.status_code, t_request, [], resp.headers)
        for raw in resp.iter_raw():
            received = time.monotonic()
            buf += raw
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                events.append((obj["x_seq"], obj["x_sent_monotonic"], received))
    assert done, "stream ended without [DONE]"
    return StreamTiming(200, t_request, events, resp.headers)


def assert_streamed_unbuffered(runs: list[StreamTiming], chunks: int = CHUNKS) -> None:
    """Every chunk reached the client as the upstream sent it."""
    for run in runs:
        assert run.status == 200
        assert [seq for seq, _, _ in run.events] == list(range(chunks)), "chunks missing or merged"
    per_chunk_median = [statistics.median(run.lags[i] for run in runs) for i in range(chunks)]
    worst = max(lag for run in runs for lag in run.lags)
    assert max(per_chunk_median) < MAX_CHUNK_LAG_S, (
        f"chunks held back by the proxy: median lag per chunk {[round(x * 1000, 1) for x in per_chunk_median]} ms")
    assert worst < HARD_CHUNK_LAG_S, f"a chunk was held {worst * 1000:.1f} ms (chunks are {CHUNK_DELAY_MS} ms apart)"
    for run in runs:  # arrivals keep the upstream's spacing
        arrivals = [recv for _, _, recv in run.events]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert min(gaps) > CHUNK_DELAY_MS / 2000, f"chunks arrived bunched: gaps {gaps}"


def ms(values) -> list[float]:
    return [round(v * 1000, 2) for v in values]


# ----------------------------------------------------------------------- fixtures


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


# -------------------------------------------------------------------------- tests


def test_http_redirects_to_https(start_nginx, client):
    ngx = start_nginx()
    resp = httpx.get(f"http://127.0.0.1:{ngx.http_port}/v1/models?x=1", timeout=5)
    assert resp.status_code == 301
    assert resp.headers["location"] == f"https://{SERVER_NAME}:{ngx.https_port}/v1/models?x=1"


def test_bearer_keys_each_key_works_others_401(start_nginx, client, keys, upstream):
    ngx = start_nginx()
    url = ngx.url("/v1/models")

    for headers in ({}, bearer("wrong-" + keys["alice"]), bearer(keys["alice"].swapcase()),
                    bearer(keys["alice"] + "x"), {"Authorization": keys["alice"]}):
        resp = client.get(url, headers=headers)
        assert resp.status_code == 401, headers
        assert resp.headers["content-type"] == "application/json"
        assert resp.headers["www-authenticate"].startswith("Bearer")
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["strict-transport-security"].startswith("max-age=")

    for name, key in keys.items():  # every key, not just the first (production-stack #759)
        resp = client.get(url, headers=bearer(key))
        assert resp.status_code == 200, name
        assert resp.json()["data"][0]["id"] == "sse-test"
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert resp.headers["x-accel-buffering"] == "no"
        timing = stream_completion(client, ngx.url("/v1/completions"), bearer(key), chunks=2)
        assert timing.status == 200 and len(timing.events) == 2, name
    # the auth scheme is case-insensitive, the key is not
    assert client.get(url, headers={"Authorization": f"bearer {keys['bob']}"}).status_code == 200

    # the client's key never reaches vLLM
    seen = httpx.get(f"{upstream.base}/debug/last", timeout=5).json()["headers"]
    assert "authorization" not in seen

    # access log: key names yes, keys never
    entries = ngx.access_log()
    assert {e["key"] for e in entries if e["status"] == 200} == set(keys)
    assert {e["key"] for e in entries if e["status"] == 401} == {""}
    logs = (ngx.prefix / "logs" / "fimfleet-access.log").read_text() + ngx.logs()
    for key in keys.values():
        assert key not in logs and key.swapcase() not in logs


def test_upstream_key_replaces_client_key(start_nginx, client, keys, upstream):
    upstream_key = secrets.token_urlsafe(24)
    ngx = start_nginx(upstream_api_key=upstream_key)
    assert client.get(ngx.url("/v1/models"), headers=bearer(keys["carol"])).status_code == 200
    seen = httpx.get(f"{upstream.base}/debug/last", timeout=5).json()["headers"]
    assert seen["authorization"] == f"Bearer {upstream_key}"
    assert seen["x-forwarded-proto"] == "https" and seen["x-request-id"]


def test_upstream_keepalive_pool_reuses_connections(start_nginx, client, keys, upstream):
    ngx = start_nginx()
    debug = f"{upstream.base}/debug/last"
    before = httpx.get(debug, timeout=5).json()["connections"]
    for _ in range(BURST):
        assert client.get(ngx.url("/v1/models"), headers=bearer(keys["carol"])).status_code == 200
        time.sleep(1.0 / RATE)
    stream_completion(client, ngx.url("/v1/completions"), bearer(keys["carol"]), chunks=2)
    # +1 for our own /debug/last connection; at most one upstream connection per worker
    opened = httpx.get(debug, timeout=5).json()["connections"] - before - 1
    assert 1 <= opened <= ngx.spec.worker_processes, opened


def test_revoking_one_key_leaves_the_others(start_nginx, client, keys, tls):
    ngx = start_nginx()
    url = ngx.url("/v1/models")
    assert {n: client.get(url, headers=bearer(k)).status_code for n, k in keys.items()} == dict.fromkeys(keys, 200)

    remaining = {n: k for n, k in keys.items() if n != "bob"}
    ngx.reload(api_keys=remaining)
    with httpx.Client(verify=tls.context(), timeout=10) as fresh:  # new connections, new workers
        after = {n: fresh.get(url, headers=bearer(k)).status_code for n, k in keys.items()}
    assert after == {"alice": 200, "bob": 401, "carol": 200}
    assert "bob" not in (ngx.prefix / "fimfleet-keys.conf").read_text()
    assert oct((ngx.prefix / "fimfleet-keys.conf").stat().st_mode & 0o777) == "0o600"


def test_rate_limit_is_per_key_and_answers_json_429(start_nginx, client, keys):
    ngx = start_nginx()
    url = ngx.url("/v1/models")
    # requests without a valid key are refused before the limiter and never counted
    assert {client.get(url).status_code for _ in range(3 * BURST)} == {401}

    statuses, bodies = [], []
    t0 = time.monotonic()
    for _ in range(60):
        resp = client.get(url, headers=bearer(keys["alice"]))
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            bodies.append((resp.headers, resp.json()))
    elapsed = time.monotonic() - t0
    ok, limited = statuses.count(200), statuses.count(429)
    print(f"\nflood: 60 requests in {elapsed * 1000:.0f} ms -> {ok} x 200, {limited} x 429 "
          f"(rate {RATE}/s, burst {BURST})")
    assert ok + limited == 60
    assert limited > 0
    assert BURST + 1 <= ok <= BURST + 2 + RATE * elapsed
    headers, body = bodies[0]
    assert headers["content-type"] == "application/json"
    assert headers["retry-after"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded"

    # other keys have their own bucket
    assert client.get(url, headers=bearer(keys["bob"])).status_code == 200
    # and alice recovers once the bucket drains
    time.sleep(1.5 / RATE * 2)
    assert client.get(url, headers=bearer(keys["alice"])).status_code == 200
    assert any(e["limit_req"] == "REJECTED" and e["key"] == "alice" for e in ngx.access_log())


def test_metrics_acl(start_nginx, client):
    allowed = start_nginx("allowed", metrics_allow_cidrs=("127.0.0.0/8", "::1/128"))
    resp = client.get(allowed.url("/metrics"))
    assert resp.status_code == 200
    assert "sse_upstream_requests_total" in resp.text

    denied = start_nginx("denied", metrics_allow_cidrs=("10.0.0.0/8",))
    resp = client.get(denied.url("/metrics"))
    assert resp.status_code == 403
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "forbidden"


def test_health_from_loopback_without_key(start_nginx, client):
    ngx = start_nginx()
    for host in ("127.0.0.1", "::1"):
        resp = client.get(ngx.url("/health", host=host))
        assert resp.status_code == 200, host
    # unknown paths: JSON 404, not the upstream
    resp = client.get(ngx.url("/admin"))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"


def test_upstream_down_gives_json_502(start_nginx, client, keys):
    ngx = start_nginx(upstream_port=free_port())
    resp = client.get(ngx.url("/v1/models"), headers=bearer(keys["alice"]))
    assert resp.status_code == 502
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "upstream_unavailable"


def test_tls_versions_and_session_resumption(start_nginx, tls):
    ngx = start_nginx()
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        ctx = tls.context()
        ctx.minimum_version = ctx.maximum_version = version
        with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as s:
                assert s.version() == version.name.replace("v1_", "v1.")
    # the shared session cache resumes TLS 1.2 sessions
    ctx = tls.context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as s:
            session = s.session
    with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=SERVER_NAME, session=session) as s:
            assert s.session_reused


def test_sse_chunks_pass_through_unbuffered_and_ttft_matches_direct(start_nginx, client, keys, upstream, record_property):
    ngx = start_nginx()
    proxied_url, headers = ngx.url("/v1/completions"), bearer(keys["alice"])
    direct_url = f"{upstream.base}/v1/completions"

    with httpx.Client(timeout=httpx.Timeout(10.0)) as direct:
        # warm both keepalive connections (TLS handshake, upstream pool)
        stream_completion(client, proxied_url, headers, chunks=1)
        stream_completion(direct, direct_url, {}, chunks=1)

        runs = [stream_completion(client, proxied_url, headers) for _ in range(3)]
        direct_runs = [stream_completion(direct, direct_url, {}) for _ in range(3)]

        ttft_direct, ttft_proxied = [], []
        for _ in range(5):  # interleaved, 2-chunk streams to stay under the rate limit
            ttft_direct.append(stream_completion(direct, direct_url, {}, chunks=2).ttft)
            ttft_proxied.append(stream_completion(client, proxied_url, headers, chunks=2).ttft)
            time.sleep(0.1)

    lags = [lag for run in runs for lag in run.lags]
    direct_lags = [lag for run in direct_runs for lag in run.lags]
    overhead = statistics.median(ttft_proxied) - statistics.median(ttft_direct)
    print(f"\nper-chunk lag through nginx (ms): {[ms(r.lags) for r in runs]}"
          f"\nper-chunk lag direct (ms): median {statistics.median(direct_lags) * 1000:.2f}, "
          f"max {max(direct_lags) * 1000:.2f}"
          f"\nthrough nginx: median {statistics.median(lags) * 1000:.2f} ms, max {max(lags) * 1000:.2f} ms"
          f"\nTTFT direct (ms): {ms(ttft_direct)}\nTTFT proxied (ms): {ms(ttft_proxied)}"
          f"\nTTFT median overhead: {overhead * 1000:.2f} ms")
    record_property("chunk_lag_ms_max", max(lags) * 1000)
    record_property("ttft_overhead_ms", overhead * 1000)

    assert runs[0].headers["x-accel-buffering"] == "no"
    assert runs[0].headers["content-type"].startswith("text/event-stream")
    assert_streamed_unbuffered(runs)
    assert overhead < MAX_TTFT_OVERHEAD_S, f"TTFT overhead {overhead * 1000:.1f} ms"
    assert min(ttft_proxied) >= FIRST_DELAY_MS / 1000  # sanity: we timed the real first chunk


def test_negative_control_buffering_is_detected(start_nginx, client, keys):
    """With proxy_buffering on, the same measurement must fail; otherwise the
    positive test could never fail."""
    ngx = start_nginx(stream_buffering=True)
    url, headers = ngx.url("/v1/completions"), bearer(keys["alice"])
    stream_completion(client, url, headers, chunks=1)  # warm up
    runs = [stream_completion(client, url, headers) for _ in range(3)]
    print(f"\nNEGATIVE CONTROL (proxy_buffering on) per-chunk lag (ms): {[ms(r.lags) for r in runs]}"
          f"\n  TTFT (ms): {ms(r.ttft for r in runs)}")
    with pytest.raises(AssertionError):
        assert_streamed_unbuffered(runs)
    # buffering held the first chunk until (nearly) the end of the stream
    assert max(runs[0].lags) > (CHUNKS - 2) * CHUNK_DELAY_MS / 1000
