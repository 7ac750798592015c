"""Monitor: a deep FIM probe through the local ingress every few seconds, and recovery.

`/health` answers 200 while an engine hangs, so liveness is a real one-token completion
with a key. After N failed probes in a row the recovery manager restarts the engine,
then escalates to SIGKILL of that engine's processes and clears its shared memory.
Scripts and units live in files/monitor/.
"""

from __future__ import annotations

from pathlib import Path

import pulumi

from components import templates
from components.config import StackConfig
from components.engine import served_name
from components.remote import RemoteStep
from components.runtime import SERVICE_USER

ETC = "/etc/fimfleet"


def names(node: str) -> dict[str, str]:
    base = f"fimfleet-monitor-{node}"
    return {"service": f"{base}.service", "timer": f"{base}.timer", "lib_dir": f"/usr/local/lib/fimfleet/monitor-{node}",
            "env_file": f"{ETC}/monitor-{node}.env", "key_file": f"{ETC}/monitor-{node}.key",
            "ca_file": f"{ETC}/monitor-{node}-ca.pem"}


def render_files(cfg: StackConfig, node: str, unit: str, key: str, ca_pem: str) -> list[dict]:
    n = names(node)
    m = cfg.monitor
    files = [
        {"path": f"{n['lib_dir']}/fim-probe.sh", "mode": "0755", "content": (templates.FILES / "monitor/fim-probe.sh").read_text()},
        {"path": f"{n['lib_dir']}/recover.sh", "mode": "0755", "content": (templates.FILES / "monitor/recover.sh").read_text()},
        {"path": n["key_file"], "mode": "0600", "content": key},
        {"path": n["ca_file"], "mode": "0644", "content": ca_pem},
        {"path": n["env_file"], "mode": "0600", "content": templates.render(
            "monitor/monitor.env.j2", unit=unit, container=f"vllm-{node}" if cfg.runtime.kind == "docker" else "",
            service_user=SERVICE_USER if cfg.runtime.kind == "systemd" else "", failure_threshold=m.failure_threshold,
            grace_s=cfg.runtime.start_timeout_s, probe_url=f"https://127.0.0.1:{cfg.ingress.https_port}",
            probe_timeout_s=m.probe_timeout_s, model=served_name(cfg), **n)},
        {"path": f"/etc/systemd/system/{n['service']}", "mode": "0644", "content": templates.render(
            "monitor/monitor.service.j2", unit=unit, round_timeout_s=m.probe_timeout_s + 150, **n)},
        {"path": f"/etc/systemd/system/{n['timer']}", "mode": "0644", "content": templates.render(
            "monitor/monitor.timer.j2", unit=unit, interval_s=m.interval_s, accuracy_s=max(1, m.interval_s // 10))},
    ]
    if m.watchdog:
        files.append({"path": "/etc/systemd/system.conf.d/90-fimfleet-watchdog.conf", "mode": "0644",
                      "content": templates.render("monitor/watchdog.conf.j2", watchdog_s="30s")})
    return files


class Monitor(pulumi.ComponentResource):
    """Probe + recovery timer for one node's engine; see module docstring."""

    def __init__(self, name: str, cfg: StackConfig, node: str, unit: str, connection: pulumi.Input[dict],
                 probe_key: pulumi.Input[str], ca_pem: pulumi.Input[str], opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:monitor:Monitor", name, None, opts)
        n = names(node)
        files = pulumi.Output.all(probe_key, ca_pem).apply(lambda a: render_files(cfg, node, unit, a[0], a[1]))
        kw = dict(unit=unit, unit_base=Path(unit).stem, interval_s=cfg.monitor.interval_s,
                  watchdog=cfg.monitor.watchdog, **n)
        self.step = RemoteStep(f"{name}-timer", label="monitor timer", connection=connection, files=files,
                               apply=templates.render("monitor/apply.sh.j2", **kw),
                               check=templates.render("monitor/check.sh.j2", **kw),
                               destroy=templates.render("monitor/destroy.sh.j2", **kw),
                               opts=pulumi.ResourceOptions(parent=self))
        self.timer = n["timer"]
        self.register_outputs({"timer": self.timer})
