"""Monitoring: Prometheus scraping every node's vLLM and node_exporter, with rules from the SLA.

Debian's `prometheus` and `prometheus-node-exporter` are installed with apt, as a user would,
with their /etc/default ARGS written BEFORE the install: postinst starts the daemons at once,
and Debian's own ARGS listen on every address. Prometheus listens on loopback only; the UI is
reached through the SSH tunnel printed as an output. vLLM's /metrics is scraped through each
node's ingress over verified TLS. Recording and alert rules are rendered from the stack's own
numbers (files/prometheus/), so a tighter SLA gives tighter alerts. The deep probe's state
(files/prometheus/monitor-textfile.sh) and the last SLA gate report reach Prometheus through
node_exporter's textfile collector. Alertmanager (a webhook) is optional and off by default.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from collections.abc import Mapping
from datetime import datetime
from urllib.parse import urlsplit

import pulumi

from components import grammar, templates
from components.config import ConfigError, Problem, camel
from components.monitoring_args import (CONFIG_DIR, HELPER_STATE, MONITOR_RUN_DIR, TEXTFILE_DIR, ExporterArgs,  # noqa: F401
                                        ExporterTarget, MonitoringArgs, ScrapeNode, args_for)
from components.remote import RemoteStep

STAGED_DIR = "/etc/fimfleet/monitoring"
"""/etc/default files as fimfleet wants them; packages.sh installs them before apt runs."""
ALERTMANAGER_STAGED = f"{STAGED_DIR}/alertmanager.yml"
"""Alertmanager's config as uploaded (0600 root): its webhook URL often carries a token, so the
copy in force is 0640 root:prometheus, which an upload as root cannot make on a fresh host."""
HELPER = "/usr/local/lib/fimfleet/monitor-textfile.sh"
HELPER_ENV = "/etc/fimfleet/monitor-textfile.env"
HELPER_UNIT = "fimfleet-monitor-textfile"
PACKAGE_RECORD = "/var/lib/fimfleet/monitoring-{role}-packages"
"""The packages a role's step installed (files/host/apt-ledger.sh.j2): destroy purges these only."""
RESTART_STAMP = "/var/lib/fimfleet/monitoring-restart-{service}"
"""Written before a new /etc/default file goes in, removed once the daemon restarted with it."""
QUANTILES = (("50", 0.5), ("95", 0.95), ("99", 0.99))
RULE_GROUPS = ("fimfleet-vllm", "fimfleet-host", "fimfleet-probe", "fimfleet-limits", "fimfleet-alerts")
VMSTAT_FIELDS = "^(oom_kill|pgpg|pswp|pg.*fault|thp_.*).*"
"""Debian's default vmstat fields plus the THP counters (thp_fault_alloc, thp_collapse_alloc, ...)."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
UNIT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,200}\.service\Z")
DURATION_RE = re.compile(r"^[1-9][0-9]{0,5}[smhdw]\Z")
PATH_RE = re.compile(r"^/[A-Za-z0-9_./-]*\Z")
LOOPBACK = ("127.0.0.1", "[::1]", "localhost")
NAME_FIX = "must be a name of letters, digits, '.', '_' or '-'"


HOSTPORT_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?\Z")


def _split_hostport(value: str) -> tuple[str, int] | None:
    m = HOSTPORT_RE.match(str(value or ""))
    m = m if m and m.group(2) else None
    return (m.group(1), int(m.group(2))) if m and 0 < int(m.group(2)) < 65536 else None


def _source_address(node: ScrapeNode, scraper: str) -> str:
    """The address the node's nginx sees: loopback when the URL is a loopback literal."""
    host = urlsplit(node.metrics_url).hostname or ""
    return host if host in ("127.0.0.1", "::1") else scraper


