"""InferenceNode: one host from bare to serving, in dependency order.

host (preflight, packages) -> kernel tuning -> vLLM runtime -> nginx ingress -> monitor
-> FIM SLA check. The SLA check's trigger hashes everything deployed before it, so any
change upstream measures again and an unchanged stack does not.
"""

from __future__ import annotations

import pulumi

from components import editors, templates
from components.config import StackConfig
from components.engine import served_name
from components.host import Host
from components.ingress import NginxIngress
from components.kernel import KernelTuning
from components.monitor import Monitor
from components.runtime import VllmRuntime
from components.sla.provider import FimSlaCheck
from components.sla.thresholds import SlaThresholds


def sla_thresholds(cfg: StackConfig) -> SlaThresholds:
    s = cfg.sla
    return SlaThresholds(ttft_p50_ms=s.ttft_p50_ms, ttft_p95_ms=s.ttft_p95_ms, ttft_p99_ms=s.ttft_p99_ms,
                         min_decode_tokens_per_s=s.min_decode_tokens_per_s, max_errors=s.max_errors)


class InferenceNode(pulumi.ComponentResource):
    """A tuned, TLS-protected, monitored and SLA-checked vLLM node."""

    def __init__(self, name: str, cfg: StackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:node:InferenceNode", name, None, opts)
        def child(*deps):
            return pulumi.ResourceOptions(parent=self, depends_on=list(deps))

        self.host = Host(f"{name}-host", cfg, opts=child())
        conn = self.host.connection
        self.kernel = KernelTuning(f"{name}-kernel", cfg, conn, opts=child(self.host))
        self.runtime = VllmRuntime(f"{name}-runtime", cfg, node=name, connection=conn, opts=child(self.kernel))
        self.ingress = NginxIngress(f"{name}-ingress", cfg, node=name, connection=conn, opts=child(self.runtime))
        model = served_name(cfg)
        probe_key_name = sorted(cfg.secrets.api_keys)[0]
        probe_key = pulumi.Output.secret(cfg.secrets.api_keys[probe_key_name])
        self.monitor = Monitor(f"{name}-monitor", cfg, node=name, unit=self.runtime.unit, connection=conn,
                               probe_key=probe_key, ca_pem=self.ingress.ca_pem, opts=child(self.ingress))
        self.endpoint = self.ingress.endpoint
        trigger = templates.digest(self.kernel.digest, self.runtime.digest, self.ingress.digest)
        self.sla = None
        if cfg.sla.enabled:
            s = cfg.sla
            self.sla = FimSlaCheck(
                f"{name}-sla", endpoint=self.ingress.probe_endpoint, api_key=probe_key, ca_pem=self.ingress.ca_pem,
                model=model, thresholds=sla_thresholds(cfg), samples=s.samples, warmup=s.warmup,
                concurrency=s.concurrency, max_tokens=s.max_tokens, trigger=trigger, opts=child(self.monitor))
        self.model = model
        self.continue_yaml = pulumi.Output.secret(pulumi.Output.all(self.endpoint, probe_key).apply(
            lambda a: editors.continue_yaml(a[0], model, a[1])))
        self.continue_json = pulumi.Output.secret(pulumi.Output.all(self.endpoint, probe_key).apply(
            lambda a: editors.continue_json(a[0], model, a[1])))
        self.cursor_settings = pulumi.Output.secret(pulumi.Output.all(self.endpoint, probe_key).apply(
            lambda a: editors.cursor_settings(a[0], model, a[1])))
        self.curl = self.endpoint.apply(lambda e: editors.curl_smoke_test(e, model))
        self.register_outputs({"endpoint": self.endpoint, "model": model})
