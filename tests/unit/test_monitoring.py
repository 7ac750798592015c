"""Monitoring: bad input gives one clear error per key, the rendered scripts and units pass
real tools, the textfile exports are valid Prometheus text, and the component's tree."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pulumi
import pytest

from components import monitoring as m
from components import templates
from components.config import ConfigError
from tests.helpers import ForkLog
from tests.unit.test_monitoring_rules import PROMTOOL, make_args
from tests.unit.test_rendering import verify_unit

REPORT = {"ttft_ms": {"p50": 12.5, "p95": 30.0, "p99": 41.0}, "decode_tokens_per_s": {"p50": 80.25},
          "ok": 20, "errors": 0, "started_at": "2026-03-01T10:00:00+00:00", "violations": []}


def keys(args) -> list[str]:
    return [p.key for p in m.problems(args)]


def test_valid_args_have_no_problems():
    assert m.problems(make_args()) == []


def test_scraper_outside_the_metrics_cidrs_names_the_fix():
    args = make_args(scraper_address="192.0.2.50")
    found = m.problems(args)
    assert [p.key for p in found] == ["ingress.metricsAllowCidrs"]
    assert "192.0.2.50/32" in found[0].fix and "node b" in found[0].fix


def test_loopback_urls_are_reached_from_loopback_whatever_the_scraper():
    args = make_args(nodes=(m.ScrapeNode("a", "https://127.0.0.1:8443/metrics", allow_cidrs=("127.0.0.1/32",)),),
                     scraper_address="10.0.0.9")
    assert m.problems(args) == []
    args = make_args(nodes=(m.ScrapeNode("a", "https://127.0.0.1:8443/metrics", allow_cidrs=("10.0.0.0/8",)),))
    assert keys(args) == ["ingress.metricsAllowCidrs"]


@pytest.mark.parametrize("over, key", [
    ({"listen": "0.0.0.0:9090"}, "monitoring.listen"),
    ({"listen": "10.0.0.9:9090"}, "monitoring.listen"),
    ({"alertmanager_listen": ":9093"}, "monitoring.alertmanagerListen"),
    ({"alertmanager_webhook_url": "https://x.example/a b"}, "monitoring.alertmanagerWebhookUrl"),
    ({"alertmanager_webhook_url": 'https://x.example/"; rm -rf /'}, "monitoring.alertmanagerWebhookUrl"),
    ({"max_steal_percent": "5"}, "monitoring.maxStealPercent"),
    ({"max_steal_percent": 150}, "monitoring.maxStealPercent"),
    ({"ttft_p99_ms": 0}, "monitoring.ttftP99Ms"),
    ({"ttft_for": "10 minutes"}, "monitoring.ttftFor"),
    ({"rate_window": "5m]) or vector(1"}, "monitoring.rateWindow"),
    ({"scrape_interval_s": True}, "monitoring.scrapeIntervalS"),
    ({"config_dir": "etc/x"}, "monitoring.configDir"),
    ({"config_dir": "/etc/x; reboot"}, "monitoring.configDir"),
    ({"nodes": (m.ScrapeNode('a"} or vector(1) #', "https://127.0.0.1/metrics"),)}, "monitoring.nodes[0].name"),
    ({"nodes": (m.ScrapeNode("a", "http://127.0.0.1/metrics"),)}, "monitoring.nodes[0].metricsUrl"),
    ({"nodes": (m.ScrapeNode("a", "https://127.0.0.1/metrics?x=1"),)}, "monitoring.nodes[0].metricsUrl"),
    ({"nodes": (m.ScrapeNode("a", 'https://a"b:443/metrics'),)}, "monitoring.nodes[0].metricsUrl"),
    ({"nodes": (m.ScrapeNode("a", "https://user@127.0.0.1/metrics"),)}, "monitoring.nodes[0].metricsUrl"),
    ({"nodes": (m.ScrapeNode("a", "https://127.0.0.1/metrics", allow_cidrs=("ten/8",)),)}, "monitoring.nodes[0].allowCidrs"),
    ({"exporters": (m.ExporterTarget("h", "10.0.0.9"),)}, "monitoring.exporters[0].address"),
    ({"exporters": (m.ExporterTarget("h", role="db"),)}, "monitoring.exporters[0].role"),
])
def test_bad_value_names_its_key(over, key):
    found = m.problems(make_args(**over))
    assert key in [p.key for p in found], found
    assert all(p.fix for p in found)


def test_every_problem_is_reported_at_once_without_a_traceback():
    args = make_args(listen="0.0.0.0:9090", max_steal_percent=None, ttft_p99_ms="fast",
                     nodes=(m.ScrapeNode("a", "ftp://x"),), alertmanager_webhook_url="nope")
    with pytest.raises(ConfigError) as err:
        m.check(args)
    text = str(err.value)
    for key in ("monitoring.listen", "monitoring.maxStealPercent", "monitoring.ttftP99Ms",
                "monitoring.nodes[0].metricsUrl", "monitoring.alertmanagerWebhookUrl"):
        assert key in text


def test_sla_reports_must_belong_to_scraped_nodes():
    with pytest.raises(ConfigError, match="zz.*is not a scraped node"):
        m.check(make_args(), sla_nodes=["a", "zz"])


@pytest.mark.parametrize("exporter, key", [
    (m.ExporterArgs("h", monitors=(("a", "vllm-a.service; reboot"),)), "monitoring.exporter.monitors"),
    (m.ExporterArgs("h", watched_units=("nginx",)), "monitoring.exporter.watchedUnits"),
    (m.ExporterArgs("h", listen="9100"), "monitoring.exporter.listen"),
    (m.ExporterArgs("h h"), "monitoring.exporter.host"),
    (m.ExporterArgs("h", state_dir="rel"), "monitoring.exporter.stateDir"),
    (m.ExporterArgs("h", certificates=(("a", "etc/tls/server.pem"),)), "monitoring.exporter.certificates"),
    (m.ExporterArgs("h", certificates=(("a", "/etc/tls/x.pem; reboot"),)), "monitoring.exporter.certificates"),
])
def test_bad_exporter_value_names_its_key(exporter, key):
    assert key in [p.key for p in m.exporter_problems(exporter)]


# ------------------------------------------------------------------ daemon arguments

EXPORTER = m.ExporterArgs("a", monitors=(("a", "vllm-a.service"), ("b", "vllm-b.service")))


def test_daemons_listen_where_configured_and_args_are_plain_words():
    args = make_args(alertmanager_webhook_url="https://hooks.example.com/x")
    assert "--web.listen-address=127.0.0.1:9090" in m.prometheus_args(args)
    assert "--web.listen-address=127.0.0.1:9093" in m.alertmanager_args(args)
    assert "--cluster.listen-address=" in m.alertmanager_args(args)  # no HA gossip on 0.0.0.0:9094
    ne = m.node_exporter_args(EXPORTER)
    assert "--web.listen-address=127.0.0.1:9100" in ne
    assert "--collector.systemd.enable-restarts-metrics" in ne
    # /etc/default files are read by systemd (EnvironmentFile) and by shell init scripts alike
    for arg in m.prometheus_args(args) + m.alertmanager_args(args) + ne:
        assert not re.search(r"[\s\"'$`\\]", arg), arg


def test_systemd_collector_watches_exactly_the_engines_and_nginx():
    include = next(a.split("=", 1)[1] for a in m.node_exporter_args(EXPORTER) if "unit-include" in a)
    rx = re.compile(f"^(?:{include})$")  # node_exporter anchors it the same way
    for unit in ("vllm-a.service", "vllm-b.service", "nginx.service"):
        assert rx.match(unit)
    for unit in ("vllm-aXservice", "vllm-c.service", "ssh.service", "nginx.service.d"):
        assert not rx.match(unit)


def test_vmstat_fields_keep_debians_defaults_and_add_thp():
    rx = re.compile(m.VMSTAT_FIELDS)
    for name in ("oom_kill", "pgpgin", "pswpout", "pgmajfault", "thp_fault_alloc", "thp_collapse_alloc"):
        assert rx.match(name)


# ------------------------------------------------------------------ scripts and units

def all_scripts():
    for webhook in ("", "https://hooks.example.com/x"):
        for s in m.steps(make_args(alertmanager_webhook_url=webhook)):
            for kind in ("apply", "check", "destroy"):
                yield f"{s['name']}-{kind}{'-am' if webhook else ''}", s[kind]
    for e in (EXPORTER, m.ExporterArgs("gw")):
        for s in m.exporter_steps(e):
            for kind in ("apply", "check", "destroy"):
                yield f"{s['name']}-{kind}-{len(e.monitors)}", s[kind]
    yield "sla-apply", templates.render("prometheus/sla-gate-apply.sh.j2", node="a", path="/x/fimfleet_sla_a.prom")
    yield "sla-destroy", templates.render("prometheus/sla-gate-destroy.sh.j2", path="/x/fimfleet_sla_a.prom")
    yield "monitor-textfile.sh", (templates.FILES / "prometheus/monitor-textfile.sh").read_text()


def test_scripts_pass_bash_n_and_shellcheck(tmp_path):
    assert shutil.which("shellcheck"), "shellcheck is installed by ./fimfleet bootstrap"
    for name, body in all_scripts():
        path = tmp_path / f"{name}.sh"
        path.write_text(body if body.startswith("#!") else "#!/bin/bash\nset -euo pipefail\n" + body)
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{name}: {syntax.stderr}"
        lint = subprocess.run(["shellcheck", "-S", "warning", "-s", "bash", str(path)], capture_output=True, text=True)
        assert lint.returncode == 0, f"{name}:\n{lint.stdout}"


def test_helper_units_pass_systemd_analyze(tmp_path):
    files = {f["path"].rsplit("/", 1)[-1]: f["content"] for s in m.exporter_steps(EXPORTER) for f in s["files"]}
    for name in (f"{m.HELPER_UNIT}.service", f"{m.HELPER_UNIT}.timer"):
        verify_unit(tmp_path, name, files[name])


def test_default_files_are_staged_before_apt_runs():
    """postinst starts the daemon at once: its ARGS must be in place before `apt-get install`."""
    apply = m.steps(make_args())[0]["apply"]
    installs = apply.index('\nledger_install "$record"')  # the call; apt-ledger.sh.j2 defines it above
    assert apply.index("install -m 0644 /etc/fimfleet/monitoring/default-prometheus /etc/default/prometheus") < installs
    assert "--force-confold" in apply
    assert installs < apply.index("promtool check config") < apply.index("reload_or_start prometheus")


def test_the_webhook_url_is_readable_by_root_and_alertmanager_only():
    """The URL often carries a token (a Pulumi secret): the upload is root's 0600, and the copy
    in force is 0640 root:prometheus, installed before apt's postinst starts the daemon; a stack
    that drops the webhook removes both copies."""
    url = "https://hooks.example.com/x?token=s3cret"
    step = m.steps(make_args(alertmanager_webhook_url=url))[0]
    holders = [(f["path"], f["mode"]) for f in step["files"] if "s3cret" in f["content"]]
    assert holders == [(m.ALERTMANAGER_STAGED, "0600")]
    apply = step["apply"]
    install = (f"install -m 0640 -o root -g prometheus {m.ALERTMANAGER_STAGED} "
               f"{m.CONFIG_DIR}/alertmanager.yml")
    assert apply.index("useradd --system") < apply.index(install) < apply.index('apt-get "${apt_opts[@]}" install')
    assert "640:root:prometheus" in step["check"]
    assert f"rm -f {m.ALERTMANAGER_STAGED}" in step["destroy"]
    assert f"rm -f {m.ALERTMANAGER_STAGED} {m.CONFIG_DIR}/alertmanager.yml" in m.steps(make_args())[0]["apply"]


@pytest.mark.parametrize("changed, active, want", [
    ("prometheus", "yes", "start prometheus"),      # restarted by this step: a SIGHUP now could end it
    ("", "no", "start prometheus"),
    ("prometheus-node-exporter", "yes", "reload prometheus"),
])
def test_only_a_daemon_running_before_the_step_is_reloaded(changed, active, want):
    """A SIGHUP that reaches Prometheus before its handler is set ends it, and systemd counts
    that as a clean exit (seen on the test VM: restart, reload 0.3 s later, unit inactive)."""
    apply = m.steps(make_args())[0]["apply"]
    helper = re.search(r"^reload_or_start\(\) \{.*?^\}$", apply, re.S | re.M).group(0)
    script = (f"changed=({changed})\nsystemctl() {{ [ \"$1 $2\" = 'is-active -q' ] && {{ [ {active} = yes ]; return; }}; "
              f"echo \"$*\"; }}\n{helper}\nreload_or_start prometheus\n")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout.strip()) == (0, want), r.stderr


# ------------------------------------------------------------------ textfile exports

def check_metrics(text: str) -> None:
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr + text


def parse(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"}


class Helper:
    """monitor-textfile.sh against a fake /run/fimfleet and THP directory."""

    def __init__(self, root: Path, monitors: str = "a=vllm-a.service", certificates: tuple[str, ...] = (),
                 start_stamps: str = ""):
        self.run_dir, self.out = root / "run", root / "textfile"
        self.state = self.run_dir / "monitor-vllm-a"
        self.state.mkdir(parents=True)
        (root / "thp").mkdir()
        (root / "thp" / "enabled").write_text("always [madvise] never\n")
        (root / "thp" / "defrag").write_text("always defer defer+madvise [madvise] never\n")
        self.env = root / "env"
        self.env.write_text(templates.render("prometheus/monitor-textfile.env.j2", textfile_dir=str(self.out),
                                             state_dir=str(root / "state"), run_dir=str(self.run_dir),
                                             monitors=monitors.split(), certificates=list(certificates),
                                             start_stamps=start_stamps.split())
                            + f"THP_DIR={root / 'thp'}\n")

    def write(self, **files):
        for name, value in files.items():
            path = self.state / name.replace("_", "-")
            if value is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(f"{value}\n")

    def __call__(self, env: dict | None = None) -> dict[str, float]:
        r = subprocess.run([shutil.which("bash"), str(templates.FILES / "prometheus/monitor-textfile.sh"), str(self.env)],
                           capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 0, r.stderr
        text = (self.out / "fimfleet_monitor.prom").read_text()
        check_metrics(text)
        return parse(text)


L = '{node="a",unit="vllm-a.service"}'


def test_helper_exports_the_monitors_state(tmp_path):
    h = Helper(tmp_path)
    h.write(last="1700000000 ok", failures=0)
    got = h()
    assert got[f"fimfleet_monitor_probe_ok{L}"] == 1 and got[f"fimfleet_monitor_probe_rejected{L}"] == 0
    assert got[f"fimfleet_monitor_last_probe_timestamp_seconds{L}"] == 1700000000
    assert got['fimfleet_thp_mode{setting="enabled",mode="madvise"}'] == 1
    assert got['fimfleet_thp_mode{setting="defrag",mode="madvise"}'] == 1
    h.write(last="1700000015 fail probe failed: curl exit 28", failures=2, stage=1)
    got = h()
    assert got[f"fimfleet_monitor_probe_ok{L}"] == 0
    assert got[f"fimfleet_monitor_consecutive_failures{L}"] == 2 and got[f"fimfleet_monitor_recovery_stage{L}"] == 1
    assert got[f"fimfleet_monitor_probe_busy{L}"] == 0
    h.write(last="1700000020 busy probe failed: curl exit 28")
    got = h()
    assert got[f"fimfleet_monitor_probe_ok{L}"] == 0 and got[f"fimfleet_monitor_probe_busy{L}"] == 1
    assert got[f"fimfleet_monitor_engine_starting{L}"] == 0
    h.write(last="1700000025 starting probe failed: curl exit 7")
    got = h()
    assert got[f"fimfleet_monitor_probe_ok{L}"] == 0 and got[f"fimfleet_monitor_engine_starting{L}"] == 1
    h.write(last="1700000030 config-error probe rejected with HTTP 401")
    got = h()
    assert got[f"fimfleet_monitor_probe_ok{L}"] == 0 and got[f"fimfleet_monitor_probe_rejected{L}"] == 1
    assert got[f"fimfleet_monitor_engine_starting{L}"] == 0


def test_an_engine_in_its_first_start_is_starting_until_the_monitor_judges_it(tmp_path):
    """Prometheus is set up beside the engine's first start; the monitor only once it serves."""
    stamp = tmp_path / "vllm-a.service.started"
    h = Helper(tmp_path, start_stamps=f"vllm-a.service={stamp}")
    assert h()[f"fimfleet_monitor_engine_starting{L}"] == 1, "no stamp yet: start.sh is starting it"
    stamp.write_text("digest\n")
    assert f"fimfleet_monitor_engine_starting{L}" not in h(), "it served once, and no verdict says starting"
    stamp.unlink()  # start.sh restarts it (a roll): the monitor's own verdict decides now
    h.write(last="1700000000 fail probe failed: curl exit 7")
    assert h()[f"fimfleet_monitor_engine_starting{L}"] == 0
    h.write(last="1700000015 starting probe failed: curl exit 7")
    assert h()[f"fimfleet_monitor_engine_starting{L}"] == 1