def problems(args: MonitoringArgs) -> list[Problem]:
    """Every bad value at once, each with its key and a fix."""
    out: list[Problem] = []
    seen = set()
    for i, n in enumerate(args.nodes):
        key = f"monitoring.nodes[{i}]"
        if not NAME_RE.match(str(n.name)) or n.name in seen:
            out.append(Problem(f"{key}.name", n.name, f"{NAME_FIX}, unique"))
        seen.add(n.name)
        u = urlsplit(str(n.metrics_url))
        if u.scheme != "https" or not HOSTPORT_RE.match(u.netloc) or not PATH_RE.match(u.path or "/") or u.query:
            out.append(Problem(f"{key}.metricsUrl", n.metrics_url, "must be the ingress's https URL, like https://10.0.0.5/metrics"))
            continue
        if n.server_name and not re.match(r"^[A-Za-z0-9.-]+\Z", n.server_name):
            out.append(Problem(f"{key}.serverName", n.server_name, "must be a DNS name"))
        try:
            nets = [ipaddress.ip_network(c, strict=False) for c in n.allow_cidrs]
            src = ipaddress.ip_address(_source_address(n, args.scraper_address))
        except ValueError as e:
            out.append(Problem(f"{key}.allowCidrs", list(n.allow_cidrs), f"CIDRs and the scraper address must be IPs ({e})"))
            continue
        if not any(src in net for net in nets):
            out.append(Problem("ingress.metricsAllowCidrs", list(n.allow_cidrs),
                               f"node {n.name}'s ingress would refuse Prometheus at {src}: add {src}/32"))
    for i, e in enumerate(args.exporters):
        out += _fields(e, f"monitoring.exporters[{i}]", (
            (("host",), NAME_RE.match, NAME_FIX), (("address",), _split_hostport, "must be host:port, like 10.0.0.5:9100"),
            (("role",), lambda v: v in ("node", "gateway"), "must be node or gateway")))
    return out + _fields(args, "monitoring", (
        (("listen", "alertmanager_listen"), lambda v: (_split_hostport(v) or ("",))[0] in LOOPBACK,
         "must be a loopback address like 127.0.0.1:9090: never open to the internet (use the SSH tunnel)"),
        (("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "decode_ceiling_tokens_per_s"), _number(1e-9, 1e9),
         "must be a number above 0"),
        (("min_decode_tokens_per_s",), _number(0, 1e6), "must be a number from 0 to 1000000"),
        (("max_steal_percent",), _number(0, 100), "must be a number from 0 to 100"),
        (("kv_cache_alert_ratio",), _number(0, 1), "must be a number from 0 to 1"),
        (("rate_window", "retention", "ttft_for", "steal_for", "kv_cache_for", "down_for", "probe_failing_for",
          "restart_loop_window", "repeat_interval"), DURATION_RE.match, "must be a duration like 30s, 5m or 2h"),
        # evaluation_interval_s is scrape_interval_s (args_for): its problems are that key's
        (("scrape_interval_s", "probe_interval_s", "restart_loop_count", "cert_alert_days"),
         _number(1, 3600, whole=True),
         "must be a whole number from 1 to 3600"),
        (("alertmanager_webhook_url",), lambda v: not v or grammar.webhook_url(v) is None,
         grammar.webhook_url("") + ", or empty to leave Alertmanager off"),
        (("config_dir", "textfile_dir"), PATH_RE.match, "must be an absolute path"))) + _window_problems(args)


DURATION_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
RETENTION_MAX_S = (2**63 - 1) // 10**9
"""Prometheus reads a duration into int64 nanoseconds: about 292 years."""


def _seconds(duration) -> int | None:
    return int(duration[:-1]) * DURATION_S[duration[-1]] if isinstance(duration, str) and DURATION_RE.match(duration) else None


def _window_problems(args: MonitoringArgs) -> list[Problem]:
    """Scrapes often enough for the rules' rate() (two samples in its window), and a retention
    Prometheus can read."""
    out = []
    window, scrape = _seconds(args.rate_window), args.scrape_interval_s
    if window and isinstance(scrape, int) and not isinstance(scrape, bool) and 1 <= scrape and 2 * scrape > window:
        out.append(Problem("monitoring.scrapeIntervalS", scrape, f"must be at most {window // 2} s: the recording rules' "
                           f"rate() over {args.rate_window} needs two samples in it, or every TTFT, decode and steal "
                           "rule stays empty and its alert never fires"))
    if (kept := _seconds(args.retention)) and kept > RETENTION_MAX_S:
        out.append(Problem("monitoring.retention", args.retention, f"is longer than Prometheus can read "
                           f"(at most {RETENTION_MAX_S // 86400}d); e.g. 15d or 90d"))
    return out


def exporter_problems(e: ExporterArgs) -> list[Problem]:
    out = _fields(e, "monitoring.exporter", (
        (("host",), NAME_RE.match, NAME_FIX), (("listen",), _split_hostport, "must be host:port, like 127.0.0.1:9100"),
        (("textfile_dir", "run_dir", "state_dir"), PATH_RE.match, "must be an absolute path"),
        (("interval_s",), _number(1, 3600, whole=True), "must be a whole number from 1 to 3600")))
    out += [Problem("monitoring.exporter.monitors", [node, unit], "must be a node name and its engine's .service unit")
            for node, unit in e.monitors if not (NAME_RE.match(str(node)) and UNIT_RE.match(str(unit)))]
    out += [Problem("monitoring.exporter.certificates", [node, path], "must be a node name and an absolute path")
            for node, path in e.certificates if not (NAME_RE.match(str(node)) and PATH_RE.match(str(path)))]
    out += [Problem("monitoring.exporter.startStamps", [unit, path], "must be a .service unit and an absolute path")
            for unit, path in e.start_stamps if not (UNIT_RE.match(str(unit)) and PATH_RE.match(str(path)))]
    return out + [Problem("monitoring.exporter.watchedUnits", u, "must be a systemd .service unit")
                  for u in e.watched_units if not UNIT_RE.match(str(u))]


def _number(lo, hi, whole=False):
    kinds = int if whole else (int, float)
    return lambda v: isinstance(v, kinds) and not isinstance(v, bool) and lo <= v <= hi


def _fields(obj, prefix: str, rules) -> list[Problem]:
    """A Problem for each field whose value fails its rule; rules: ((field names), ok(value), fix)."""
    out = []
    for names, ok, fix in rules:
        for name in names:
            value = getattr(obj, name)
            try:
                good = bool(ok(value))
            except TypeError:  # e.g. a number where a string belongs
                good = False
            if not good:
                out.append(Problem(f"{prefix}.{camel(name)}", value, fix))
    return out


def check(args: MonitoringArgs, exporter: ExporterArgs | None = None, sla_nodes=()) -> None:
    """Raise one ConfigError listing every problem (SLA reports and CAs must belong to scraped nodes)."""
    found = problems(args) + (exporter_problems(exporter) if exporter else [])
    names = {n.name for n in args.nodes}
    found += [Problem("monitoring.nodes", n, f"is not a scraped node ({sorted(names)})") for n in sla_nodes if n not in names]
    if found:
        raise ConfigError(found)


# ----------------------------------------------------------------------------- rendering


def prometheus_args(args: MonitoringArgs) -> list[str]:
    return [f"--config.file={args.config_dir}/prometheus.yml", f"--web.listen-address={args.listen}",
            f"--storage.tsdb.retention.time={args.retention}"]


def alertmanager_args(args: MonitoringArgs) -> list[str]:
    # an empty cluster address turns off HA gossip, which would listen on 0.0.0.0:9094
    return [f"--config.file={args.config_dir}/alertmanager.yml", f"--web.listen-address={args.alertmanager_listen}",
            "--cluster.listen-address="]


def node_exporter_args(e: ExporterArgs) -> list[str]:
    units = [u for _, u in e.monitors] + list(e.watched_units)
    # node_exporter anchors the regex; [.] keeps backslashes out of the systemd EnvironmentFile
    include = "(" + "|".join(u.replace(".", "[.]") for u in dict.fromkeys(units)) + ")"
    return [f"--web.listen-address={e.listen}", f"--collector.textfile.directory={e.textfile_dir}",
            f"--collector.vmstat.fields={VMSTAT_FIELDS}", "--collector.systemd",
            f"--collector.systemd.unit-include={include}", "--collector.systemd.enable-restarts-metrics"]


TTFT_BUCKET_RATIO = 1.15
TTFT_BUCKET_RANGE_S = (0.005, 60.0)


def ttft_histogram_buckets(limits_ms=()) -> list[float]:
    """TTFT bucket bounds (seconds) for vLLM: every 15% from 5 ms to 60 s, plus the SLA limits.

    vLLM's default buckets jump 0.1 -> 0.25 -> 0.5 -> 0.75 -> 1 -> 2.5 s, so a p99 interpolated
    inside them can be off by half; with these, the recorded p99 is within a few percent and
    "above the SLA" is decided on an exact bucket bound.
    """
    lo, hi = TTFT_BUCKET_RANGE_S
    bounds, b = set(), lo
    while b < hi * TTFT_BUCKET_RATIO:
        bounds.add(float(f"{b:.4g}"))
        b *= TTFT_BUCKET_RATIO
    bounds.update(float(f"{ms / 1000:.6g}") for ms in limits_ms if ms and ms > 0)
    return sorted(bounds)


def vllm_histogram_args(limits_ms=()) -> list[str]:
    """The engine arguments that give vLLM those TTFT buckets (vLLM 0.32's --custom-histogram-buckets)."""
    return ["--custom-histogram-buckets", json.dumps({"time_to_first_token": ttft_histogram_buckets(limits_ms)},
                                                     separators=(",", ":"))]


def _scrape_node(n: ScrapeNode) -> dict:
    u = urlsplit(n.metrics_url)
    return {"name": n.name, "target": u.netloc, "path": u.path or "/metrics", "ca_pem": n.ca_pem,
            "server_name": n.server_name}


def rule_values(args: MonitoringArgs) -> dict:
    ms = {"50": args.ttft_p50_ms, "95": args.ttft_p95_ms, "99": args.ttft_p99_ms}
    return dict(
        window=args.rate_window, quantiles=[{"name": n, "value": v, "limit_s": ms[n] / 1000} for n, v in QUANTILES],
        ttft_p99_ms=args.ttft_p99_ms, ttft_p99_s=args.ttft_p99_ms / 1000, ttft_for=args.ttft_for,
        min_decode_tokens_per_s=args.min_decode_tokens_per_s, decode_ceiling_tokens_per_s=args.decode_ceiling_tokens_per_s,
        max_steal_percent=args.max_steal_percent, steal_for=args.steal_for,
        kv_cache_alert_ratio=args.kv_cache_alert_ratio, kv_cache_for=args.kv_cache_for, down_for=args.down_for,
        probe_failing_for=args.probe_failing_for, probe_stale_s=4 * args.probe_interval_s + 60,
        restart_loop_count=args.restart_loop_count, restart_loop_window=args.restart_loop_window,
        cert_alert_days=args.cert_alert_days)


def prometheus_files(args: MonitoringArgs) -> dict[str, str]:
    """Config, rules, CAs and the dashboard, by path relative to config_dir."""
    alertmanager = bool(args.alertmanager_webhook_url)
    files = {
        "prometheus.yml": templates.render(
            "prometheus/prometheus.yml.j2", config_dir=args.config_dir, listen=args.listen,
            scrape_interval_s=args.scrape_interval_s, scrape_timeout_s=min(10, args.scrape_interval_s),
            evaluation_interval_s=args.evaluation_interval_s, alertmanager=alertmanager,
            alertmanager_listen=args.alertmanager_listen, nodes=[_scrape_node(n) for n in args.nodes],
            exporters=[{"name": e.host, "address": e.address, "role": e.role} for e in args.exporters]),
        "rules/fimfleet-recording.yml": templates.render("prometheus/recording.rules.yml.j2", **rule_values(args)),
        "rules/fimfleet-alerts.yml": templates.render("prometheus/alerts.rules.yml.j2", **rule_values(args)),
        "grafana-dashboard.json": dashboard_json(args.stack),
    }
    files.update({f"ca/{n.name}.pem": n.ca_pem for n in args.nodes if n.ca_pem})
    if alertmanager:
        files["alertmanager.yml"] = templates.render("prometheus/alertmanager.yml.j2", webhook_url=args.alertmanager_webhook_url,
                                                     repeat_interval=args.repeat_interval)
    return files


def dashboard_json(title: str = "fimfleet") -> str:
    """The Grafana dashboard (files/prometheus/grafana-dashboard.json); it reads recorded series only."""
    board = json.loads((templates.FILES / "prometheus/grafana-dashboard.json").read_text())
    board["title"] = title
    return json.dumps(board, indent=2) + "\n"


def sla_textfile(node: str, report: Mapping) -> str:
    """The last SLA gate report (components.sla's report dict) as node_exporter textfile metrics."""
    def num(v) -> str:
        return "NaN" if v is None else repr(float(v))

    report = report or {}  # none yet (a preview, or Pulumi mocks): nothing passed
    ttft = report.get("ttft_ms") or {}
    started = report.get("started_at")
    ts = datetime.fromisoformat(started).timestamp() if started else None
    return templates.render(
        "prometheus/sla-gate.prom.j2", node=node,
        ttft_s=[(n, num(None if ttft.get(f"p{n}") is None else ttft[f"p{n}"] / 1000)) for n, _ in QUANTILES],
        decode_tokens_per_s=num((report.get("decode_tokens_per_s") or {}).get("p50")),
        passed=0 if not report or report.get("violations") or report.get("passed") is False else 1,
        ok=int(report.get("ok") or 0), errors=int(report.get("errors") or 0), timestamp=num(ts))


ROLE_SERVICES = {"server": ("prometheus", "prometheus-alertmanager"), "exporter": ("prometheus-node-exporter",)}
"""Every daemon whose /etc/default file a role's step may replace: its destroy gives each one back,
whether or not the stack still configures it (Alertmanager turned off)."""


def _defaults(service: str, args: list[str] = ()) -> dict:
    """One /etc/default file: fimfleet's (staged), the one from before fimfleet (backup), or a marker
    that there was none (absent), and a stamp that the daemon still owes a restart for it."""
    backup = f"{STAGED_DIR}/before-fimfleet-{service}"
    return {"service": service, "dest": f"/etc/default/{service}", "staged": f"{STAGED_DIR}/default-{service}",
            "backup": backup, "absent": f"{backup}.absent", "restart": RESTART_STAMP.format(service=service),
            "args": list(args)}


def _packages(role: str, packages: list[str], defaults: list[dict], units: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """Staged /etc/default files, and what packages.sh.j2 / packages-destroy.sh.j2 need; `units`:
    the unit files the step uploads besides, which packages.sh reloads when they changed."""
    files = [{"path": d["staged"], "mode": "0644", "content": templates.render("prometheus/default-args.j2", args=d["args"])}
             for d in defaults]
    return files, {"record": PACKAGE_RECORD.format(role=role), "packages": packages, "defaults": defaults,
                   "all_defaults": [_defaults(s) for s in ROLE_SERVICES[role]],
                   "units": [d["service"] for d in defaults] + list(units)}


def steps(args: MonitoringArgs) -> list[dict]:
    """The Prometheus host's steps: packages, config, rules (and Alertmanager when a webhook is set)."""
    alertmanager = bool(args.alertmanager_webhook_url)
    defaults = [_defaults("prometheus", prometheus_args(args))]
    if alertmanager:
        defaults.append(_defaults("prometheus-alertmanager", alertmanager_args(args)))
    staged, pkg = _packages("server", ["prometheus"] + (["prometheus-alertmanager"] if alertmanager else []), defaults)
    rendered = prometheus_files(args)
    files = staged + [{"path": f"{args.config_dir}/{rel}", "mode": "0644", "content": content}
                      for rel, content in rendered.items() if rel != "alertmanager.yml"]
    if alertmanager:  # root's only; server-apply.sh installs it for the daemon's group
        files.append({"path": ALERTMANAGER_STAGED, "mode": "0600", "content": rendered["alertmanager.yml"]})
    kw = dict(config=f"{args.config_dir}/prometheus.yml", alertmanager=alertmanager, listen=args.listen,
              alertmanager_config=f"{args.config_dir}/alertmanager.yml", alertmanager_staged=ALERTMANAGER_STAGED,
              alertmanager_listen=args.alertmanager_listen,
              default_staged=defaults[0]["staged"], config_dir=args.config_dir, rule_groups=len(RULE_GROUPS),
              port=_split_hostport(args.listen)[1], alertmanager_port=_split_hostport(args.alertmanager_listen)[1],
              alertmanager_default=_defaults("prometheus-alertmanager"), **pkg)
    return _step("prometheus", "prometheus", "server", files, kw)


def exporter_steps(e: ExporterArgs) -> list[dict]:
    """One host's node_exporter and its deep-probe textfile export."""
    d = _defaults("prometheus-node-exporter", node_exporter_args(e))
    staged, pkg = _packages("exporter", ["prometheus-node-exporter", "dbus", "openssl"], [d],
                            (f"{HELPER_UNIT}.service", f"{HELPER_UNIT}.timer"))
    kw = dict(textfile_dir=e.textfile_dir, script=HELPER, env_file=HELPER_ENV, state_dir=e.state_dir,
              timer=f"{HELPER_UNIT}.timer", service=f"{HELPER_UNIT}.service", listen=e.listen,
              monitors=[f"{node}={unit}" for node, unit in e.monitors],
              certificates=[f"{node}={path}" for node, path in e.certificates],
              start_stamps=[f"{unit}={path}" for unit, path in e.start_stamps], default_staged=d["staged"],
              port=_split_hostport(e.listen)[1], **pkg)
    files = staged + [
        {"path": HELPER, "mode": "0755", "content": (templates.FILES / "prometheus/monitor-textfile.sh").read_text()},
        {"path": HELPER_ENV, "mode": "0644", "content": templates.render("prometheus/monitor-textfile.env.j2",
                                                                         run_dir=e.run_dir, **kw)},
        {"path": f"/etc/systemd/system/{HELPER_UNIT}.service", "mode": "0644",
         "content": templates.render("prometheus/monitor-textfile.service.j2", **kw)},
        {"path": f"/etc/systemd/system/{HELPER_UNIT}.timer", "mode": "0644",
         "content": templates.render("prometheus/monitor-textfile.timer.j2", interval_s=e.interval_s)},
    ]
    return _step("exporter", "node_exporter", "exporter", files, kw)


def _step(name: str, label: str, role: str, files: list[dict], kw: dict) -> list[dict]:
    """files/prometheus/<role>-{apply,check,destroy}.sh.j2 as one step; apply ends with the check."""
    check_script = templates.render(f"prometheus/{role}-check.sh.j2", **kw)
    return [{"name": name, "label": label, "files": files, "check": check_script,
             "apply": templates.render(f"prometheus/{role}-apply.sh.j2", check=check_script, **kw),
             "destroy": templates.render(f"prometheus/{role}-destroy.sh.j2", **kw)}]


def tunnel_command(connection: Mapping, listen: str) -> str:
    """The SSH command that opens the Prometheus UI at http://localhost:<port>."""
    q = templates.shell_quote
    host, port = _split_hostport(listen)
    jump = ""
    if connection.get("bastionHost"):
        jump = f" -J {q(connection.get('bastionUser') or connection.get('user', 'root'))}@{q(connection['bastionHost'])}:" \
               f"{int(connection.get('bastionPort', 22))}"
    return (f"ssh -N -L {port}:{host.strip('[]')}:{port} -p {int(connection.get('port', 22))}{jump} "
            f"{q(connection.get('user', 'root'))}@{q(connection['host'])}")


# ----------------------------------------------------------------------------- resources


def _remote_steps(parent: pulumi.Resource, name: str, specs: list[dict], connection, depends_on) -> list[RemoteStep]:
    out = []
    for s in specs:
        out.append(RemoteStep(f"{name}-{s['name']}", label=s["label"], connection=connection,
                              files=pulumi.Output.secret(s["files"]), apply=s["apply"], check=s["check"],
                              destroy=s["destroy"], timeout_s=1800,
                              opts=pulumi.ResourceOptions(parent=parent, depends_on=list(depends_on) + out)))
    return out


class NodeExporter(pulumi.ComponentResource):
    """node_exporter and the deep-probe export on a host that does not run Prometheus."""

    def __init__(self, name: str, exporter: ExporterArgs, connection: pulumi.Input[dict],
                 opts: pulumi.ResourceOptions | None = None):
        if found := exporter_problems(exporter):
            raise ConfigError(found)
        super().__init__("fimfleet:monitoring:NodeExporter", name, None, opts)
        self.steps = _remote_steps(self, name, exporter_steps(exporter), connection, [])
        self.register_outputs({})


class Monitoring(pulumi.ComponentResource):
    """Prometheus (and this host's node_exporter) with the stack's rules; see the module docstring.

    `ca_pems` maps a node name to its ingress CA as an Output (e.g. NginxIngress.ca_pem);
    `sla_reports` maps a node name to its FimSlaCheck `report` output, written as a textfile
    on this host (or later, export_sla_report). `setup_steps`: node_exporter and Prometheus,
    without the reports. Outputs: tunnel_command, url (through the tunnel), dashboard_json.
    """

    def __init__(self, name: str, args: MonitoringArgs, connection: pulumi.Input[dict],
                 exporter: ExporterArgs | None = None, sla_reports: Mapping[str, pulumi.Input[dict]] | None = None,
                 ca_pems: Mapping[str, pulumi.Input[str]] | None = None, opts: pulumi.ResourceOptions | None = None):
        check(args, exporter, sla_nodes=list(sla_reports or ()) + list(ca_pems or ()))
        super().__init__("fimfleet:monitoring:Monitoring", name, None, opts)
        conn = pulumi.Output.from_input(connection)
        exporters = _remote_steps(self, name, exporter_steps(exporter), conn, []) if exporter else []
        specs = steps(dataclasses.replace(args, nodes=tuple(
            dataclasses.replace(n, ca_pem=n.ca_pem or "<ca_pems>") if n.name in (ca_pems or {}) else n for n in args.nodes)))
        if ca_pems:  # the CA files' content arrives later; paths, config and digest do not depend on it
            paths = [f"{args.config_dir}/ca/{n}.pem" for n in ca_pems]
            files = specs[0]["files"]
            specs[0]["files"] = pulumi.Output.all(*ca_pems.values()).apply(
                lambda pems, files=files: [{**f, "content": dict(zip(paths, pems)).get(f["path"], f["content"])}
                                           for f in files])
        # Prometheus does not wait for node_exporter (it scrapes what answers): the two go at once.
        self.setup_steps = exporters + _remote_steps(self, name, specs, conn, [])
        self.steps = list(self.setup_steps)
        self._args, self._name, self._conn, self._exporters = args, name, conn, exporters
        self._textfile_dir = exporter.textfile_dir if exporter else args.textfile_dir
        for node, report in (sla_reports or {}).items():
            self.export_sla_report(node, report)
        self.tunnel_command = pulumi.Output.unsecret(conn.apply(lambda c: tunnel_command(c, args.listen)))
        self.url = f"http://localhost:{_split_hostport(args.listen)[1]}"
        self.dashboard_json = dashboard_json(args.stack)
        self.register_outputs({"tunnelCommand": self.tunnel_command, "url": self.url})

    def export_sla_report(self, node: str, report: pulumi.Input[dict]) -> RemoteStep:
        """Node `node`'s SLA gate report (its FimSlaCheck `report`) as a textfile on this host: a
        step of its own, so the gate can wait for Prometheus while this waits for the gate."""
        check(self._args, sla_nodes=[node])
        path = f"{self._textfile_dir}/fimfleet_sla_{node}.prom"
        textfile = pulumi.Output.from_input(report).apply(
            lambda r: [{"path": path, "mode": "0644", "content": sla_textfile(node, r)}])
        step = RemoteStep(
            f"{self._name}-sla-{node}", label=f"SLA report textfile ({node})", connection=self._conn, files=textfile,
            apply=templates.render("prometheus/sla-gate-apply.sh.j2", node=node, path=path),
            destroy=templates.render("prometheus/sla-gate-destroy.sh.j2", path=path),
            opts=pulumi.ResourceOptions(parent=self, depends_on=self._exporters))
        self.steps.append(step)
        return step
