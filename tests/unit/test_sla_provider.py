"""FimSlaCheckProvider called directly (Pulumi mocks never run dynamic providers).

check/diff are pure; create/update run the probe against the fake OpenAI-compatible
server from tests/integration/fake_vllm.py on 127.0.0.1. One test builds the
resource under Pulumi mocks in a subprocess, so its global mock settings cannot
leak into other test modules.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import dill
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pulumi.dynamic import CheckResult, CreateResult, DiffResult, ReadResult, UpdateResult  # noqa: E402
from pulumi.dynamic.dynamic import serialize_provider  # noqa: E402
from pulumi.runtime import rpc  # noqa: E402

from components.sla.provider import FimSlaCheckProvider, _key_hash, changed_inputs  # noqa: E402
from components.sla.report import SlaViolationError  # noqa: E402


def _load_fake_vllm():
    name = "fimfleet_tests_fake_vllm"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "integration" / "fake_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fake_vllm = _load_fake_vllm()
KEY = "sk-fimfleet-test-0123456789"


@pytest.fixture(scope="module")
def fake():
    cfg = fake_vllm.FakeConfig(api_keys=(KEY,), ttft_s=0.005, inter_chunk_s=0.001)
    with fake_vllm.FakeVllm(cfg) as server:
        yield server


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.config.mode = "ok"
    fake.config.ttft_s = 0.005
    yield


def _props(fake, **over):
    props = {
        "endpoint": fake.url,
        "api_key": KEY,
        "model": "fake-qwen",
        "trigger": "sha256:aaaa",
        "thresholds": {"ttft_p99_ms": 5000.0, "max_errors": 0.0},
        "samples": 4.0,          # Pulumi sends every number as a float
        "warmup": 1.0,
    }
    props.update(over)
    return props


# ---------------------------------------------------------------- check


def test_check_normalizes_numbers_and_defaults(fake):
    res = FimSlaCheckProvider().check({}, _props(fake, thresholds={"ttft_p99_ms": 500, "max_errors": 0.0},
                                                 max_tokens=8.0))
    assert isinstance(res, CheckResult) and res.failures == []
    ins = res.inputs
    assert ins["samples"] == 4 and isinstance(ins["samples"], int)
    assert ins["warmup"] == 1 and ins["concurrency"] == 1   # default filled in
    assert ins["max_tokens"] == 8 and isinstance(ins["max_tokens"], int)
    assert ins["thresholds"] == {"ttft_p99_ms": 500.0, "max_errors": 0}
    assert isinstance(ins["thresholds"]["max_errors"], int)
    assert ins["api_key"] == KEY                        # the engine keeps it secret (secret input)


def test_check_reports_readable_failures(fake):
    res = FimSlaCheckProvider().check({}, {
        "endpoint": "ftp://x", "model": "", "thresholds": {"ttft_p99": 1}, "samples": 2,
        "warmup": -1, "concurrency": "two", "colour": "red", "ca_pem": "-----BEGIN CERTIFICATE-----",
    })
    by_prop = {f.property: f.reason for f in res.failures}
    assert set(by_prop) == {"endpoint", "model", "trigger", "api_key", "thresholds", "warmup",
                            "concurrency", "colour"}
    assert "unknown SLA threshold key" in by_prop["thresholds"]
    assert by_prop["colour"].startswith("unknown input")
    assert by_prop["warmup"] == "warmup must be >= 0, got -1"
    for limit in ({"min_decode_tokens_per_s": 5}, {"min_decode_ceiling_fraction": 0.7}):
        res = FimSlaCheckProvider().check({}, _props(fake, thresholds=limit, max_tokens=1))
        assert [f.property for f in res.failures] == ["max_tokens"], limit
    res = FimSlaCheckProvider().check({}, _props(fake, thresholds={"ttft_p50_ms": 900, "ttft_p99_ms": 100}))
    assert [f.property for f in res.failures] == ["thresholds"]
    assert "must not decrease" in res.failures[0].reason


def test_check_accepts_unknown_preview_values(fake):
    res = FimSlaCheckProvider().check({}, _props(fake, trigger=rpc.UNKNOWN, endpoint=rpc.UNKNOWN))
    assert res.failures == []
    assert res.inputs["trigger"] == rpc.UNKNOWN


# ---------------------------------------------------------------- diff


def _outs_like_create(fake, **over):
    """What create() stores as outputs, without running the probe."""
    norm = FimSlaCheckProvider().check({}, _props(fake, **over)).inputs
    outs = {k: v for k, v in norm.items() if k != "api_key"}
    outs.update(api_key_sha256=_key_hash(norm["api_key"]), report={"ok": 4}, summary="...",
                passed=True, __provider="serialized")
    return outs


def test_diff_unchanged_stack_does_not_rerun(fake):
    p = FimSlaCheckProvider()
    olds = _outs_like_create(fake)
    res = p.diff("id", olds, _props(fake))
    assert isinstance(res, DiffResult) and res.changes is False
    assert res.replaces == [] and not res.delete_before_replace
    # ints instead of floats, explicit defaults, other report/summary: still no change
    news = _props(fake, samples=4, warmup=1, concurrency=1, max_tokens=16)
    assert p.diff("id", dict(olds, report={"ok": 0}, summary="other"), news).changes is False


@pytest.mark.parametrize("key,value", [
    ("trigger", "sha256:bbbb"),
    ("endpoint", "https://127.0.0.1:1"),
    ("model", "other-model"),
    ("thresholds", {"ttft_p99_ms": 100.0, "max_errors": 0}),
    ("samples", 50),
    ("warmup", 3),
    ("concurrency", 2),
    ("max_tokens", 32),
    ("ca_pem", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"),
    ("api_key", "sk-rotated-key-9876543210"),
])
def test_diff_reruns_on_each_probe_input(fake, key, value):
    olds = _outs_like_create(fake)
    news = _props(fake, **{key: value})
    assert FimSlaCheckProvider().diff("id", olds, news).changes is True
    assert changed_inputs(olds, news) == [key]


def test_diff_unknown_values_count_as_changed(fake):
    olds = _outs_like_create(fake)
    assert changed_inputs(olds, _props(fake, trigger=rpc.UNKNOWN)) == ["trigger"]
    assert changed_inputs(olds, _props(fake, api_key=rpc.UNKNOWN)) == ["api_key"]


# ---------------------------------------------------------------- create / update / read / delete


def test_create_runs_probe_and_outputs_report_without_key(fake):
    before = len(fake.completion_requests())
    p = FimSlaCheckProvider()
    props = p.check({}, _props(fake)).inputs
    res = p.create(props)
    assert isinstance(res, CreateResult) and res.id.startswith("fimsla-")
    outs = res.outs
    assert len(fake.completion_requests()) - before == 5       # 1 warmup + 4 samples
    assert outs["passed"] is True
    assert outs["report"]["ok"] == 4 and outs["report"]["errors"] == 0
    assert outs["report"]["violations"] == []
    assert outs["report"]["thresholds"] == {"ttft_p99_ms": 5000.0, "max_errors": 0}
    assert "TTFT histogram:" in outs["summary"] and "SLA PASSED" in outs["summary"]
    # the key is not an output; only a hash is (marked secret by FimSlaCheck)
    assert "api_key" not in outs
    assert KEY not in json.dumps(outs)
    assert outs["api_key_sha256"] == _key_hash(KEY) and len(outs["api_key_sha256"]) == 64
    # outputs serialize exactly as the dynamic provider server does it
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(rpc.serialize_properties(dict(outs, __provider="x"), {}))
    finally:
        loop.close()
    # a second `pulumi up` with nothing changed: diff says no changes -> no new probe
    assert p.diff(res.id, outs, _props(fake)).changes is False


def test_create_fails_with_readable_report_on_missed_sla(fake):
    props = _props(fake, thresholds={"ttft_p99_ms": 1.0, "ttft_p50_ms": 0.5})
    fake.config.ttft_s = 0.02
    with pytest.raises(SlaViolationError) as info:
        FimSlaCheckProvider().create(props)
    msg = str(info.value)
    assert "FIM latency SLA missed" in msg
    assert "ttft_p99_ms: measured" in msg and "limit <= 1.0" in msg
    assert "ttft_p50_ms: measured" in msg and "limit <= 0.5" in msg
    assert "Worst requests (by TTFT):" in msg and "TTFT histogram:" in msg
    assert KEY not in msg
    assert info.value.report["ok"] == 4


def test_create_fails_on_erroring_engine(fake):
    fake.config.mode = "error"
    with pytest.raises(SlaViolationError, match=r"(?s)Errors \(4\).*HTTP 500"):
        FimSlaCheckProvider().create(_props(fake))


def test_create_rejects_invalid_inputs(fake):
    with pytest.raises(ValueError, match="trigger"):
        FimSlaCheckProvider().create(_props(fake, trigger=""))


def test_update_reruns_probe(fake):
    p = FimSlaCheckProvider()
    olds = _outs_like_create(fake)
    news = _props(fake, trigger="sha256:cccc")
    before = len(fake.completion_requests())
    res = p.update("fimsla-x", olds, news)
    assert isinstance(res, UpdateResult)
    assert len(fake.completion_requests()) - before == 5
    assert res.outs["trigger"] == "sha256:cccc" and res.outs["passed"] is True
    assert p.diff("fimsla-x", res.outs, news).changes is False


def test_read_and_delete_send_no_traffic(fake):
    p = FimSlaCheckProvider()
    before = len(fake.completion_requests())
    outs = _outs_like_create(fake)
    res = p.read("fimsla-x", outs)
    assert isinstance(res, ReadResult) and res.id == "fimsla-x" and res.outs == outs
    assert p.delete("fimsla-x", outs) is None
    assert len(fake.completion_requests()) == before


# ---------------------------------------------------------------- pickling


def test_provider_pickles_with_dill_like_pulumi():
    p = FimSlaCheckProvider()
    assert dill.loads(dill.dumps(p)).diff("i", {}, {"trigger": "t"}).changes is True
    s1 = serialize_provider(p)                      # exactly what pulumi stores in __provider
    assert s1 == serialize_provider(FimSlaCheckProvider())   # deterministic: no spurious diffs
    # the dynamic-provider host (python -m pulumi.dynamic, cwd = project dir) can load it
    code = textwrap.dedent(f"""
        import base64, dill
        p = dill.loads(base64.b64decode({s1!r}))
        print(type(p).__module__, type(p).__name__, p.diff("i", {{}}, {{"trigger": "t"}}).changes)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["components.sla", "FimSlaCheckProvider", "True"]
    assert len(base64.b64decode(s1)) < 2000     # a reference, not a captured client


