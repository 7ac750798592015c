"""A small fake of vLLM's OpenAI-compatible streaming ``/v1/completions``, for tests.

Threaded HTTP/1.1 server on 127.0.0.1 with keepalive and chunked SSE, like uvicorn:

* ``POST /v1/completions`` with ``stream: true`` answers ``data: {...}`` chunks, one
  per "token", after ``ttft_s``, with ``inter_chunk_s`` between them, then (when the
  request asked for ``stream_options.include_usage``) a usage chunk with empty
  ``choices``, then ``data: [DONE]``;
* bearer-key check (401 like vLLM's ``--api-key``);
* modes: ``ok``, ``error`` (HTTP 500), ``stall`` (reads the request, never answers),
  ``stall_after_first`` (headers + one token, then silence), ``drop_after_first`` (headers +
  one token, then the connection closes mid-body, as when the engine dies), ``error_midstream``
  (an ``error`` event instead of the 2nd token), and ``fail_every=N`` (every N-th
  completion request gets a 500);
* ``GET /metrics``: a Prometheus ``vllm:time_to_first_token_seconds`` histogram
  measured server-side (request parsed -> first token written), like vLLM's;
* optional TLS (``certfile``/``keyfile``); ``make_test_pki`` creates a CA and a
  server certificate for 127.0.0.1 with ``cryptography``.

It records every request (``requests``) and counts TCP connections
(``connections``), so tests can check prompts and keepalive.

Run by hand: ``python tests/integration/fake_vllm.py --port 8000 --ttft 0.05``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class FakeConfig:
    """Behaviour of the fake engine; may be changed while the server runs."""

    api_keys: tuple[str, ...] = ("test-key",)
    """Accepted bearer keys (empty = no auth)."""
    model: str = "fake-qwen"
    """Served model name (requests for another model get 404, as in vLLM)."""
    ttft_s: float = 0.01
    """Delay between reading the request and the first token chunk."""
    inter_chunk_s: float = 0.002
    """Delay between token chunks."""
    tokens: Optional[int] = None
    """Tokens per completion (default: the request's max_tokens)."""
    mode: str = "ok"
    """ok | error | stall | stall_after_first | drop_after_first | error_midstream."""
    fail_every: int = 0
    """If > 0, every N-th completion request answers 500."""
    include_usage: bool = True
    """Honour stream_options.include_usage (False = behave like a server that ignores it)."""
    empty_first_chunk: bool = False
    """Send a chunk with empty text before the first token (must not count as TTFT)."""
    merge_every: int = 1
    """Put this many tokens into each SSE chunk (SSE chunks can merge tokens)."""
    token_text: str = "x"
    """Text of every token."""


@dataclass
class _Metrics:
    buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, le in enumerate(TTFT_BUCKETS):
            if seconds <= le:
                self.buckets[i] += 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    # -- helpers -----------------------------------------------------------------
    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _event(self, obj: Any) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"data: {payload}\n\n".encode())

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the server stops; False when stopping."""
        return not self.server.fake.stopping.wait(seconds)

    # -- routes ------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        fake = self.server.fake
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/metrics":
            body = fake.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": fake.config.model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self) -> None:  # noqa: N802
        fake = self.server.fake
        cfg = fake.config
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        arrived = time.perf_counter()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "invalid JSON", "code": 400}})
            return
        with fake.lock:
            fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
            n = sum(1 for r in fake.requests if r["path"] == "/v1/completions")
        if self.path != "/v1/completions":
            self._json(404, {"error": {"message": "not found", "code": 404}})
            return
        if cfg.api_keys:
            auth = self.headers.get("Authorization", "")
            if not any(auth == f"Bearer {k}" for k in cfg.api_keys):
                self._json(401, {"error": "Unauthorized"})
                return
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > 4:  # vLLM's OpenAI schema: at most 4 stop strings
            self._json(400, {"error": {"message": "body.stop: List should have at most 4 items after validation",
                                       "type": "BadRequestError", "code": 400}})
            return
        if body.get("model") != cfg.model:
            self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                       "type": "NotFoundError", "code": 404}})
            return
        if cfg.mode == "error" or (cfg.fail_every and n % cfg.fail_every == 0):
            self._json(500, {"error": {"message": "EngineCore encountered an issue",
                                       "type": "InternalServerError", "code": 500}})
            return
        if cfg.mode == "stall":
            self._wait(3600)
            self.close_connection = True
            return
        ntok = cfg.tokens if cfg.tokens is not None else int(body.get("max_tokens") or 16)
        rid = f"cmpl-{n}"

        def chunk(text: str, finish: Optional[str] = None) -> dict:
            return {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": cfg.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish, "stop_reason": None}]}

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if cfg.empty_first_chunk:
                self._event(chunk(""))
            if not self._wait(cfg.ttft_s):
                return
            sent = 0
            first = True
            while sent < ntok:
                if not first and not self._wait(cfg.inter_chunk_s):
                    return
                k = min(cfg.merge_every, ntok - sent)
                sent += k
                if not first and cfg.mode == "error_midstream":
                    self._event({"error": {"message": "engine died", "type": "InternalServerError",
                                           "code": 500}})
                    self._event("[DONE]")
                    self._chunk(b"")
                    return
                self._event(chunk(cfg.token_text * k, "length" if sent >= ntok else None))
                if first:
                    with fake.lock:
                        fake.ttft.observe(time.perf_counter() - arrived)
                    first = False
                    if cfg.mode == "stall_after_first":
                        self._wait(3600)
                        self.close_connection = True
                        return
                    if cfg.mode == "drop_after_first":
                        self.close_connection = True  # no last chunk: the body ends mid-stream
                        return
            opts = body.get("stream_options") or {}
            if cfg.include_usage and opts.get("include_usage"):
                self._event({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": cfg.model, "choices": [],
                             "usage": {"prompt_tokens": len(str(body.get("prompt", ""))) // 4,
                                       "completion_tokens": ntok,
                                       "total_tokens": ntok + len(str(body.get("prompt", ""))) // 4}})
            self._event("[DONE]")
            self._chunk(b"")  # end of chunked body; the connection stays open
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: "FakeVllm"

    def get_request(self):  # type: ignore[override]
        sock, addr = super().get_request()
        # Like uvicorn (asyncio transports), send small SSE writes at once (no Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.fake.lock:
            self.fake.connections += 1
        if self.fake.ssl_context is not None:
            sock = self.fake.ssl_context.wrap_socket(sock, server_side=True,
                                                     do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address) -> None:  # quiet on client resets
        pass


class FakeVllm:
    """The fake engine. Use as a context manager or call start()/stop()."""

    def __init__(self, config: Optional[FakeConfig] = None, *, certfile: Optional[str] = None,
                 keyfile: Optional[str] = None, port: int = 0) -> None:
        self.config = config or FakeConfig()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.ttft = _Metrics()
        self.ssl_context: Optional[ssl.SSLContext] = None
        if certfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(certfile, keyfile)
            self.ssl_context = ctx
        self._port = port
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def completion_requests(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["path"] == "/v1/completions"]

    def reset_stats(self) -> None:
        with self.lock:
            self.requests.clear()
            self.connections = 0

    def metrics_text(self) -> str:
        m, model = self.ttft, self.config.model
        labels = f'engine="0",model_name="{model}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 0.0",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f"vllm:time_to_first_token_seconds_sum{{{labels}}} {m.total!r}",
        ]
        for le, c in zip(TTFT_BUCKETS, m.buckets):
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",'
                         f'model_name="{model}"}} {float(c)}')
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",'
                     f'model_name="{model}"}} {float(m.count)}')
        lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {float(m.count)}")
        return "\n".join(lines) + "\n"

    def start(self) -> "FakeVllm":
        self._server = _Server(("127.0.0.1", self._port), _Handler)
        self._server.fake = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "FakeVllm":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def make_test_pki(directory: str, hostnames: tuple[str, ...] = ("localhost",),
                  ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """Create a test CA and a server cert signed by it; returns paths and PEM texts.

    Keys: ``ca_pem`` (PEM text), ``ca_file``, ``cert_file``, ``key_file``, ``cert_pem``.
    """
    from components.tls import issue

    pems = issue(hostnames[0], list(hostnames), list(ips), days=1)
    paths = {
        "ca_file": os.path.join(directory, "ca.pem"),
        "cert_file": os.path.join(directory, "server.pem"),
        "key_file": os.path.join(directory, "server.key"),
    }
    for key, name in (("caPem", "ca_file"), ("certPem", "cert_file"), ("keyPem", "key_file")):
        with open(paths[name], "w") as fh:
            fh.write(pems[key])
    os.chmod(paths["key_file"], 0o600)
    return {**paths, "ca_pem": pems["caPem"], "cert_pem": pems["certPem"]}


def make_self_signed(directory: str, ip: str = "127.0.0.1") -> dict[str, str]:
    """A self-signed server certificate (CA:FALSE), as users often bring: no CA at all.

    Keys: ``cert_pem`` (PEM text), ``cert_file``, ``key_file``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = _dt.datetime.now(_dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fimfleet self-signed node")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = {"cert_file": os.path.join(directory, "self.pem"),
             "key_file": os.path.join(directory, "self.key")}
    cert_pem = cert.public_bytes(pem).decode()
    with open(paths["cert_file"], "w") as fh:
        fh.write(cert_pem)
    with open(paths["key_file"], "wb") as fh:
        fh.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    os.chmod(paths["key_file"], 0o600)
    return {**paths, "cert_pem": cert_pem}


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.01)
    p.add_argument("--mode", default="ok")
    p.add_argument("--key", action="append", default=None)
    p.add_argument("--model", default="fake-qwen")
    a = p.parse_args()
    cfg = FakeConfig(api_keys=tuple(a.key or ("test-key",)), model=a.model, ttft_s=a.ttft,
                     inter_chunk_s=a.itl, mode=a.mode)
    with FakeVllm(cfg, port=a.port) as fake:
        print(f"fake vLLM on {fake.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