def test_helper_counts_each_restart_once_even_after_the_monitor_forgets_it(tmp_path):
    h = Helper(tmp_path)
    h.write(last="1700000000 fail x", restarted_at=1700000100)
    assert h()[f"fimfleet_monitor_restarts_total{L}"] == 1
    assert h()[f"fimfleet_monitor_restarts_total{L}"] == 1  # the same restart seen again
    h.write(last="1700000200 ok", restarted_at=None)  # recover.sh removes it once a probe passes
    got = h()
    assert got[f"fimfleet_monitor_restarts_total{L}"] == 1
    assert got[f"fimfleet_monitor_last_restart_timestamp_seconds{L}"] == 1700000100
    h.write(restarted_at=1700000500)
    assert h()[f"fimfleet_monitor_restarts_total{L}"] == 2


def test_helper_exports_when_each_certificate_expires(tmp_path):
    from datetime import datetime

    from components import tls

    issued = tls.issue("code.example.com", ["code.example.com"], [], days=20)
    cert = tmp_path / "server.pem"
    cert.write_text(issued["certPem"])
    garbled = tmp_path / "garbled.pem"
    garbled.write_text("-----BEGIN CERTIFICATE-----\nnot one\n")
    got = Helper(tmp_path, certificates=(f"a={cert}", f"b={garbled}", f"c={tmp_path / 'missing.pem'}"))()
    assert got[f'fimfleet_tls_certificate_not_after_seconds{{node="a",path="{cert}"}}'] == \
        int(datetime.fromisoformat(issued["notAfter"]).timestamp())
    assert [k for k in got if k.startswith("fimfleet_tls_")] == [f'fimfleet_tls_certificate_not_after_seconds{{node="a",path="{cert}"}}']