def test_resource_under_pulumi_mocks_registers_secret_key(tmp_path):
    code = textwrap.dedent("""
        import json, pulumi
        from pulumi.runtime import mocks, rpc

        seen = {}
        orig = mocks.MockMonitor.RegisterResource

        def spy(self, request):
            if "FimSlaCheck" in request.type:
                seen["type"] = request.type
                seen["secret_outputs"] = sorted(request.additionalSecretOutputs)
                ins = rpc.deserialize_properties(request.object, keep_unknowns=True)
                raw = request.object.fields["api_key"].struct_value.fields
                seen["api_key_sig"] = raw[rpc._special_sig_key].string_value if rpc._special_sig_key in raw else None
                seen["input_keys"] = sorted(k for k in ins if not k.startswith("__"))
            return orig(self, request)

        mocks.MockMonitor.RegisterResource = spy

        class M(pulumi.runtime.Mocks):
            def new_resource(self, args):
                return "fimsla-mock", dict(args.inputs, passed=True)
            def call(self, args):
                return {}

        pulumi.runtime.set_mocks(M(), preview=False)
        from components.sla.provider import FimSlaCheck
        from components.sla.thresholds import SlaThresholds

        @pulumi.runtime.test
        def run():
            r = FimSlaCheck("sla", endpoint="https://127.0.0.1:8443", api_key="sk-abc-123456",
                            model="m", trigger="t1", thresholds=SlaThresholds(ttft_p99_ms=100),
                            ca_pem="-----BEGIN CERTIFICATE-----")
            return r.passed.apply(lambda p: print(json.dumps(dict(seen, passed=p))))

        run()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["type"] == "pulumi-python:dynamic/fimfleet:FimSlaCheck"
    assert seen["secret_outputs"] == ["api_key", "api_key_sha256"]
    assert seen["api_key_sig"] == rpc._special_secret_sig
    assert {"endpoint", "api_key", "model", "trigger", "thresholds", "ca_pem"} <= set(seen["input_keys"])
    assert seen["passed"] is True


# ---------------------------------------------------------------- state written before components/sla/

STATE_V1 = ROOT / "tests" / "data" / "sla_state_v1.json"
"""`pulumi stack export --show-secrets` of a stack that components/sla.py (commit 74c5056, before
the package) deployed: one FimSlaCheck built as node.py built it, against the fake vLLM, key KEY_V1.
tests/integration/test_sla_fake_upstream.py imports it and runs refresh, up and destroy on it."""
KEY_V1 = "sk-fimfleet-it-abcdef012345"


def _unwrap(value):
    """Plaintext of an exported secret (``{<sig>: <secret sig>, "plaintext": <json>}``)."""
    if isinstance(value, dict):
        if value.get(rpc._special_sig_key) == rpc._special_secret_sig:
            return json.loads(value["plaintext"])
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def state_v1_check():
    """The FimSlaCheck of the v1 state: (inputs, outputs), secrets unwrapped."""
    res = [r for r in json.loads(STATE_V1.read_text())["deployment"]["resources"]
           if r["type"] == "pulumi-python:dynamic/fimfleet:FimSlaCheck"]
    assert len(res) == 1
    return _unwrap(res[0]["inputs"]), _unwrap(res[0]["outputs"])


def test_v1_state_provider_loads_and_accepts_its_outputs():
    """Refresh and destroy load the provider pickled in the old state; diff gets the old outputs."""
    ins, outs = state_v1_check()
    blob = outs["__provider"]
    assert ins["__provider"] == blob and "probe_options" in outs       # really the old shape
    # What node.py registers now, through check() as the engine does.
    news = {"endpoint": outs["endpoint"], "api_key": KEY_V1, "model": "fake-qwen", "trigger": "t1",
            "thresholds": {"ttft_p50_ms": 2000.0, "ttft_p95_ms": 3000.0, "ttft_p99_ms": 5000.0,
                           "min_decode_tokens_per_s": 1.0, "max_errors": 0.0},
            "samples": 3.0, "warmup": 1.0, "concurrency": 1.0, "max_tokens": 8.0}
    code = textwrap.dedent("""
        import base64, json, sys, dill
        blob, ins, outs, news = json.load(sys.stdin)
        p = dill.loads(base64.b64decode(blob))          # what pulumi.dynamic's get_provider does
        checked = p.check(ins, news)
        news = checked.inputs
        print(json.dumps({
            "type": f"{type(p).__module__}.{type(p).__name__}",
            "check_failures": [f.reason for f in checked.failures],
            "diff_same": p.diff("id", outs, news).changes,
            "diff_trigger": p.diff("id", outs, dict(news, trigger="t2")).changes,
            "read_same": p.read("fimsla-v1", outs).outs == outs,
            "delete": p.delete("fimsla-v1", outs),
        }))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         input=json.dumps([blob, ins, outs, news]))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"type": "components.sla.FimSlaCheckProvider", "check_failures": [],
                                      "diff_same": False, "diff_trigger": True, "read_same": True,
                                      "delete": None}
    # The provider is still pickled by the same name, so states written now equal the old ones.
    assert serialize_provider(FimSlaCheckProvider()) == blob


