"""Real Prometheus (Debian's binary) scraping real vLLM behind real nginx, plus a real
node_exporter reading fimfleet's textfiles, all rendered by components/monitoring.py.

Prometheus starts after a warm-up, so its histograms hold only the measured burst, which the
SLA probe (components.sla's provider, through the ingress with a key and the CA) sends. The
recorded TTFT quantiles must reproduce the engine's own histogram of those requests, and p99
must stay inside the bucket of the probe's slowest request. vLLM's TTFT starts when the engine
receives a request, so the probe's is larger by the path in front of it (API server, nginx, TLS,
client); on this shared 2-core host that path is 10-55% of the probe's tail, so the recorded p99
is printed beside the probe's rather than held to it from below. Print the figures with ``pytest -s``.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from components import monitoring as m
from components import templates
from components.sla import FimSlaCheckProvider
from tests.helpers import free_port
from tests.integration.conftest import API_KEY, SERVED
from tests.integration.nginx_harness import Nginx, make_tls, stop_process, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

KEY = "sk-fimfleet-prometheus-probe-key-0123456789"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or "/usr/bin/prometheus-node-exporter"
for _binary in (PROMETHEUS, NODE_EXPORTER):
    assert Path(_binary).exists(), f"{_binary} is missing: ./fimfleet bootstrap installs Debian's prometheus packages"

BURST = dict(samples=40, concurrency=4, max_tokens=8)
"""The measured burst: enough requests for a stable p99, concurrent so TTFT is mostly engine time."""
HISTORY_S = 12
"""Seconds of scrapes before the burst. rate() extrapolates a series that starts inside its window
by half a scrape interval, but no further back than the counter's zero point, so a bucket that was
empty when Prometheus started is not extrapolated at all. Over a short history that skews the
buckets against each other: with 40 requests, 4% moved p99 a whole bucket above the slowest
request (131.8 ms recorded against 80.4 ms). With this much history and prior requests in the
tail buckets, every bucket the quantiles use is extrapolated alike, and quantiles are scale-free."""


class Stack:
    """nginx in front of the session's vLLM, node_exporter and Prometheus, on free loopback ports."""

    def __init__(self, root: Path, vllm_port: int):
        self.root, self.procs = root, []
        self.tls = make_tls(root)
        self.nginx = Nginx(root / "nginx", self.tls, vllm_port, api_keys={"probe": KEY}, upstream_api_key=API_KEY,
                           rate_per_second=200, burst=200).start()
        self.endpoint = self.nginx.url("").rstrip("/")
        self.textfiles = root / "textfile"
        self.textfiles.mkdir()
        exporter_port, prom_port = free_port(), free_port()
        self.exporter = m.ExporterArgs("host", listen=f"127.0.0.1:{exporter_port}", monitors=(("node", "vllm-node.service"),),
                                       textfile_dir=str(self.textfiles), run_dir=str(root / "run"), state_dir=str(root / "state"))
        self.args = m.MonitoringArgs(
            nodes=(m.ScrapeNode("node", self.nginx.url("/metrics"), ca_pem=self.tls.ca.read_text()),),
            exporters=(m.ExporterTarget("host", self.exporter.listen),), ttft_p50_ms=2000, ttft_p95_ms=4000,
            ttft_p99_ms=5000, min_decode_tokens_per_s=1, decode_ceiling_tokens_per_s=500, max_steal_percent=10,
            listen=f"127.0.0.1:{prom_port}", scrape_interval_s=1, evaluation_interval_s=1, config_dir=str(root / "prom"))
        m.check(self.args, self.exporter)
        self.api = f"http://{self.args.listen}/api/v1"

    def start_exporters(self) -> None:
        """The deep-probe helper over a fake monitor state, then node_exporter with fimfleet's args."""
        state = self.root / "run" / "monitor-vllm-node"
        state.mkdir(parents=True)
        (state / "last").write_text(f"{int(time.time())} ok\n")
        (state / "failures").write_text("0\n")
        env = self.root / "textfile.env"
        env.write_text(templates.render("prometheus/monitor-textfile.env.j2", textfile_dir=str(self.textfiles),
                                        state_dir=self.exporter.state_dir, run_dir=self.exporter.run_dir,
                                        monitors=["node=vllm-node.service"]))
        subprocess.run(["bash", str(templates.FILES / "prometheus/monitor-textfile.sh"), str(env)], check=True, timeout=30)
        self._spawn("node_exporter", [NODE_EXPORTER, *m.node_exporter_args(self.exporter)])

    def start_prometheus(self) -> None:
        for rel, content in m.prometheus_files(self.args).items():
            path = Path(self.args.config_dir) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        self._spawn("prometheus", [PROMETHEUS, *m.prometheus_args(self.args), f"--storage.tsdb.path={self.root / 'data'}"])
        wait_for(lambda: self._ready(), 60, "Prometheus to be ready", interval=0.2)
        self.started = time.monotonic()

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://{self.args.listen}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")
        self.procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))

    def logs(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": time} if time is not None else {})
        r = httpx.get(f"{self.api}/query", params=params, timeout=10).json()
        assert r["status"] == "success", r
        return r["data"]["result"]

    def value(self, expr: str, time: float | None = None) -> float | None:
        result = self.query(expr, time)
        return float(result[0]["value"][1]) if result else None

    def probe(self, **over) -> dict:
        props = {"endpoint": self.endpoint, "api_key": KEY, "ca_pem": self.tls.ca.read_text(), "model": SERVED,
                 "trigger": "prometheus", "thresholds": {"ttft_p99_ms": 5000}, "warmup": 0, **BURST, **over}
        return FimSlaCheckProvider().create(props).outs["report"]

    def stop(self) -> None:
        for proc, log in reversed(self.procs):
            stop_process(proc, signal.SIGTERM)
            log.close()
        self.nginx.stop()


@pytest.fixture(scope="module")
def stack(vllm_server, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("prometheus"), int(vllm_server["base"].rsplit(":", 1)[1]))
    try:
        # Warm up BEFORE Prometheus exists, so its histograms hold only the measured burst, and
        # with the burst's own shape, so every bucket in the burst's tail already holds earlier
        # requests (see HISTORY_S).
        s.probe(samples=16, concurrency=BURST["concurrency"])
        s.start_exporters()
        s.start_prometheus()
        wait_for(lambda: s.value('count(up == 1)') == 3, 30, "every target to be up", interval=0.5)
        yield s
    finally:
        s.stop()


def test_every_target_is_up_over_verified_tls(stack):
    targets = httpx.get(f"{stack.api}/targets", timeout=10).json()["data"]["activeTargets"]
    by_job = {t["labels"]["job"]: t for t in targets}
    assert {j: t["health"] for j, t in by_job.items()} == {"vllm": "up", "node": "up", "prometheus": "up"}, \
        [t.get("lastError") for t in targets]
    assert by_job["vllm"]["scrapeUrl"] == stack.nginx.url("/metrics")
    assert by_job["vllm"]["labels"]["node"] == "node"


def test_rules_use_only_metric_names_the_pinned_vllm_exports(stack):
    live = httpx.get(stack.nginx.url("/metrics"), verify=stack.tls.context(), timeout=10).text
    families = set(re.findall(r"^# TYPE (vllm:\S+) ", live, re.M))
    samples = set(re.findall(r"^(vllm:[a-zA-Z0-9_:]+)[{ ]", live, re.M))
    files = m.prometheus_files(stack.args)
    used = set(re.findall(r"vllm:[a-zA-Z0-9_:]+", files["rules/fimfleet-recording.yml"]))
    assert len(used) >= 9, used
    missing = sorted(used - samples)
    assert not missing, f"rules name vLLM series this vLLM does not export: {missing}; it has {sorted(families)}"


def ttft_buckets(text: str) -> dict[float, float]:
    """Cumulative TTFT bucket counts by upper bound, summed over series, from a /metrics page."""
    out: dict[float, float] = {}
    for le, value in re.findall(r'^vllm:time_to_first_token_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[float(le)] = out.get(float(le), 0.0) + float(value)
    return out


def quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's histogram_quantile: linear inside the bucket that holds rank q * count."""
    bounds = sorted(buckets)
    rank, prev_le, prev_c = q * buckets[bounds[-1]], 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            return prev_le if le == float("inf") else prev_le + (le - prev_le) * (rank - prev_c) / (buckets[le] - prev_c)
        prev_le, prev_c = le, buckets[le]
    raise AssertionError("empty histogram")


def test_recorded_ttft_p99_follows_the_sla_probe(stack):
    scrape = lambda: ttft_buckets(httpx.get(stack.nginx.url("/metrics"), verify=stack.tls.context(), timeout=10).text)  # noqa: E731
    time.sleep(max(0.0, HISTORY_S - (time.monotonic() - stack.started)))
    before = scrape()
    report = stack.probe()
    after = scrape()
    assert report["ok"] == BURST["samples"] and report["errors"] == 0
    burst = {le: after[le] - before.get(le, 0.0) for le in after}
    assert burst[float("inf")] == BURST["samples"], "other traffic reached the engine during the burst"
    # every request scraped, then evaluated by the rules at least once more
    wait_for(lambda: stack.value('sum(increase(vllm:time_to_first_token_seconds_count{job="vllm"}[5m]))') or 0
             >= BURST["samples"] * 0.95, 30, "Prometheus to scrape the burst", interval=0.5)
    time.sleep(2.5)
    recorded = {q: stack.value(f'fimfleet:ttft_seconds:p{q}{{node="node"}}') for q, _ in m.QUANTILES}
    probe = {q: report["ttft_ms"][f"p{q}"] / 1000 for q, _ in m.QUANTILES}
    engine_p99 = quantile(0.99, burst)
    ratio = recorded["99"] / probe["99"]
    print(f"\nTTFT over {BURST['samples']} requests (concurrency {BURST['concurrency']}): "
          + ", ".join(f"p{q} recorded {recorded[q] * 1000:.1f} ms / probe {probe[q] * 1000:.1f} ms" for q in recorded)
          + f"; engine histogram p99 {engine_p99 * 1000:.1f} ms; recorded/probe p99 = {ratio:.2f}")
    # The rule is histogram_quantile over the engine's bucket rates, by node, in the rule's window:
    # recompute it from Prometheus's own rates at the instant the rule was evaluated.
    at = stack.value('timestamp(fimfleet:ttft_seconds:p99{node="node"})')
    rates = {float(r["metric"]["le"]): float(r["value"][1]) for r in stack.query(
        f'sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{job="vllm"}}[{stack.args.rate_window}]))', time=at)}
    top, monotonic = 0.0, {}
    for le in sorted(rates):  # as histogram_quantile does: separately extrapolated buckets can dip
        top = monotonic[le] = max(top, rates[le])
    # The rule's own samples at that instant: it may have been evaluated again since `recorded`.
    evaluated = {q: stack.value(f'fimfleet:ttft_seconds:p{q}{{node="node"}}', time=at) for q, _ in m.QUANTILES}
    for q, value in m.QUANTILES:
        assert evaluated[q] == pytest.approx(quantile(value, monotonic), rel=1e-6), (q, evaluated, rates)
    # ... which follows the engine's own histogram of these requests, within one request's rank
    # (rate() extrapolates each bucket series on its own; HISTORY_S keeps that alike in the tail)
    one = 1 / BURST["samples"]
    for q, value in m.QUANTILES:
        lo, hi = quantile(max(0.0, value - one), burst), quantile(min(1.0, value + one), burst)
        assert lo * 0.9 <= recorded[q] <= hi * 1.1, f"p{q}: recorded {recorded[q]}, engine {lo}..{hi}, rates {rates}"
    # ... which starts when the engine receives a request, so no request is slower there than the
    # probe measured it through nginx: the recorded p99 stays inside the bucket that holds the
    # probe's slowest request (a histogram resolves no finer than its buckets, and interpolates)
    edge = min(le for le in burst if le >= report["ttft_ms"]["max"] / 1000)
    assert recorded["99"] <= edge, (recorded, probe, report["ttft_ms"]["max"], edge)
    # the SLA gate's report, written as a textfile, reaches Prometheus through node_exporter
    (stack.textfiles / "fimfleet_sla_node.prom").write_text(m.sla_textfile("node", report))
    wait_for(lambda: stack.value('fimfleet:sla_gate_ttft_seconds:last{node="node",percentile="99"}') is not None,
             20, "the SLA report textfile to be recorded", interval=0.5)
    assert stack.value('fimfleet:sla_gate_ttft_seconds:last{node="node",percentile="99"}') == pytest.approx(probe["99"])
    assert stack.value('fimfleet:sla_gate_passed:last{node="node"}') == 1


def test_every_dashboard_series_is_recorded_after_traffic(stack):
    """What the dashboard draws exists against real vLLM, real node_exporter and the textfiles."""
    import json

    wanted = {n for p in json.loads(m.dashboard_json())["panels"] for t in p["targets"]
              for n in re.findall(r"fimfleet:[a-z0-9_:]+", t["expr"])}
    if stack.value("count(fimfleet:sla_gate_passed:last)") is None:  # when run alone
        (stack.textfiles / "fimfleet_sla_node.prom").write_text(m.sla_textfile("node", stack.probe(samples=8)))
    missing = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        missing = sorted(n for n in wanted if not stack.query(n))
        if not missing:
            break
        time.sleep(1)
    assert not missing, f"recorded series without data: {missing}\n{stack.logs('node_exporter')}"
    assert 0 <= stack.value('fimfleet:cpu_steal:percent{host="host"}') <= 100
    assert 0 < stack.value('fimfleet:memory_available:ratio{host="host"}') <= 1
    assert stack.value('fimfleet:deep_probe_ok:min{node="node"}') == 1
    assert 0 <= stack.value('fimfleet:kv_cache_usage:ratio{node="node"}') <= 1
    assert stack.value('fimfleet:decode_tokens_per_second:per_request{node="node"}') > 1
