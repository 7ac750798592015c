"""A tiny OpenAI-ish streaming upstream for ingress tests (stdlib only, asyncio).

Stands in for vLLM on 127.0.0.1. Endpoints:

* ``POST /v1/completions``  with ``"stream": true`` -> SSE over chunked encoding:
  one ``data: {...}`` event per chunk, then ``data: [DONE]``. Each event carries
  ``x_seq`` and ``x_sent_monotonic``: ``time.monotonic()`` taken right before the
  chunk is written to the socket (CLOCK_MONOTONIC is system-wide on Linux, so a
  client process on the same host can compare it with its own receive time).
  Chunk count = ``max_tokens`` (default --chunks); ``x_delay_ms`` and
  ``x_first_delay_ms`` in the body override --delay-ms / --first-delay-ms.
  Without ``stream`` it answers one JSON completion.
* ``GET /v1/models``        small JSON (cheap request for rate-limit floods).
* ``GET /health``           200, empty body (like vLLM).
* ``GET /metrics``          Prometheus text.
* ``GET /debug/last``       JSON: headers of the last /v1/ request, the send
  times of the last stream, and counters of accepted connections and requests.

Run: ``python sse_upstream.py --port 0 --port-file /tmp/x.port``; the bound port
is written atomically to --port-file (and printed as ``READY <port>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

STATE = {"requests": 0, "streams": 0, "connections": 0, "last_headers": {}, "last_sent": []}


def _response(status: int, body: bytes, ctype: str, keep_alive: bool) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(status, "OK")
    head = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {ctype}",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive" if keep_alive else "Connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _stream(writer: asyncio.StreamWriter, req: dict, args: argparse.Namespace) -> None:
    chunks = int(req.get("max_tokens") or args.chunks)
    delay = float(req.get("x_delay_ms", args.delay_ms)) / 1000.0
    first_delay = float(req.get("x_first_delay_ms", args.first_delay_ms)) / 1000.0
    STATE["streams"] += 1
    sent: list[float] = []
    STATE["last_sent"] = sent
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
    )
    await writer.drain()
    cid = f"cmpl-{os.getpid()}-{STATE['streams']}"
    for seq in range(chunks):
        await asyncio.sleep(first_delay if seq == 0 else delay)
        now = time.monotonic()
        event = {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": "sse-test",
            "choices": [{"index": 0, "text": f"tok{seq} ", "logprobs": None,
                         "finish_reason": "length" if seq == chunks - 1 else None}],
            "x_seq": seq,
            "x_sent_monotonic": now,
        }
        sent.append(now)
        writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
        await writer.drain()
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args) -> None:
    STATE["connections"] += 1
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = b""
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            keep_alive = headers.get("connection", "").lower() != "close"
            path = target.split("?", 1)[0]
            STATE["requests"] += 1
            if path.startswith("/v1/"):
                STATE["last_headers"] = headers

            if path == "/v1/completions" and method == "POST":
                try:
                    req = json.loads(body or b"{}")
                except ValueError:
                    writer.write(_response(400, b'{"error":"bad json"}', "application/json", keep_alive))
                    req = None
                if req is not None and req.get("stream"):
                    await _stream(writer, req, args)
                elif req is not None:
                    out = {"id": "cmpl-x", "object": "text_completion", "model": "sse-test",
                           "choices": [{"index": 0, "text": "tok0", "finish_reason": "length"}]}
                    writer.write(_response(200, json.dumps(out).encode(), "application/json", keep_alive))
            elif path == "/v1/models" and method == "GET":
                out = {"object": "list", "data": [{"id": "sse-test", "object": "model"}]}
                writer.write(_response(200, json.dumps(out).encode(), "application/json", keep_alive))
            elif path == "/health":
                writer.write(_response(200, b"", "text/plain", keep_alive))
            elif path == "/metrics":
                text = (
                    "# HELP sse_upstream_requests_total Requests seen.\n"
                    "# TYPE sse_upstream_requests_total counter\n"
                    f"sse_upstream_requests_total {STATE['requests']}\n"
                )
                writer.write(_response(200, text.encode(), "text/plain; version=0.0.4", keep_alive))
            elif path == "/debug/last":
                out = {"headers": STATE["last_headers"], "sent": STATE["last_sent"],
                       "connections": STATE["connections"], "requests": STATE["requests"]}
                writer.write(_response(200, json.dumps(out).encode(), "application/json", keep_alive))
            else:
                writer.write(_response(404, b'{"error":"not found"}', "application/json", keep_alive))
            await writer.drain()
            if not keep_alive:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def _main(args: argparse.Namespace) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, args), args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default="")
    p.add_argument("--chunks", type=int, default=5, help="chunks per stream")
    p.add_argument("--delay-ms", type=float, default=100.0, help="gap between chunks")
    p.add_argument("--first-delay-ms", type=float, default=0.0, help="simulated prefill before chunk 0")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
