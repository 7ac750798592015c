"""Integration tests: the REAL nginx, rendered by components/ingress_render.py, in
front of tests/integration/sse_upstream.py, all on 127.0.0.1 (harness: nginx_harness.py).

Clients verify TLS against a test CA generated here (never ``verify=False``).

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
import secrets
import socket
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers import free_port  # noqa: E402
# Other test modules import Nginx and make_tls from here: keep them re-exported.
from tests.integration.nginx_harness import (  # noqa: E402,F401
    BURST, CHUNK_DELAY_MS, CHUNKS, FIRST_DELAY_MS, RATE, SERVER_NAME, Nginx, TlsFiles, bearer, client, keys, make_tls,
    start_nginx, tls, upstream,
)

from components.ingress_render import access_log, keys_conf  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MAX_CHUNK_LAG_S = 0.020    # per-chunk (client receive - upstream send), median over streams
HARD_CHUNK_LAG_S = CHUNK_DELAY_MS / 2000  # no single chunk may be held half a gap
MAX_TTFT_OVERHEAD_S = 0.020


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


def assert_streamed_unbuffered(runs: list[StreamTiming], chunks: int = CHUNKS, hard_lag_s: float = HARD_CHUNK_LAG_S) -> None:
    """Every chunk reached the client as the upstream sent it (no chunk held `hard_lag_s` or more)."""
    for run in runs:
        assert run.status == 200
        assert [seq for seq, _, _ in run.events] == list(range(chunks)), "chunks missing or merged"
    per_chunk_median = [statistics.median(run.lags[i] for run in runs) for i in range(chunks)]
    worst = max(lag for run in runs for lag in run.lags)
    assert max(per_chunk_median) < MAX_CHUNK_LAG_S, (
        f"chunks held back by the proxy: median lag per chunk {[round(x * 1000, 1) for x in per_chunk_median]} ms")
    assert worst < hard_lag_s, f"a chunk was held {worst * 1000:.1f} ms (chunks are {CHUNK_DELAY_MS} ms apart)"
    for run in runs:  # arrivals keep the upstream's spacing
        arrivals = [recv for _, _, recv in run.events]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert min(gaps) > CHUNK_DELAY_MS / 2000, f"chunks arrived bunched: gaps {gaps}"


def ms(values) -> list[float]:
    return [round(v * 1000, 2) for v in values]


# -------------------------------------------------------------------------- tests


def test_plain_http_refuses_the_api_and_redirects_the_rest(start_nginx, keys):
    """A client misconfigured with http:// gets a JSON "use https" instead of a redirect that
    turns its POST into a GET, and port 80 logs nothing derived from its key."""
    ngx = start_nginx()
    base = f"http://127.0.0.1:{ngx.http_port}"
    for method in ("GET", "POST"):
        resp = httpx.request(method, f"{base}/v1/completions", headers=bearer(keys["alice"]),
                             json={"prompt": "x"}, timeout=5)
        assert resp.status_code == 403, method
        assert resp.headers["content-type"] == "application/json"
        assert "location" not in resp.headers
        error = resp.json()["error"]
        assert error["code"] == "https_required"
        assert f"https://{SERVER_NAME}:{ngx.https_port}/v1/" in error["message"]
        assert keys["alice"] not in resp.text and "alice" not in resp.text
    # everything else, the ACME challenge path included, keeps the 301 (query string kept)
    for path in ("/", "/v1", "/health?x=1", "/.well-known/acme-challenge/token-123"):
        resp = httpx.get(base + path, headers=bearer(keys["bob"]), timeout=5)
        assert resp.status_code == 301, path
        assert resp.headers["location"] == f"https://{SERVER_NAME}:{ngx.https_port}{path}"
    log = Path(access_log(ngx.spec)).read_text()
    plain = [json.loads(line) for line in log.splitlines()]
    assert len(plain) == 6 and {e["scheme"] for e in plain} == {"http"}
    assert all("key" not in e for e in plain)
    for secret in (keys["alice"], keys["bob"], "alice", "bob"):
        assert secret not in log


def test_body_over_the_limit_gets_json_413(start_nginx, client, keys):
    ngx = start_nginx(client_max_body_size="16k")
    url, headers = ngx.url("/v1/completions"), bearer(keys["alice"])
    small = {"model": "sse-test", "prompt": "x" * 15000, "max_tokens": 1}
    assert client.post(url, headers=headers, json=small).status_code == 200
    resp = client.post(url, headers=headers, json={**small, "prompt": "x" * 17000})
    assert resp.status_code == 413
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "request_too_large"


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
    logs = Path(access_log(ngx.spec)).read_text() + ngx.logs()
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
    assert 1 <= opened <= ngx.spec.base.worker_processes, opened


def test_revoking_one_key_leaves_the_others(start_nginx, client, keys, tls):
    ngx = start_nginx()
    url = ngx.url("/v1/models")
    assert {n: client.get(url, headers=bearer(k)).status_code for n, k in keys.items()} == dict.fromkeys(keys, 200)

    remaining = {n: k for n, k in keys.items() if n != "bob"}
    ngx.reload(api_keys=remaining)
    with httpx.Client(verify=tls.context(), timeout=10) as fresh:  # new connections, new workers
        after = {n: fresh.get(url, headers=bearer(k)).status_code for n, k in keys.items()}
    assert after == {"alice": 200, "bob": 401, "carol": 200}
    assert "bob" not in (ngx.prefix / keys_conf(ngx.spec.node)).read_text()
    assert oct((ngx.prefix / keys_conf(ngx.spec.node)).stat().st_mode & 0o777) == "0o600"


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


def openssl_handshake(port: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", SERVER_NAME,
                           *args], input="", capture_output=True, text=True, timeout=30)


def test_tls_versions_groups_and_no_session_resumption(start_nginx, tls):
    ngx = start_nginx()
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        ctx = tls.context()
        ctx.minimum_version = ctx.maximum_version = version
        with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as s:
                assert s.version() == version.name.replace("v1_", "v1.")
    # key exchange: Mozilla intermediate's groups only (secp521r1 and X448 used to be accepted)
    for group, accepted in (("X25519", True), ("P-256", True), ("P-384", True), ("P-521", False), ("X448", False)):
        out = openssl_handshake(ngx.https_port, "-groups", group, "-tls1_3")
        assert (out.returncode == 0) is accepted, (group, out.stdout[-500:], out.stderr[-500:])
    # TLS 1.2 also needs P-256 offered for the ECDSA P-256 certificate: the client prefers
    # the refused groups, the server skips them
    for offered, temp_key in (("X448:P-521:X25519:P-256", "X25519"), ("X448:P-521:P-384:P-256", "secp384r1")):
        out = openssl_handshake(ngx.https_port, "-groups", offered, "-tls1_2")
        assert out.returncode == 0 and f"Server Temp Key: {temp_key}" in out.stdout.replace("ECDH, ", ""), out.stdout
    # no session resumption (no cache, no tickets): a TLS 1.2 session is not resumed
    ctx = tls.context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as s:
            session = s.session
    with socket.create_connection(("127.0.0.1", ngx.https_port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=SERVER_NAME, session=session) as s:
            assert not s.session_reused


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