def test_v1_state_update_probes_and_drops_the_old_inputs(fake):
    _, outs = state_v1_check()
    p = FimSlaCheckProvider()
    news = p.check({}, _props(fake, trigger="t2")).inputs
    before = len(fake.completion_requests())
    res = p.update("fimsla-v1", outs, news)
    assert len(fake.completion_requests()) - before == 5
    assert res.outs["passed"] is True and res.outs["api_key_sha256"] == _key_hash(KEY)
    assert "probe_options" not in res.outs and "insecure_skip_verify" not in res.outs
    assert p.diff("fimsla-v1", res.outs, news).changes is False


def test_a_computed_trigger_passes_check_during_preview():
    """The trigger hashes the host identity, unknown until the host is contacted: preview must accept it."""
    import pulumi

    from components.sla import provider as sla_provider

    unknown = pulumi.Output(resources=set(), future=None, is_known=None)
    assert sla_provider._is_unknown(unknown)
    assert sla_provider._is_unknown(sla_provider._PULUMI_UNKNOWN)
    assert sla_provider._is_unknown(pulumi.output.Unknown())  # what a dynamic provider's check receives
    props = {"endpoint": "https://h", "model": "m", "trigger": pulumi.output.Unknown(), "api_key": "k" * 32,
             "thresholds": {"ttft_p50_ms": 1, "ttft_p95_ms": 2, "ttft_p99_ms": 3, "min_decode_tokens_per_s": 1,
                            "max_errors": 0}}
    assert sla_provider.FimSlaCheckProvider().check({}, props).failures == []
    assert not sla_provider._is_unknown("abc")


