"""InferenceNode: one host from bare to serving, in dependency order.

host preflight -> (packages || kernel tuning) -> (vLLM runtime || nginx ingress) -> monitor
-> FIM SLA check -> Prometheus and node_exporter. The SLA check's trigger hashes everything deployed before it, so any
change upstream measures again and an unchanged stack does not.
"""

from __future__ import annotations

import dataclasses

import pulumi

from components import editors, host, ingress, kernel, keys, models, monitor, monitoring, runtime, sizing, templates
from components.config import StackConfig
from components.engine import served_name
from components.host import Host
from components.ingress import NginxIngress, tls_paths
from components.kernel import KernelTuning
from components.monitor import Monitor
from components.runtime import VllmRuntime
from components.sla.provider import FimSlaCheck
from components.sla.thresholds import SlaThresholds


def sla_thresholds(cfg: StackConfig) -> SlaThresholds:
    s = cfg.sla
    return SlaThresholds(ttft_p50_ms=s.ttft_p50_ms, ttft_p95_ms=s.ttft_p95_ms, ttft_p99_ms=s.ttft_p99_ms,
                         min_decode_tokens_per_s=s.min_decode_tokens_per_s,
                         min_decode_ceiling_fraction=s.min_decode_ceiling_fraction, max_errors=s.max_errors)


def decode_ceiling_input(cfg: StackConfig, bandwidth_bytes_per_s: float | None) -> dict | None:
    """The SLA report's decode ceiling: the node's measured bandwidth over the bytes read per token."""
    if not bandwidth_bytes_per_s or cfg.model_spec is None or cfg.model.quantization not in models.QUANTIZATIONS:
        return None
    per_token = sizing.decode_weight_bytes(cfg.model_spec, models.QUANTIZATIONS[cfg.model.quantization], cfg.engine.dtype)
    return {"bandwidth_bytes_per_s": bandwidth_bytes_per_s, "active_weight_bytes_per_token": per_token}


class InferenceNode(pulumi.ComponentResource):
    """A tuned, TLS-protected, monitored and SLA-checked vLLM node."""

    def __init__(self, name: str, cfg: StackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:node:InferenceNode", name, None, opts)
        def child(*deps):
            return pulumi.ResourceOptions(parent=self, depends_on=list(deps))

        self.host = Host(f"{name}-host", host.args_for(cfg), opts=child())
        conn = self.host.connection
        # What does not depend on each other overlaps: kernel tuning with the packages, nginx with
        # the engine start. The monitor needs both the unit and the ingress; the SLA gate, everything.
        self.kernel = KernelTuning(f"{name}-kernel", kernel.args_for(cfg), conn, opts=child(self.host.preflight))
        self.runtime = VllmRuntime(f"{name}-runtime", runtime.args_for(cfg, name), connection=conn, opts=child(self.host, self.kernel))
        # The probe and the SLA gate use the node's own key, never a user's (components/keys.py).
        self.probe_key = keys.ProbeKey(f"{name}-probe-key", rotate=cfg.monitor.probe_key_rotation, opts=child())
        probe_key = pulumi.Output.secret(self.probe_key.key)
        self.ingress = NginxIngress(f"{name}-ingress", ingress.args_for(cfg), host=self.host.facts, connection=conn,
                                    extra_keys={keys.PROBE_KEY_NAME: probe_key}, opts=child(self.host))
        model = served_name(cfg)
        self.monitor = Monitor(f"{name}-monitor", monitor.args_for(cfg, name), unit=self.runtime.unit, connection=conn,
                               probe_key=probe_key, ca_pem=self.ingress.ca_pem, service_user=self.runtime.service_user,
                               container=self.runtime.container, opts=child(self.runtime, self.ingress))
        self.endpoint = self.ingress.endpoint
        # The host identity is part of it: a rebuilt or replaced host is measured again, so the
        # report in the outputs always belongs to the host that serves now.
        deployed = templates.digest(self.kernel.digest, self.runtime.digest, self.ingress.digest)
        trigger = self.host.identity.identity.apply(lambda ident: templates.digest(deployed, ident))
        self.sla = None
        if cfg.sla.enabled:
            s = cfg.sla
            self.sla = FimSlaCheck(
                f"{name}-sla", endpoint=self.ingress.probe_endpoint, api_key=probe_key, ca_pem=self.ingress.ca_pem,
                model=model, thresholds=sla_thresholds(cfg), samples=s.samples, warmup=s.warmup,
                concurrency=s.concurrency, max_tokens=s.max_tokens, trigger=trigger,
                ceiling=self.runtime.bandwidth_bytes_per_s.apply(lambda bw: decode_ceiling_input(cfg, bw)),
                opts=child(self.monitor))
        # Prometheus on the node, after the gate so it never loads the host while the SLA is measured.
        self.monitoring = None
        if cfg.monitoring.enabled:
            self.monitoring = monitoring.Monitoring(
                f"{name}-monitoring", dataclasses.replace(monitoring.args_for(cfg, name), stack=pulumi.get_stack()),
                conn, exporter=monitoring.ExporterArgs(name, monitors=((name, self.runtime.unit),),
                                                       certificates=((name, tls_paths(cfg.ingress)[0]),),
                                                       interval_s=cfg.monitor.interval_s),
                sla_reports={name: self.sla.report} if self.sla else None,
                ca_pems={name: self.ingress.ca_pem} if cfg.ingress.tls != "acme" else None,
                opts=child(self.sla or self.monitor))
        self.model = model
        self.kv_cache = self.runtime.kv_cache_tokens.apply(lambda v: sizing.kv_capacity_report(cfg.memory, v))
        ed = editors.args_for(cfg)
        # One set of editor outputs per user key, each holding only that user's key.
        self.editor_configs = {
            key_name: {
                "continueYaml": pulumi.Output.secret(pulumi.Output.all(self.endpoint, user_key, self.ingress.ca_pem).apply(
                    lambda a: editors.continue_yaml(ed, a[0], a[1], a[2]))),
                "cursorNotes": pulumi.Output.secret(self.endpoint.apply(lambda e: editors.cursor_notes(ed, e))),
            }
            for key_name, user_key in sorted(cfg.secrets.api_keys.items())
        }
        self.curl = self.endpoint.apply(lambda e: editors.curl_smoke_test(ed, e))
        self.register_outputs({"endpoint": self.endpoint, "model": model})