def test_a_round_forks_once_and_reads_a_certificate_again_only_when_it_changed(tmp_path):
    """Why the helper is written with bash builtins: it runs every 15 s for the node's whole life, and
    on a small VPS (or under emulation) each fork and each openssl start costs CPU the engine wants."""
    import os

    from components import tls

    forks = ForkLog(tmp_path, {"mv": None, "mkdir": None, "openssl": None, "date": None})
    cert = tmp_path / "server.pem"
    cert.write_text(tls.issue("a.example.com", ["a.example.com"], [], days=20)["certPem"])
    h = Helper(tmp_path, certificates=(f"a={cert}",))
    h.write(last="1700000000 ok", failures=0, restarted_at=1700000100)
    first = h(forks.env)
    assert forks.take() == ["mkdir", "openssl", "date", "mv"]
    assert h(forks.env) == first and forks.take() == ["mv"]
    reissued = tls.issue("a.example.com", ["a.example.com"], [], days=40)
    cert.write_text(reissued["certPem"])
    os.utime(cert, ns=(os.stat(cert).st_mtime_ns + 10**9,) * 2)  # however coarse the clock
    got = h(forks.env)
    assert forks.take() == ["openssl", "date", "mv"]
    key = f'fimfleet_tls_certificate_not_after_seconds{{node="a",path="{cert}"}}'
    assert got[key] > first[key] + 15 * 86400
    assert {k: v for k, v in got.items() if k != key} == {k: v for k, v in first.items() if k != key}


