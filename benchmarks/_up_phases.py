"""Where one `pulumi up` goes, read from the CLI's own verbose log (`-v=9 --logtostderr`).

The timed rounds of the no-op benchmark say how long; this says where. The CLI writes one
JSON line per event, each with its timestamp. Five marks cut the run into segments that add
up to the whole log span:

    cli          first line -> the language host's Run(): state, secrets manager, plugins
    program      Run() -> the first RegisterResource: the program's synchronous part (the
                 interpreter, the SDK's and the program's imports, config, building every
                 resource object); the SDK sends nothing before its event loop runs
    provider     -> the dynamic provider plugin's handshake: its own interpreter and SDK import
                 (0 for a program without a Python dynamic resource)
    resources    -> SignalAndWaitForShutdown: every registration and its check and diff
    teardown     -> the last line: the program's exit, the plugins killed, the state flushed

Verbose logging costs time itself, so these are one extra run per program, beside (not
inside) the timed rounds.
"""

from __future__ import annotations

import json
from datetime import datetime

MARKS = (
    ("program", "langhost[python].Run("),
    ("provider", "RegisterResource received"),
    ("resources", "Handshake"),
    ("teardown", "SignalAndWaitForShutdown waiting"),
)
"""(segment that starts at the mark, the mark's text): each segment ends where the next begins."""

SDK_DEBUG = "eventSink::Debug("
"""The engine's echo of each debug line a program's SDK sends, each one a blocking RPC."""


def _time(stamp: str) -> datetime:
    """The CLI's UTC stamps carry 0-9 fraction digits and a Z: kept to microseconds, all naive."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}")


def _events(log: str) -> list[tuple[datetime, str]]:
    out = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
            out.append((_time(event["time"]), event.get("msg", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # the CLI's plain-text lines (plugin stderr) carry no timestamp
    return out


def phases(log: str) -> dict:
    """Milliseconds per segment (see the module docstring), the registrations and SDK debug lines."""
    events = _events(log)
    if not events:
        raise ValueError("no timestamped line in the log: was it run with -v=9 --logtostderr?")
    start, end = events[0][0], events[-1][0]
    cuts = [("cli", start)]
    for name, text in MARKS:
        at = next((t for t, msg in events if text in msg and t >= cuts[-1][1]), None)
        # A mark that never came (no dynamic provider: no handshake) is a segment of length 0.
        cuts.append((name, at or cuts[-1][1]))
    ms = {name: round((nxt - at).total_seconds() * 1000)
          for (name, at), (_, nxt) in zip(cuts, cuts[1:] + [("end", end)])}
    return {"ms": ms, "total_ms": round((end - start).total_seconds() * 1000),
            "registrations": sum("RegisterResource received" in msg for _, msg in events),
            "sdk_debug_lines": sum(SDK_DEBUG in msg for _, msg in events)}