def test_the_measured_bandwidth_puts_the_decode_ceiling_in_the_report(fake):
    """bandwidth / bytes read per token = the ceiling; the report shows measured tok/s against it."""
    p = FimSlaCheckProvider()
    ceiling = {"bandwidth_bytes_per_s": 20e9, "active_weight_bytes_per_token": 2e9}
    props = p.check({}, _props(fake, max_tokens=4.0, ceiling=ceiling)).inputs
    outs = p.create(props).outs
    dc = outs["report"]["decode_ceiling"]
    assert dc["ceiling_tokens_per_s"] == pytest.approx(10.0)
    assert dc["efficiency_pct"] == pytest.approx(100 * dc["measured_tokens_per_s"] / 10.0, rel=0.01)
    assert "decode ceiling" in outs["summary"] and "20 GB/s / 2 GB per token" in outs["summary"]
    # the ceiling only annotates: a new figure alone does not measure again
    moved = {**ceiling, "bandwidth_bytes_per_s": 21e9}
    assert p.diff("x", outs, _props(fake, max_tokens=4.0, ceiling=moved)).changes is False


@pytest.mark.parametrize("bad", [{"bandwidth_bytes_per_s": -1, "active_weight_bytes_per_token": 2e9},
                                 {"bandwidth_bytes_per_s": 1e9}, {"bandwidth_bytes_per_s": "fast",
                                                                  "active_weight_bytes_per_token": 1},
                                 "fast", 12.5])
def test_a_malformed_ceiling_is_a_readable_check_failure(fake, bad):
    failures = FimSlaCheckProvider().check({}, _props(fake, ceiling=bad)).failures
    assert [f.property for f in failures] == ["ceiling"], failures


def test_without_a_measurement_the_report_has_no_ceiling_line(fake):
    p = FimSlaCheckProvider()
    outs = p.create(p.check({}, _props(fake, ceiling=None)).inputs).outs
    assert outs["report"]["decode_ceiling"]["ceiling_tokens_per_s"] is None
    assert "decode ceiling" not in outs["summary"]