def test_helper_survives_a_missing_or_garbled_state(tmp_path):
    h = Helper(tmp_path, monitors="a=vllm-a.service b=vllm-b.service")
    h.write(failures="lots", last="garbage")
    got = h()
    assert got[f"fimfleet_monitor_consecutive_failures{L}"] == 0
    assert got[f"fimfleet_monitor_last_probe_timestamp_seconds{L}"] == 0
    # node b's monitor has never run: no verdict, and a zero timestamp that the stale alert catches
    b = '{node="b",unit="vllm-b.service"}'
    assert f"fimfleet_monitor_probe_ok{b}" not in got
    assert got[f"fimfleet_monitor_last_probe_timestamp_seconds{b}"] == 0


def test_sla_report_textfile():
    text = m.sla_textfile("a", REPORT)
    check_metrics(text)
    got = parse(text)
    assert got['fimfleet_sla_gate_ttft_seconds{node="a",percentile="99"}'] == pytest.approx(0.041)
    assert got['fimfleet_sla_gate_ttft_seconds{node="a",percentile="50"}'] == pytest.approx(0.0125)
    assert got['fimfleet_sla_gate_decode_tokens_per_second{node="a"}'] == 80.25
    assert got['fimfleet_sla_gate_passed{node="a"}'] == 1
    assert got['fimfleet_sla_gate_timestamp_seconds{node="a"}'] == 1772359200
    failed = parse(m.sla_textfile("a", {**REPORT, "violations": [{"metric": "ttft_p99_ms"}], "ttft_ms": {}}))
    assert failed['fimfleet_sla_gate_passed{node="a"}'] == 0
    assert str(failed['fimfleet_sla_gate_ttft_seconds{node="a",percentile="99"}']) == "nan"


