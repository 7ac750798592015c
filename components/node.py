"""NodeService: one node on a prepared host (HostBase), from its engine to its SLA gate.

HostBase (preflight -> packages -> nginx || kernel tuning) -> (vLLM runtime || nginx site) -> monitor
-> FIM SLA check -> Prometheus and node_exporter. The SLA check's trigger hashes everything
deployed before it, the host's kernel tuning and identity included, so any change upstream
measures again and an unchanged stack does not.

`args_for` turns a validated StackConfig into NodeArgs, one typed args object per component;
the components never see the StackConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pulumi

from components import editors, ingress, keys, models, monitor, monitoring, runtime, sizing, templates
from components.config import StackConfig
from components.engine import served_name
from components.hostbase import LEGACY_NODE_TYPE, HostBase
from components.ingress import NginxIngress, tls_paths
from components.monitor import Monitor
from components.monitoring_args import ExporterArgs, MonitoringArgs
from components.runtime import VllmRuntime
from components.sla.provider import FimSlaCheck
from components.sla.thresholds import SlaThresholds


@dataclass(frozen=True)
class SlaArgs:
    """The node's SLA gate: its limits, how it samples, and the bytes each decoded token reads."""

    thresholds: SlaThresholds
    samples: int
    warmup: int
    concurrency: int
    max_tokens: int
    weight_bytes_per_token: float | None = None
    """For the decode ceiling (None: the model's size is unknown, so no ceiling)."""


@dataclass(frozen=True)
class NodeArgs:
    """Everything one node deploys on its host, per component, from a validated StackConfig."""

    host: str
    """The name of the HostBase it runs on."""
    runtime: runtime.RuntimeArgs
    ingress: ingress.IngressArgs
    monitor: monitor.MonitorArgs
    editors: editors.EditorArgs
    model: str
    """The served model name."""
    api_keys: dict[str, str]
    """The named users' keys (secrets): one set of editor outputs each."""
    probe_key_rotation: str = ""
    sla: SlaArgs | None = None
    monitoring: MonitoringArgs | None = None
    exporter: ExporterArgs | None = None
    memory: sizing.MemoryPlan | None = None


def sla_thresholds(cfg: StackConfig) -> SlaThresholds:
    s = cfg.sla
    return SlaThresholds(ttft_p50_ms=s.ttft_p50_ms, ttft_p95_ms=s.ttft_p95_ms, ttft_p99_ms=s.ttft_p99_ms,
                         min_decode_tokens_per_s=s.min_decode_tokens_per_s,
                         min_decode_ceiling_fraction=s.min_decode_ceiling_fraction, max_errors=s.max_errors)


def weight_bytes_per_token(cfg: StackConfig) -> float | None:
    """Bytes of weights one decoded token reads (model config and quantization); None when unknown."""
    if cfg.model_spec is None or cfg.model.quantization not in models.QUANTIZATIONS:
        return None
    return sizing.decode_weight_bytes(cfg.model_spec, models.QUANTIZATIONS[cfg.model.quantization], cfg.engine.dtype)


def decode_ceiling_input(per_token: float | None, bandwidth_bytes_per_s: float | None) -> dict | None:
    """The SLA report's decode ceiling: the node's measured bandwidth over the bytes read per token."""
    if not bandwidth_bytes_per_s or per_token is None:
        return None
    return {"bandwidth_bytes_per_s": bandwidth_bytes_per_s, "active_weight_bytes_per_token": per_token}


def monitoring_args(cfg: StackConfig, name: str, unit: str) -> tuple[MonitoringArgs, ExporterArgs] | None:
    """Prometheus and node_exporter on node `name` (engine unit `unit`), or None when monitoring is off."""
    if not cfg.monitoring.enabled:
        return None
    return monitoring.args_for(cfg, name), ExporterArgs(
        name, monitors=((name, unit),), certificates=((name, tls_paths(cfg.ingress, name)[0]),), interval_s=cfg.monitor.interval_s,
        start_stamps=((unit, runtime.started_stamp(name)),))


def args_for(cfg: StackConfig, name: str, host: str) -> NodeArgs:
    """NodeArgs of node `name` on the host named `host`."""
    s = cfg.sla
    sla = SlaArgs(thresholds=sla_thresholds(cfg), samples=s.samples, warmup=s.warmup, concurrency=s.concurrency,
                  max_tokens=s.max_tokens, weight_bytes_per_token=weight_bytes_per_token(cfg)) if s.enabled else None
    run = runtime.args_for(cfg, name)
    watched = monitoring_args(cfg, name, run.unit)
    if watched:
        watched = (dataclasses.replace(watched[0], stack=pulumi.get_stack()), watched[1])
    return NodeArgs(host=host, runtime=run, ingress=ingress.args_for(cfg, name),
                    monitor=monitor.args_for(cfg, name), editors=editors.args_for(cfg), model=served_name(cfg),
                    api_keys=dict(cfg.secrets.api_keys), probe_key_rotation=cfg.monitor.probe_key_rotation, sla=sla,
                    monitoring=watched[0] if watched else None, exporter=watched[1] if watched else None,
                    memory=cfg.memory)


