"""The rendered Prometheus config and rules pass promtool, every alert fires on synthetic
series and stays quiet when it should, and the dashboard reads only recorded series.

`promtool` comes with Debian's `prometheus` package (./fimfleet bootstrap installs it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components import monitoring as m
from components.tls import issue

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
assert Path(PROMTOOL).exists(), "promtool is missing: ./fimfleet bootstrap installs Debian's prometheus package"


def make_args(config_dir="/etc/prometheus/fimfleet", **over) -> m.MonitoringArgs:
    base = dict(
        nodes=(m.ScrapeNode("a", "https://127.0.0.1:8443/metrics", ca_pem=issue("a", ["a"], ["127.0.0.1"])["caPem"]),
               m.ScrapeNode("b", "https://10.0.0.7/metrics", server_name="b.example", allow_cidrs=("10.0.0.0/24",))),
        exporters=(m.ExporterTarget("a"), m.ExporterTarget("gw", "10.0.0.9:9100", role="gateway")),
        scraper_address="10.0.0.9", ttft_p50_ms=200, ttft_p95_ms=400, ttft_p99_ms=620, min_decode_tokens_per_s=5,
        decode_ceiling_tokens_per_s=50, max_steal_percent=8, probe_interval_s=15, config_dir=config_dir)
    base.update(over)
    return m.MonitoringArgs(**base)


def write(directory: Path, args: m.MonitoringArgs) -> dict[str, Path]:
    out = {}
    for rel, content in m.prometheus_files(args).items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        out[rel] = path
    return out


def promtool(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *argv], capture_output=True, text=True, cwd=cwd, timeout=60)


@pytest.mark.parametrize("webhook", ["", "https://hooks.example.com/fimfleet?token=x"])
def test_rendered_config_and_rules_pass_promtool(tmp_path, webhook):
    files = write(tmp_path, make_args(config_dir=str(tmp_path), alertmanager_webhook_url=webhook))
    r = promtool("check", "config", str(files["prometheus.yml"]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout
    r = promtool("check", "rules", str(files["rules/fimfleet-recording.yml"]), str(files["rules/fimfleet-alerts.yml"]))
    assert r.returncode == 0, r.stdout + r.stderr
    config = yaml.safe_load(files["prometheus.yml"].read_text())
    assert bool(config.get("alerting")) == bool(webhook)
    groups = [g["name"] for rel in ("rules/fimfleet-recording.yml", "rules/fimfleet-alerts.yml")
              for g in yaml.safe_load(files[rel].read_text())["groups"]]
    assert sorted(groups) == sorted(m.RULE_GROUPS)


def test_alertmanager_config_passes_amtool(tmp_path):
    amtool = shutil.which("amtool")
    assert amtool, "amtool is missing: ./fimfleet bootstrap installs Debian's prometheus-alertmanager package"
    files = write(tmp_path, make_args(config_dir=str(tmp_path), alertmanager_webhook_url="https://hooks.example.com/x?t=1"))
    r = subprocess.run([amtool, "check-config", str(files["alertmanager.yml"])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(files["alertmanager.yml"].read_text())["receivers"][0]["webhook_configs"][0]["url"] \
        == "https://hooks.example.com/x?t=1"
    broken = tmp_path / "broken.yml"
    broken.write_text(files["alertmanager.yml"].read_text().replace("receiver: fimfleet-webhook", "receiver: nobody"))
    assert subprocess.run([amtool, "check-config", str(broken)], capture_output=True, timeout=60).returncode != 0


def test_promtool_rejects_a_broken_rule(tmp_path):
    """The check above can fail: a rule with a PromQL syntax error is refused."""
    files = write(tmp_path, make_args(config_dir=str(tmp_path)))
    path = files["rules/fimfleet-alerts.yml"]
    path.write_text(path.read_text().replace("fimfleet:ttft_seconds:p99 >", "fimfleet:ttft_seconds:p99 >>", 1))
    assert promtool("check", "rules", str(path)).returncode != 0


def test_scrape_config_verifies_tls_and_labels_every_target(tmp_path):
    config = yaml.safe_load(m.prometheus_files(make_args(config_dir=str(tmp_path)))["prometheus.yml"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    a, b = jobs["vllm-a"], jobs["vllm-b"]
    assert a["scheme"] == b["scheme"] == "https"
    assert a["tls_config"] == {"ca_file": f"{tmp_path}/ca/a.pem", "insecure_skip_verify": False}
    assert b["tls_config"] == {"server_name": "b.example", "insecure_skip_verify": False}
    assert a["static_configs"] == [{"targets": ["127.0.0.1:8443"], "labels": {"node": "a", "role": "vllm"}}]
    assert b["static_configs"][0]["targets"] == ["10.0.0.7"]
    assert a["relabel_configs"] == [{"target_label": "job", "replacement": "vllm"}]
    assert jobs["node"]["static_configs"][1] == {"targets": ["10.0.0.9:9100"], "labels": {"host": "gw", "role": "gateway"}}
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["127.0.0.1:9090"]


# ------------------------------------------------------------------ alerts on synthetic series

def ttft_buckets(per_min: dict[str, int]) -> dict[str, str]:
    return {f'vllm:time_to_first_token_seconds_bucket{{job="vllm",node="a",le="{le}"}}': f"0+{n}x40"
            for le, n in per_min.items()}


# p99 of 100 requests a minute with 98 under 0.5 s and 2 in (0.5, 0.75]: 0.5 + 0.25 * 1/2 = 0.625 s
TTFT = ttft_buckets({"0.25": 0, "0.5": 98, "0.75": 100, "+Inf": 100})
ITL = {'vllm:inter_token_latency_seconds_count{job="vllm",node="a"}': "0+100x40",
       'vllm:inter_token_latency_seconds_sum{job="vllm",node="a"}': "0+25x40"}  # 4 tokens/s per request
STEAL = {f'node_cpu_seconds_total{{job="node",host="a",cpu="{c}",mode="steal"}}': "0+6x40" for c in (0, 1)}  # 10 %
PROBE = 'fimfleet_monitor_probe_ok{job="node",host="a",node="a",unit="vllm-a.service"}'
BUSY = 'fimfleet_monitor_probe_busy{job="node",host="a",node="a",unit="vllm-a.service"}'
STARTING = 'fimfleet_monitor_engine_starting{job="node",host="a",node="a",unit="vllm-a.service"}'
VLLM_UP = 'up{job="vllm",role="vllm",node="a",instance="127.0.0.1:8443"}'
PROBE_TS = 'fimfleet_monitor_last_probe_timestamp_seconds{job="node",host="a",node="a",unit="vllm-a.service"}'
RESTARTS = 'fimfleet_monitor_restarts_total{job="node",host="a",node="a",unit="vllm-a.service"}'
KV = 'vllm:kv_cache_usage_perc{job="vllm",node="a",engine="0"}'
CERT = 'fimfleet_tls_certificate_not_after_seconds{job="node",host="a",node="a",path="/etc/fimfleet/tls/server.pem"}'
DAY = 86400

# name: (alert, MonitoringArgs overrides, input series, [(eval time, firing?)])
SCENARIOS = {
    "ttft-p99-just-above-the-sla": ("FimfleetTtftP99AboveSla", {"ttft_p99_ms": 620}, TTFT,
                                    [("9m", False), ("13m", True), ("30m", True)]),
    "ttft-p99-just-below-the-sla": ("FimfleetTtftP99AboveSla", {"ttft_p99_ms": 630}, TTFT, [("12m", False), ("30m", False)]),
    "ttft-above-for-less-than-10m": ("FimfleetTtftP99AboveSla", {"ttft_p99_ms": 620, "ttft_for": "30m"}, TTFT,
                                     [("25m", False)]),
    "decode-below-the-sla": ("FimfleetDecodeBelowSla", {"min_decode_tokens_per_s": 5}, ITL, [("9m", False), ("13m", True)]),
    "decode-above-the-sla": ("FimfleetDecodeBelowSla", {"min_decode_tokens_per_s": 3.9}, ITL, [("12m", False)]),
    "probe-failing": ("FimfleetDeepProbeFailing", {}, {PROBE: "1x3 0x20", BUSY: "0x23"}, [("4m", False), ("6m", True)]),
    "probe-fails-behind-real-work": ("FimfleetDeepProbeFailing", {}, {PROBE: "1x3 0x20", BUSY: "0x3 1x20"},
                                     [("6m", False), ("12m", False)]),
    # a roll or a recovery restarts the engine: inside the monitor's start grace nothing is down yet,
    # and once the grace is over (the monitor says fail) both alerts come as they would
    "probe-failing-while-the-engine-starts": ("FimfleetDeepProbeFailing", {},
                                              {PROBE: "1x3 0x20", BUSY: "0x23", STARTING: "0x3 1x20"},
                                              [("6m", False), ("15m", False)]),
    "probe-failing-after-the-start-grace": ("FimfleetDeepProbeFailing", {},
                                            {PROBE: "1x3 0x20", BUSY: "0x23", STARTING: "0x3 1x5 0x15"},
                                            [("8m", False), ("13m", True)]),
    "node-down-while-the-engine-starts": ("FimfleetNodeDown", {}, {VLLM_UP: "1 1 0x20", STARTING: "0 0 1x20"},
                                          [("5m", False), ("15m", False)]),
    "node-down-after-the-start-grace": ("FimfleetNodeDown", {}, {VLLM_UP: "1 1 0x20", STARTING: "0 0 1x5 0x15"},
                                        [("7m", False), ("10m", True)]),
    # the engine's first start: the monitor, installed once it serves, has not probed yet
    "no-probe-during-the-first-start": ("FimfleetDeepProbeStale", {}, {PROBE_TS: "0x40", STARTING: "1x40"},
                                        [("12m", False), ("30m", False)]),
    "no-probe-after-the-first-start": ("FimfleetDeepProbeStale", {}, {PROBE_TS: "0x40", STARTING: "1x10 0x30"},
                                       [("9m", False), ("25m", True)]),
    "probe-one-failure-then-ok": ("FimfleetDeepProbeFailing", {}, {PROBE: "1x3 0 1x20"}, [("4m", False), ("10m", False)]),
    "probe-stale": ("FimfleetDeepProbeStale", {}, {PROBE_TS: "0+60x5 300x20"}, [("8m", False), ("12m", True)]),
    "probe-fresh": ("FimfleetDeepProbeStale", {}, {PROBE_TS: "0+60x30"}, [("12m", False), ("25m", False)]),
    "restart-loop-by-the-monitor": ("FimfleetEngineRestartLoop", {}, {RESTARTS: "0 1 2 3x20"}, [("1m", False), ("4m", True)]),
    "restart-loop-by-systemd": ("FimfleetEngineRestartLoop", {},
                                {'node_systemd_service_restart_total{job="node",host="a",name="vllm-a.service"}': "0+1x20"},
                                [("5m", True)]),
    "two-restarts-are-no-loop": ("FimfleetEngineRestartLoop", {}, {RESTARTS: "0 1 2x20"}, [("5m", False), ("15m", False)]),
    "steal-above-max": ("FimfleetCpuStealHigh", {"max_steal_percent": 8}, STEAL, [("9m", False), ("17m", True)]),
    "steal-below-max": ("FimfleetCpuStealHigh", {"max_steal_percent": 12}, STEAL, [("12m", False)]),
    "kv-cache-full": ("FimfleetKvCacheHigh", {}, {KV: "0.5 0.95x20"}, [("5m", False), ("7m", True)]),
    "kv-cache-below-90": ("FimfleetKvCacheHigh", {}, {KV: "0.89x20"}, [("10m", False)]),
    "node-down": ("FimfleetNodeDown", {}, {'up{job="vllm",role="vllm",node="a",instance="127.0.0.1:8443"}': "1 1 0x20"},
                  [("3m", False), ("5m", True)]),
    "node-exporter-down": ("FimfleetNodeDown", {}, {'up{job="node",role="node",host="a",instance="127.0.0.1:9100"}': "0x20"},
                           [("3m", True)]),
    "node-up": ("FimfleetNodeDown", {}, {'up{job="vllm",role="vllm",node="a",instance="127.0.0.1:8443"}': "1x20"},
                [("10m", False)]),
    # time() starts at 0 in promtool: a notAfter of 13.9 days is 13.9 days away
    "certificate-expiring": ("FimfleetCertificateExpiring", {}, {CERT: f"{int(13.9 * DAY)}x200"},
                             [("59m", False), ("2h", True)]),
    "certificate-fresh": ("FimfleetCertificateExpiring", {}, {CERT: f"{int(14.5 * DAY)}x200"}, [("3h", False)]),
    "certificate-window-follows-the-setting": ("FimfleetCertificateExpiring", {"cert_alert_days": 30},
                                               {CERT: f"{int(29 * DAY)}x200"}, [("2h", True)]),
    "gateway-down": ("FimfleetGatewayDown", {}, {'up{job="node",role="gateway",host="gw",instance="10.0.0.9:9100"}': "0x20"},
                     [("1m", False), ("3m", True)]),
}


def firing_test(alert: str, series: dict[str, str], checks: list[tuple[str, bool]]) -> dict:
    """One promtool test: at each time exactly `alert` fires (or nothing fires at all)."""
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "promql_expr_test": [{"expr": 'count by (alertname) (ALERTS{alertstate="firing"})', "eval_time": t,
                                  "exp_samples": [{"labels": f'{{alertname="{alert}"}}', "value": 1}] if fires else []}
                                 for t, fires in checks]}


def run_rule_tests(tmp_path: Path, args: m.MonitoringArgs, tests: list[dict]) -> subprocess.CompletedProcess:
    files = write(tmp_path, args)
    spec = {"rule_files": [str(files["rules/fimfleet-recording.yml"]), str(files["rules/fimfleet-alerts.yml"])],
            "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return promtool("test", "rules", str(tmp_path / "tests.yml"))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_alert_fires_and_stays_quiet(tmp_path, name):
    alert, over, series, checks = SCENARIOS[name]
    r = run_rule_tests(tmp_path, make_args(config_dir=str(tmp_path), **over), [firing_test(alert, series, checks)])
    assert r.returncode == 0, f"{name}:\n{r.stdout}{r.stderr}"


def test_every_alert_has_a_firing_scenario(tmp_path):
    rules = yaml.safe_load(m.prometheus_files(make_args())["rules/fimfleet-alerts.yml"])
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    fired = {alert for alert, _, _, checks in SCENARIOS.values() if any(f for _, f in checks)}
    assert alerts == fired


def test_a_wrong_expectation_fails(tmp_path):
    """The harness can fail: claiming the TTFT alert fires under a 630 ms SLA is refused."""
    r = run_rule_tests(tmp_path, make_args(config_dir=str(tmp_path), ttft_p99_ms=630),
                       [firing_test("FimfleetTtftP99AboveSla", TTFT, [("12m", True)])])
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


def test_recorded_ttft_and_the_alert_text(tmp_path):
    test = firing_test("FimfleetTtftP99AboveSla", TTFT, [])
    test["promql_expr_test"] = [{"expr": "fimfleet:ttft_seconds:p99", "eval_time": "10m",
                                 "exp_samples": [{"labels": 'fimfleet:ttft_seconds:p99{node="a"}', "value": 0.625}]},
                                {"expr": 'fimfleet:sla_ttft_seconds:limit{percentile="99"}', "eval_time": "10m",
                                 "exp_samples": [{"labels": 'fimfleet:sla_ttft_seconds:limit{percentile="99"}', "value": 0.62}]}]
    test["alert_rule_test"] = [{"eval_time": "12m", "alertname": "FimfleetTtftP99AboveSla", "exp_alerts": [{
        "exp_labels": {"severity": "page", "node": "a"},
        "exp_annotations": {"summary": "TTFT p99 on a is 625ms, above the SLA of 620 ms for 10m"}}]}]
    r = run_rule_tests(tmp_path, make_args(config_dir=str(tmp_path)), [test])
    assert r.returncode == 0, r.stdout + r.stderr


def test_tighter_sla_gives_a_tighter_alert():
    def threshold(**over):
        rules = yaml.safe_load(m.prometheus_files(make_args(**over))["rules/fimfleet-alerts.yml"])
        expr = next(r["expr"] for g in rules["groups"] for r in g["rules"] if r["alert"] == "FimfleetTtftP99AboveSla")
        return float(expr.rsplit(">", 1)[1])

    assert threshold(ttft_p99_ms=800) == 0.8
    assert threshold(ttft_p99_ms=250) == 0.25


# ------------------------------------------------------------------ the dashboard

def recorded_series(args: m.MonitoringArgs) -> set[str]:
    rules = yaml.safe_load(m.prometheus_files(args)["rules/fimfleet-recording.yml"])
    return {r["record"] for g in rules["groups"] for r in g["rules"]}


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "sum", "max", "min", "avg", "count", "rate", "increase", "time", "vector", "scalar"}


def series_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, ranges and strings removed)."""
    expr = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', " ", expr)
    return {t for t in re.findall(r"(?<![0-9.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if t not in PROMQL_WORDS}


def dashboard_problems(board: dict, recorded: set[str]) -> list[str]:
    out = []
    for panel in board["panels"]:
        if not panel.get("targets"):
            out.append(f"panel {panel['title']!r} has no query")
        for t in panel.get("targets", ()):
            names = series_in(t["expr"])
            if not names:
                out.append(f"panel {panel['title']!r}: {t['expr']!r} names no series")
            out += [f"panel {panel['title']!r}: {n!r} is not a recorded series" for n in sorted(names - recorded)]
    return out


def test_every_dashboard_query_reads_a_recorded_series():
    board = json.loads(m.dashboard_json("stack-x"))
    assert board["title"] == "stack-x" and len(board["panels"]) >= 10
    assert dashboard_problems(board, recorded_series(make_args())) == []
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in board["panels"])
    for what in ("TTFT", "Decode", "Queue", "KV cache", "steal", "probe", "SLA gate"):
        assert what in titles


def test_the_dashboard_check_catches_a_raw_or_unknown_series():
    board = {"panels": [{"title": "raw", "targets": [{"expr": "vllm:num_requests_running"}]},
                        {"title": "typo", "targets": [{"expr": "fimfleet:ttft_secnds:p99"}]},
                        {"title": "empty", "targets": []}]}
    found = dashboard_problems(board, recorded_series(make_args()))
    assert len(found) == 3, found


def test_dashboard_file_on_the_host_is_the_stack_output():
    args = dataclasses.replace(make_args(), stack="prod")
    assert m.prometheus_files(args)["grafana-dashboard.json"] == m.dashboard_json("prod")