# ------------------------------------------------------------------ resources

def test_tunnel_command():
    conn = {"host": "203.0.113.10", "port": 2222, "user": "admin"}
    assert m.tunnel_command(conn, "127.0.0.1:9090") == "ssh -N -L 9090:127.0.0.1:9090 -p 2222 admin@203.0.113.10"
    jump = m.tunnel_command({**conn, "bastionHost": "bastion.example", "bastionUser": "ops"}, "[::1]:9091")
    assert jump == "ssh -N -L 9091:::1:9091 -p 2222 -J ops@bastion.example:22 admin@203.0.113.10"


@pulumi.runtime.test
def test_component_tree_secrets_and_outputs(recorder):
    conn = pulumi.Output.secret({"host": "203.0.113.10", "port": 22, "user": "root", "privateKey": "KEY"})
    mon = m.Monitoring("mon", make_args(), conn, exporter=EXPORTER, sla_reports={"a": pulumi.Output.from_input(REPORT)})

    def check(values):
        tunnel = values[0]
        regs = {r["name"]: r for r in recorder.registrations}
        assert regs["mon"]["type"] == "fimfleet:monitoring:Monitoring"
        for name in ("mon-exporter", "mon-prometheus", "mon-sla-a"):
            assert regs[name]["parent"] == regs["mon"]["urn"], name
            assert "connection" in regs[name]["secret_fields"], name
        assert "files" in regs["mon-prometheus"]["secret_fields"]  # an Alertmanager webhook URL may hold a token
        # Prometheus and node_exporter are set up at once (packages.sh serializes their apt runs)
        assert regs["mon-exporter"]["urn"] not in regs["mon-prometheus"]["deps"]
        assert regs["mon-exporter"]["urn"] in regs["mon-sla-a"]["deps"]
        sla_file = regs["mon-sla-a"]["inputs"]["files"][0]
        assert sla_file["path"] == f"{m.TEXTFILE_DIR}/fimfleet_sla_a.prom" and "0.041" in sla_file["content"]
        assert tunnel == "ssh -N -L 9090:127.0.0.1:9090 -p 22 root@203.0.113.10"
        assert mon.url == "http://localhost:9090"

    return pulumi.Output.all(mon.tunnel_command, *[s.id for s in mon.steps]).apply(check)


