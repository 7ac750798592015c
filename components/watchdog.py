"""Watchdog: systemd's hardware watchdog on the host (fimfleet:monitor.watchdog).

PID 1 pets the watchdog device; a host whose kernel or PID 1 stops answering reboots. It is
host-wide (system.conf.d), so HostBase owns it, once per host, however many nodes it serves;
turning it off deletes the step, whose destroy removes the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from components import templates

PATH = "/etc/systemd/system.conf.d/90-fimfleet-watchdog.conf"
RUNTIME_S = "30s"
"""RuntimeWatchdogSec: how long PID 1 may go without petting the device."""


@dataclass(frozen=True)
class WatchdogSteps:
    files: list[dict]
    apply: str
    check: str
    destroy: str


def render() -> WatchdogSteps:
    kw = dict(path=PATH, runtime_s=RUNTIME_S)
    check = templates.render("watchdog/check.sh.j2", **kw)
    return WatchdogSteps(
        files=[{"path": PATH, "mode": "0644", "content": templates.render("watchdog/watchdog.conf.j2", watchdog_s=RUNTIME_S)}],
        apply=templates.render("watchdog/apply.sh.j2", check=check, **kw), check=check,
        destroy=templates.render("watchdog/destroy.sh.j2", **kw))
