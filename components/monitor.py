"""Monitor: a deep FIM probe through the local ingress every few seconds, and recovery.

`/health` answers 200 while an engine hangs (vLLM #39863: a stopped EngineCore), so
liveness is a real one-token completion with a key. A probe that fails is not enough to
restart, because a busy engine queues the probe behind real work: recover.sh also reads
vLLM's own token counters from the engine's loopback /metrics, and

    hung  = the probe failed, at least `failure_threshold` probes in a row, AND the engine
            finished no step for `stall_s` seconds: none of vllm:prompt_tokens_total,
            vllm:generation_tokens_total, vllm:kv_cache_usage_perc,
            vllm:num_requests_running|waiting moved (the engine core reports them after
            each decode step or prefill chunk, so they freeze when it hangs);
    busy  = the probe failed but those metrics moved: not counted, never restarted.

An engine that is starting is never judged: after the monitor's own restart, and after any
other start of its unit (a deploy's start.sh) until a probe has passed, failed probes count
as the start grace (the tier's start timeout), not as a hang. Such a round is recorded as
`starting`, which Prometheus's down and probe alerts wait on (files/prometheus/).

`stall_s` must exceed the engine's longest single step (a full max-num-batched-tokens
prefill chunk), or a healthy engine inside one long step looks hung.

The probe timeout comes from the SLA (twice the TTFT p99, at least 5 s), capped so that
the rounds needed for a verdict fit DETECT_BUDGET_S. A restart escalates to SIGKILL of
that engine's processes and clears its shared memory. Scripts and units: files/monitor/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pulumi

from components import models, templates
from components.engine import served_name
from components.remote import RemoteStep

ETC = "/etc/fimfleet"
DETECT_BUDGET_S = 60
"""A hung engine must see its restart within this many seconds (issue 10 item 7)."""
MIN_PROBE_TIMEOUT_S = 5
"""Floor of the derived probe timeout: TLS, nginx and scheduling noise on a loaded host."""
METRICS_TIMEOUT_S = 2
"""/metrics is served by the API server from memory; an answer slower than this is no answer."""
RESTART_TIMEOUT_S = 90


@dataclass(frozen=True)
class Settings:
    """The monitor's effective timing for one node (config values, or derived from the SLA)."""

    interval_s: int
    """Pause between rounds (the timer's OnUnitInactiveSec)."""
    failure_threshold: int
    probe_timeout_s: int
    stall_s: int
    metrics_timeout_s: int = METRICS_TIMEOUT_S

    @property
    def round_s(self) -> int:
        """Longest round on a hung engine: pause, probe timeout, then the /metrics read."""
        return self.interval_s + self.probe_timeout_s + self.metrics_timeout_s

    @property
    def detection_bound_s(self) -> int:
        """Worst case from a hang to the restart call: the first round end with enough failures and
        stall. The stall is counted in whole seconds and grows by at least pause + probe timeout a
        round (/metrics may answer at once), while a round takes at most round_s."""
        rounds = max(self.failure_threshold,
                     math.ceil((self.stall_s + 1) / (self.interval_s + self.probe_timeout_s)))
        return rounds * self.round_s


@dataclass(frozen=True)
class MonitorArgs:
    """What one node's monitor needs: its timing, where its engine and ingress listen, and the
    model's FIM format for the probe."""

    node: str
    settings: Settings
    grace_s: int
    """No verdict while the engine may still be starting: the runtime's start timeout."""
    https_port: int
    engine_port: int
    model: str
    """The served model name the probe asks for."""
    fim: models.FimFormat | None = models.QWEN_FIM


def args_for(cfg, node: str) -> MonitorArgs:
    """A validated StackConfig's monitor settings for `node`."""
    return MonitorArgs(node=node, settings=settings(cfg), grace_s=cfg.runtime.start_timeout_s,
                       https_port=cfg.ingress.https_port, engine_port=cfg.engine.port, model=served_name(cfg),
                       fim=cfg.model_spec.fim if cfg.model_spec else None)


def settings(cfg) -> Settings:
    m = cfg.monitor
    timeout = m.probe_timeout_s
    if timeout is None:
        from_sla = max(MIN_PROBE_TIMEOUT_S, math.ceil(2 * cfg.sla.ttft_p99_ms / 1000))
        cap = DETECT_BUDGET_S // m.failure_threshold - m.interval_s - METRICS_TIMEOUT_S
        timeout = max(MIN_PROBE_TIMEOUT_S, min(from_sla, cap))
    return Settings(interval_s=m.interval_s, failure_threshold=m.failure_threshold, probe_timeout_s=timeout,
                    stall_s=m.stall_s)


