#!/usr/bin/env python3
"""A tiny stand-in for ``systemctl`` (and ``logger``) so files/monitor/recover.sh can run
on a machine without systemd. Symlink it as ``systemctl`` and ``logger`` into a directory
that comes first on PATH; it dispatches on the name it was called by. Stdlib only.

State lives in ``$FIMFLEET_SYSTEMCTL_SHIM_DIR``:

* ``unit.json``   {"unit", "argv", "env", "cwd", "log", "stop_timeout_s"}: the ONE managed
  unit (the engine), written by the test;
* ``main.pid``    main PID of the running engine; it leads its own process group
  (``start_new_session``), which stands in for the unit's cgroup;
* ``pgids``       every process group ever started, one a line (for the test's teardown);
* ``calls.log``   one JSON line per call: time, argv, exit code, note;
* ``journal.log`` what ``logger`` was given.

Behaviour, modelled on systemd:

* ``is-active [-q] UNIT``: active iff the main PID is alive and not a zombie. A stopped
  (SIGSTOP) process is still active, as it is for systemd. ``nginx`` is always active.
* ``stop``/``restart UNIT``: SIGTERM then SIGCONT to the whole group (systemd sends SIGCONT
  after SIGTERM so stopped processes can act on it), wait up to ``stop_timeout_s``, then
  SIGKILL the group; ``restart`` then starts the recorded argv/env again. Returns after
  the fork, like ``Type=simple``.
* ``start UNIT``: start unless active.
* ``kill [--signal=SIG|-s SIG] UNIT``: send SIG (default SIGTERM) to the whole group.
* ``reset-failed UNIT``: no-op.
* ``show -p ActiveEnterTimestamp --value UNIT``: when the running engine was started, in
  systemd's format (empty when it is not running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ALWAYS_ACTIVE = {"nginx"}


def _dir() -> Path:
    return Path(os.environ["FIMFLEET_SYSTEMCTL_SHIM_DIR"])


def _unit_name(name: str) -> str:
    return name[: -len(".service")] if name.endswith(".service") else name


def _stat(pid: int):
    """(state, pgrp) of pid, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _main_pid() -> int | None:
    try:
        return int((_dir() / "main.pid").read_text())
    except (OSError, ValueError):
        return None


def is_active() -> bool:
    pid = _main_pid()
    if pid is None:
        return False
    st = _stat(pid)
    # the main pid leads its group; a recycled pid would not
    return bool(st) and st[0] not in ("Z", "X") and st[1] == pid


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop(unit: dict) -> str:
    pgid = _main_pid()
    if pgid is None or not group_members(pgid):
        return "not running"
    _killpg(pgid, signal.SIGTERM)
    _killpg(pgid, signal.SIGCONT)
    if _wait_gone(pgid, float(unit.get("stop_timeout_s", 60))):
        return "stopped by SIGTERM"
    _killpg(pgid, signal.SIGKILL)
    _wait_gone(pgid, 15)
    return "stop timeout: SIGKILLed"


def start(unit: dict) -> str:
    if is_active():
        return "already active"
    with open(unit["log"], "ab") as log:
        log.write(f"\n==== systemctl shim: start at {time.time():.3f}\n".encode())
        log.flush()
        proc = subprocess.Popen(unit["argv"], env=unit["env"], cwd=unit.get("cwd") or None,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (_dir() / "main.pid").write_text(str(proc.pid))
    (_dir() / "started.at").write_text(f"{time.time():.3f}")
    with open(_dir() / "pgids", "a") as fh:
        fh.write(f"{proc.pid}\n")
    return f"started pid {proc.pid}"


def _signal(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))


def systemctl(args: list[str]) -> tuple[int, str]:
    quiet, sig, words, prop = False, signal.SIGTERM, [], ""
    it = iter(args)
    for a in it:
        if a in ("-q", "--quiet"):
            quiet = True
        elif a in ("-p", "--property"):
            prop = next(it, "")
        elif a.startswith("--property="):
            prop = a.split("=", 1)[1]
        elif a.startswith("--signal="):
            sig = _signal(a.split("=", 1)[1])
        elif a in ("-s", "--signal"):
            sig = _signal(next(it))
        elif a.startswith("-"):
            pass  # --no-block, --no-pager, ...: irrelevant here
        else:
            words.append(a)
    if len(words) != 2:
        return 2, f"shim supports VERB UNIT only, got {words}"
    verb, name = words[0], _unit_name(words[1])
    unit = json.loads((_dir() / "unit.json").read_text())
    if name in ALWAYS_ACTIVE:
        if verb == "is-active" and not quiet:
            print("active")
        return 0, "always active"
    if name != _unit_name(unit["unit"]):
        if verb == "is-active":
            if not quiet:
                print("inactive")
            return 4, "unknown unit"
        print(f"Failed to {verb} {words[1]}: Unit {words[1]} not found.", file=sys.stderr)
        return 5, "unknown unit"
    if verb == "is-active":
        active = is_active()
        if not quiet:
            print("active" if active else "inactive")
        return (0 if active else 3), ("active" if active else "inactive")
    if verb == "start":
        return 0, start(unit)
    if verb == "stop":
        return 0, stop(unit)
    if verb == "restart":
        note = stop(unit)
        return 0, note + "; " + start(unit)
    if verb == "kill":
        pgid = _main_pid()
        members = group_members(pgid) if pgid else []
        if members:
            _killpg(pgid, sig)
        return 0, f"signal {sig} to {len(members)} process(es)"
    if verb == "reset-failed":
        return 0, "ok"
    if verb == "show" and prop == "ActiveEnterTimestamp":
        at = (_dir() / "started.at").read_text() if is_active() and (_dir() / "started.at").exists() else ""
        print(time.strftime("%a %Y-%m-%d %H:%M:%S %Z", time.localtime(float(at))) if at else "")
        return 0, "shown"
    return 2, f"verb {verb!r} not supported by the shim"


def logger(args: list[str]) -> int:
    tag, msg, it = "", [], iter(args)
    for a in it:
        if a in ("-t", "--tag"):
            tag = next(it, "")
        elif a == "--":
            msg.extend(it)
        elif a.startswith("-"):
            continue
        else:
            msg.append(a)
    with open(_dir() / "journal.log", "a") as fh:
        fh.write(f"{time.time():.3f} {tag}: {' '.join(msg)}\n")
    return 0


def main() -> int:
    prog = Path(sys.argv[0]).name
    if prog == "logger":
        return logger(sys.argv[1:])
    t = time.time()
    try:
        rc, note = systemctl(sys.argv[1:])
    except Exception as exc:  # log it, then fail like a broken systemctl would
        rc, note = 1, f"shim error: {exc!r}"
        print(note, file=sys.stderr)
    with open(_dir() / "calls.log", "a") as fh:
        fh.write(json.dumps({"t": t, "end": time.time(), "argv": sys.argv[1:], "rc": rc, "note": note}) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