def test_component_refuses_bad_args_before_any_resource(recorder):
    with pytest.raises(ConfigError, match="monitoring.listen"):
        m.Monitoring("bad", make_args(listen="0.0.0.0:9090"), {"host": "h"})
    assert not [r for r in recorder.registrations if r["name"].startswith("bad")]


def test_ttft_buckets_are_dense_and_hold_the_sla_limits():
    b = m.ttft_histogram_buckets([800, 250.5])
    assert b == sorted(set(b)) and all(x > 0 for x in b)
    assert 0.8 in b and 0.2505 in b
    assert b[0] <= 0.005 and b[-1] >= 60
    assert max(hi / lo for lo, hi in zip(b, b[1:])) <= m.TTFT_BUCKET_RATIO * 1.001
    assert len(b) <= 80  # one series each, per engine
    flag, value = m.vllm_histogram_args([800])
    assert flag == "--custom-histogram-buckets"
    assert json.loads(value) == {"time_to_first_token": m.ttft_histogram_buckets([800])}


@pulumi.runtime.test
def test_node_exporter_on_another_host(recorder):
    conn = pulumi.Output.secret({"host": "10.0.0.7", "port": 22, "user": "root", "privateKey": "KEY"})
    ne = m.NodeExporter("b-exporter", m.ExporterArgs("b", listen="10.0.0.7:9100", monitors=(("b", "vllm-b.service"),)), conn)

    def check(_):
        regs = {r["name"]: r for r in recorder.registrations}
        assert regs["b-exporter"]["type"] == "fimfleet:monitoring:NodeExporter"
        step = regs["b-exporter-exporter"]
        assert step["parent"] == regs["b-exporter"]["urn"]
        files = step["inputs"]["files"]
        files = files["value"] if isinstance(files, dict) else files  # a secret arrives wrapped
        default = next(f["content"] for f in files if f["path"].endswith("default-prometheus-node-exporter"))
        assert "--web.listen-address=10.0.0.7:9100" in default and "vllm-b[.]service" in default

    return pulumi.Output.all(*[s.id for s in ne.steps]).apply(check)