def names(node: str) -> dict[str, str]:
    base = f"fimfleet-monitor-{node}"
    return {"service": f"{base}.service", "timer": f"{base}.timer", "lib_dir": f"/usr/local/lib/fimfleet/monitor-{node}",
            "env_file": f"{ETC}/monitor-{node}.env", "key_file": f"{ETC}/monitor-{node}.key",
            "ca_file": f"{ETC}/monitor-{node}-ca.pem"}


def state_dir(unit: str) -> str:
    """recover.sh's counters (tmpfs: a reboot starts them afresh); destroy.sh removes it."""
    return f"/run/fimfleet/monitor-{Path(unit).stem}"


NONCE = "@NONCE@"
"""fim-probe.sh replaces this in PROBE_BODY with the time, so no probe is a prefix-cache hit."""


def env_file(s: Settings, *, unit: str, container: str, service_user: str, grace_s: int, probe_url: str,
             metrics_url: str, key_file: str, ca_file: str, model: str, state: str | None = None,
             fim: models.FimFormat | None = models.QWEN_FIM) -> str:
    """The env file recover.sh sources (as root, every round): every value is shell-quoted."""
    probe_body = models.fim_body(fim, model, prefix=f"def probe_{NONCE}(x):\n    return ")
    return templates.render(
        "monitor/monitor.env.j2", unit=unit, container=container, service_user=service_user,
        state_dir=state or state_dir(unit),
        failure_threshold=s.failure_threshold, grace_s=grace_s, probe_url=probe_url, metrics_url=metrics_url,
        key_file=key_file, ca_file=ca_file, probe_timeout_s=s.probe_timeout_s, stall_s=s.stall_s,
        metrics_timeout_s=s.metrics_timeout_s, restart_timeout_s=RESTART_TIMEOUT_S, probe_body=probe_body)


def render_files(args: MonitorArgs, unit: str, key: str, ca_pem: str, *, service_user: str = "",
                 container: str = "") -> list[dict]:
    """unit, service_user (systemd runtime) and container (docker runtime) are the runtime's outputs."""
    n = names(args.node)
    s = args.settings
    env = env_file(s, unit=unit, container=container, service_user=service_user,
                   grace_s=args.grace_s, probe_url=f"https://127.0.0.1:{args.https_port}",
                   metrics_url=f"http://127.0.0.1:{args.engine_port}/metrics", key_file=n["key_file"],
                   ca_file=n["ca_file"], model=args.model, fim=args.fim)
    return [
        {"path": f"{n['lib_dir']}/fim-probe.sh", "mode": "0755", "content": (templates.FILES / "monitor/fim-probe.sh").read_text()},
        {"path": f"{n['lib_dir']}/recover.sh", "mode": "0755", "content": (templates.FILES / "monitor/recover.sh").read_text()},
        {"path": n["key_file"], "mode": "0600", "content": key},
        {"path": n["ca_file"], "mode": "0644", "content": ca_pem},
        {"path": n["env_file"], "mode": "0600", "content": env},
        {"path": f"/etc/systemd/system/{n['service']}", "mode": "0644", "content": templates.render(
            "monitor/monitor.service.j2", unit=unit,
            round_timeout_s=s.probe_timeout_s + s.metrics_timeout_s + RESTART_TIMEOUT_S + 60, **n)},
        {"path": f"/etc/systemd/system/{n['timer']}", "mode": "0644", "content": templates.render(
            "monitor/monitor.timer.j2", unit=unit, interval_s=s.interval_s, accuracy_s=1)},
    ]


def scripts(args: MonitorArgs, unit: str) -> dict[str, str]:
    """The monitor step's apply/check/destroy scripts, rendered exactly as they deploy."""
    kw = dict(unit=unit, unit_base=Path(unit).stem, interval_s=args.settings.interval_s, **names(args.node))
    return {t: templates.render(f"monitor/{t}.sh.j2", **kw) for t in ("apply", "check", "destroy")}


class Monitor(pulumi.ComponentResource):
    """Probe + recovery timer for one node's engine; see module docstring."""

    def __init__(self, name: str, args: MonitorArgs, unit: str, connection: pulumi.Input[dict],
                 probe_key: pulumi.Input[str], ca_pem: pulumi.Input[str], service_user: str = "", container: str = "",
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:monitor:Monitor", name, None, opts)
        n = names(args.node)
        files = pulumi.Output.all(probe_key, ca_pem).apply(lambda a: render_files(
            args, unit, a[0], a[1], service_user=service_user, container=container))
        sh = scripts(args, unit)
        self.step = RemoteStep(f"{name}-timer", label="monitor timer", connection=connection, files=files,
                               apply=sh["apply"], check=sh["check"], destroy=sh["destroy"],
                               opts=pulumi.ResourceOptions(parent=self))
        self.timer = n["timer"]
        self.register_outputs({"timer": self.timer})