def behind_gateway(args: NodeArgs) -> NodeArgs:
    """The node as a gateway member: its certificate also names the fleet's TLS name."""
    return dataclasses.replace(args, ingress=dataclasses.replace(args.ingress, fleet_member=True))


def editor_outputs(ed: editors.EditorArgs, endpoint: pulumi.Output, ca_pem: pulumi.Output,
                   api_keys: dict[str, str]) -> dict:
    """One set of editor outputs per user key, each holding only that user's key (all secret)."""
    return {
        key_name: {
            "continueYaml": pulumi.Output.secret(pulumi.Output.all(endpoint, user_key, ca_pem).apply(
                lambda a: editors.continue_yaml(ed, a[0], a[1], a[2]))),
            "cursorNotes": pulumi.Output.secret(endpoint.apply(lambda e: editors.cursor_notes(ed, e))),
        }
        for key_name, user_key in sorted(api_keys.items())
    }


class NodeService(pulumi.ComponentResource):
    """A TLS-protected, monitored and SLA-checked vLLM node on a prepared host (`base`)."""

    def __init__(self, name: str, args: NodeArgs, base: HostBase, gate: list | None = None,
                 extra_keys: dict[str, pulumi.Input[str]] | None = None, opts: pulumi.ResourceOptions | None = None):
        """`gate`: what the engine (re)start waits for besides the host (the fleet's drain of this
        node); `extra_keys`: keys the ingress accepts besides the users' (the fleet's probe)."""
        # Before HostBase, this component was the InferenceNode that also held the host.
        opts = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(aliases=[pulumi.Alias(type_=LEGACY_NODE_TYPE)]))
        super().__init__("fimfleet:node:NodeService", name, None, opts)
        def child(*deps):
            return pulumi.ResourceOptions(parent=self, depends_on=list(deps))

        conn = base.connection
        # What does not depend on each other overlaps: nginx and Prometheus with the engine start.
        # The engine waits for the tuned kernel; the node's nginx site only for the host's nginx;
        # Prometheus and node_exporter only for what precedes the engine's start. The monitor
        # needs both the unit and the ingress; the SLA gate, everything.
        self.runtime = VllmRuntime(f"{name}-runtime", args.runtime, connection=conn,
                                   opts=child(base.host, base.kernel, *(gate or [])))
        # The probe and the SLA gate use the node's own key, never a user's (components/keys.py).
        self.probe_key = keys.ProbeKey(f"{name}-probe-key", rotate=args.probe_key_rotation, opts=child())
        probe_key = pulumi.Output.secret(self.probe_key.key)
        self.ingress = NginxIngress(f"{name}-ingress", args.ingress, host=base.facts, connection=conn,
                                    nginx=base.nginx_settings, extra_keys={keys.PROBE_KEY_NAME: probe_key, **(extra_keys or {})},
                                    opts=child(base.nginx))
        self.monitor = Monitor(f"{name}-monitor", args.monitor, unit=self.runtime.unit, connection=conn,
                               probe_key=probe_key, ca_pem=self.ingress.ca_pem, service_user=self.runtime.service_user,
                               container=self.runtime.container, opts=child(self.runtime, self.ingress))
        self.endpoint = self.ingress.endpoint
        # Set up while the engine starts (not while the host's bandwidth is measured): an engine
        # in its first start is `starting` for the alerts (monitor-textfile.sh). The SLA gate waits
        # for it, so its installs never load the host while the SLA is measured.
        self.monitoring = None
        if args.monitoring:
            self.monitoring = monitoring.Monitoring(
                f"{name}-monitoring", args.monitoring, conn, exporter=args.exporter,
                ca_pems={name: self.ingress.ca_pem} if args.ingress.settings.tls != "acme" else None,
                opts=child(base.host, *self.runtime.before_start))
        # The host identity is part of it: a rebuilt or replaced host is measured again, so the
        # report in the outputs always belongs to the host that serves now.
        deployed = templates.digest(base.kernel.digest, base.nginx_digest, self.runtime.digest, self.ingress.digest)
        self.trigger = trigger = base.identity.apply(lambda ident: templates.digest(deployed, ident))
        self.sla = None
        if args.sla:
            s = args.sla
            self.sla = FimSlaCheck(
                f"{name}-sla", endpoint=self.ingress.probe_endpoint, api_key=probe_key, ca_pem=self.ingress.ca_pem,
                model=args.model, thresholds=s.thresholds, samples=s.samples, warmup=s.warmup,
                concurrency=s.concurrency, max_tokens=s.max_tokens, trigger=trigger,
                ceiling=self.runtime.bandwidth_bytes_per_s.apply(
                    lambda bw: decode_ceiling_input(s.weight_bytes_per_token, bw)),
                opts=child(self.monitor, *(self.monitoring.setup_steps if self.monitoring else ())))
            if self.monitoring:
                self.monitoring.export_sla_report(name, self.sla.report)
        self.model = args.model
        self.kv_cache = self.runtime.kv_cache_tokens.apply(lambda v: sizing.kv_capacity_report(args.memory, v))
        self.editor_configs = editor_outputs(args.editors, self.endpoint, self.ingress.ca_pem, args.api_keys)
        self.curl = self.endpoint.apply(lambda e: editors.curl_smoke_test(args.editors, e))
        self.register_outputs({"endpoint": self.endpoint, "model": args.model})
