"""Typed inputs of components/monitoring.py: what one Prometheus host scrapes and alerts on.

`args_for` derives a single-node stack's from its validated config; config.py runs
monitoring.problems on the result, so a bad value fails before any resource exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.ingress_render import LOOPBACK_CIDRS, metrics_cidrs

CONFIG_DIR = "/etc/prometheus/fimfleet"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
"""Debian's node_exporter reads *.prom files here by default."""
MONITOR_RUN_DIR = "/run/fimfleet"
"""files/monitor/recover.sh keeps its state in monitor-<unit without .service>/ below this."""
HELPER_STATE = "/var/lib/fimfleet/monitor-textfile"


@dataclass(frozen=True)
class ScrapeNode:
    """One node's vLLM, scraped through its ingress."""

    name: str
    """The `node` label on every series of this node."""
    metrics_url: str
    """The ingress's /metrics over https, e.g. https://10.0.0.5:443/metrics."""
    ca_pem: str = ""
    """CA the ingress certificate chains to ("" = the system CAs, e.g. an ACME certificate)."""
    server_name: str = ""
    """Name to verify in the certificate when the URL's host is not in it."""
    allow_cidrs: tuple[str, ...] = LOOPBACK_CIDRS
    """The ingress's metricsAllowCidrs: the scraper's address must be inside one of them."""


@dataclass(frozen=True)
class ExporterTarget:
    """A node_exporter Prometheus scrapes: `host` label, host:port, and role (node or gateway: which down-alert)."""

    host: str
    address: str = "127.0.0.1:9100"
    role: str = "node"


@dataclass(frozen=True)
class ExporterArgs:
    """node_exporter and the deep-probe textfile export on one host."""

    host: str
    """The host's name (the `host` label)."""
    listen: str = "127.0.0.1:9100"
    """Where node_exporter listens. Anything but loopback must be firewalled to the Prometheus host."""
    monitors: tuple[tuple[str, str], ...] = ()
    """(node, engine unit) pairs whose deep-probe state is exported (files/monitor/recover.sh)."""
    certificates: tuple[tuple[str, str], ...] = ()
    """(node, certificate file) pairs whose notAfter is exported, for the expiry alert."""
    start_stamps: tuple[tuple[str, str], ...] = ()
    """(engine unit, start.sh's stamp file) pairs: an engine the monitor has not judged yet and
    without the stamp is in its first start, `starting`, not down (components/runtime.py)."""
    watched_units: tuple[str, ...] = ("nginx.service",)
    """systemd units whose restarts node_exporter counts, besides the engine units."""
    interval_s: int = 15
    """How often the textfile export runs (at most the monitor's interval, so no restart is missed)."""
    textfile_dir: str = TEXTFILE_DIR
    run_dir: str = MONITOR_RUN_DIR
    state_dir: str = HELPER_STATE


@dataclass(frozen=True)
class MonitoringArgs:
    """Everything the Prometheus host needs; thresholds come from the stack's SLA and tier."""

    nodes: tuple[ScrapeNode, ...]
    exporters: tuple[ExporterTarget, ...]
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    """The SLA's TTFT limits; p99 is also the alert threshold."""
    min_decode_tokens_per_s: float
    """The SLA's per-request decode floor (0 = no decode alert)."""
    decode_ceiling_tokens_per_s: float
    """components/sizing.py's memory-bandwidth ceiling, drawn on the dashboard."""
    max_steal_percent: float
    """The tier's maxStealPercent: the steal alert's threshold."""
    scraper_address: str = "127.0.0.1"
    """The address the nodes' ingresses see Prometheus connect from."""
    listen: str = "127.0.0.1:9090"
    """Prometheus's address; loopback only."""
    scrape_interval_s: int = 15
    evaluation_interval_s: int = 15
    rate_window: str = "5m"
    """Window of every rate() in the recording rules."""
    retention: str = "15d"
    ttft_for: str = "10m"
    """How long TTFT p99 (and decode speed) must miss the SLA before the alert fires."""
    steal_for: str = "10m"
    kv_cache_alert_ratio: float = 0.9
    kv_cache_for: str = "5m"
    cert_alert_days: int = 14
    """Alert when a certificate has fewer days left: `pulumi up` reissues a self-signed one, and
    certbot renews an ACME one, at 30 days, so one under 14 has missed both."""
    down_for: str = "2m"
    probe_interval_s: int = 15
    """The monitor's interval: a probe older than 4 intervals + 60 s counts as stale."""
    probe_failing_for: str = "2m"
    restart_loop_count: int = 3
    restart_loop_window: str = "30m"
    alertmanager_webhook_url: str = ""
    """Off when empty; else Debian's Alertmanager sends every alert to this webhook."""
    alertmanager_listen: str = "127.0.0.1:9093"
    repeat_interval: str = "4h"
    config_dir: str = CONFIG_DIR
    textfile_dir: str = TEXTFILE_DIR
    stack: str = "fimfleet"  # the dashboard's title


def args_for(cfg, node: str) -> MonitoringArgs:
    """A single-node stack's Prometheus, on the node itself: it scrapes vLLM through the node's own
    ingress on loopback (a self-signed certificate names 127.0.0.1; others are checked for the domain)."""
    from components import models, sizing

    i, s, mon, h = cfg.ingress, cfg.sla, cfg.monitoring, cfg.host
    ceiling = (sizing.decode_ceiling_tokens_per_s(cfg.model_spec, models.QUANTIZATIONS[cfg.model.quantization],
                                                  h.memory_bandwidth_gbs * 1e9, cfg.engine.dtype)
               if h.memory_bandwidth_gbs else 1.0)
    url = f"https://127.0.0.1{'' if i.https_port == 443 else f':{i.https_port}'}/metrics"
    return MonitoringArgs(
        nodes=(ScrapeNode(node, url, server_name="" if i.tls == "self-signed" else i.domain,
                          allow_cidrs=metrics_cidrs(i.metrics_allow_cidrs, mon.enabled)),),
        exporters=(ExporterTarget(node),), ttft_p50_ms=s.ttft_p50_ms, ttft_p95_ms=s.ttft_p95_ms,
        ttft_p99_ms=s.ttft_p99_ms, min_decode_tokens_per_s=s.min_decode_tokens_per_s, decode_ceiling_tokens_per_s=ceiling,
        max_steal_percent=h.max_steal_percent, scrape_interval_s=mon.scrape_interval_s,
        evaluation_interval_s=mon.scrape_interval_s, retention=mon.retention, probe_interval_s=cfg.monitor.interval_s,
        alertmanager_webhook_url=mon.alertmanager_webhook_url)