@pulumi.runtime.test
def test_ingress_ca_arrives_as_an_output(recorder):
    conn = pulumi.Output.secret({"host": "203.0.113.10", "port": 22, "user": "root", "privateKey": "KEY"})
    args = make_args(nodes=(m.ScrapeNode("a", "https://127.0.0.1:8443/metrics"),))
    mon = m.Monitoring("cam", args, conn, ca_pems={"a": pulumi.Output.secret("-----BEGIN CERTIFICATE-----\nX\n")})

    def check(_):
        step = {r["name"]: r for r in recorder.registrations}["cam-prometheus"]
        files = step["inputs"]["files"]
        files = {f["path"]: f["content"] for f in (files["value"] if isinstance(files, dict) else files)}
        assert files[f"{m.CONFIG_DIR}/ca/a.pem"] == "-----BEGIN CERTIFICATE-----\nX\n"
        assert f"ca_file: \"{m.CONFIG_DIR}/ca/a.pem\"" in files[f"{m.CONFIG_DIR}/prometheus.yml"]

    return pulumi.Output.all(*[s.id for s in mon.steps]).apply(check)


def test_a_ca_for_an_unknown_node_is_refused(recorder):
    with pytest.raises(ConfigError, match="zz.*is not a scraped node"):
        m.Monitoring("cab", make_args(), {"host": "h"}, ca_pems={"zz": "PEM"})
