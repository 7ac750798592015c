"""The SLA gate under the real Pulumi engine (the built CLI, a file backend, the fake vLLM).

1. A fresh stack: pass, no re-run when unchanged, re-run on a new trigger, fail with the
   report on a missed SLA, and the key stays encrypted in state.
2. A stack deployed before components/sla/ became a package (tests/data/sla_state_v1.json)
   refreshes, previews unchanged, updates and destroys with today's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration import fake_vllm

ROOT = Path(__file__).resolve().parents[2]
PULUMI = ROOT / ".toolchain" / "pulumi"
STATE_V1 = ROOT / "tests" / "data" / "sla_state_v1.json"

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "sk-fimfleet-it-abcdef012345"
MODEL = "fake-qwen"

PROGRAM = '''
import json, os
import pulumi
from components.sla.provider import FimSlaCheck
from components.sla.thresholds import SlaThresholds

chk = FimSlaCheck(
    os.environ["E2E_NAME"],
    endpoint=os.environ["E2E_URL"],
    api_key=os.environ["E2E_KEY"],
    model="fake-qwen",
    trigger=os.environ["E2E_TRIGGER"],
    thresholds=SlaThresholds(**json.loads(os.environ["E2E_THRESHOLDS"])),
    samples=3,
    warmup=1,
    **json.loads(os.environ.get("E2E_EXTRA", "{}")),
)
pulumi.export("passed", chk.passed)
pulumi.export("p99", chk.report.apply(lambda r: r["ttft_ms"]["p99"]))
'''


@pytest.fixture
def fake():
    cfg = fake_vllm.FakeConfig(api_keys=(KEY,), model=MODEL, ttft_s=0.01, inter_chunk_s=0.002)
    with fake_vllm.FakeVllm(cfg) as server:
        yield server


def _project(tmp_path, project: str, **env_extra):
    """A Pulumi project running PROGRAM; returns ``pulumi(*args, **env)``."""
    assert PULUMI.exists(), f"{PULUMI} is missing: run ./fimfleet bootstrap"
    prog = tmp_path / "prog"
    prog.mkdir()
    (prog / "Pulumi.yaml").write_text(f"name: {project}\nruntime:\n  name: python\n")
    (prog / "__main__.py").write_text(PROGRAM)
    (tmp_path / "state").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_")}
    env.update(
        PATH=f"{PULUMI.parent}:{env.get('PATH', '')}",
        PULUMI_HOME=str(tmp_path / "home"),
        PULUMI_BACKEND_URL=f"file://{tmp_path / 'state'}",
        PULUMI_SKIP_UPDATE_CHECK="true",
        PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION="true",
        PULUMI_PYTHON_CMD=sys.executable,
        PULUMI_CONFIG_PASSPHRASE="fimfleet-test",
        PYTHONPATH=str(ROOT),
        E2E_KEY=KEY,
        **env_extra,
    )

    def pulumi(*args, **extra_env):
        return subprocess.run([str(PULUMI), *args, "--non-interactive"], cwd=prog,
                              env=dict(env, **extra_env), capture_output=True, text=True, timeout=240)

    return pulumi


def test_pulumi_up_gate_end_to_end(fake, tmp_path):
    """`pulumi up` with the real engine: pass, no re-run when unchanged, re-run on a new
    trigger, fail with the report on a missed SLA, and the key stays encrypted in state."""
    pulumi = _project(tmp_path, "slae2e", E2E_NAME="sla", E2E_URL=fake.url, E2E_TRIGGER="t1",
                      E2E_THRESHOLDS='{"ttft_p99_ms": 5000}')
    assert pulumi("stack", "init", "dev").returncode == 0
    # (an empty stack config trips the Python SDK's config loader; give it one key)
    assert pulumi("config", "set", "unused", "x").returncode == 0

    up = pulumi("up", "--yes", "--skip-preview")
    assert up.returncode == 0, up.stdout + up.stderr
    assert len(fake.completion_requests()) == 4

    again = pulumi("up", "--yes", "--skip-preview")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 unchanged" in again.stdout
    assert len(fake.completion_requests()) == 4          # nothing changed: no probe

    new_trigger = pulumi("up", "--yes", "--skip-preview", E2E_TRIGGER="t2")
    assert new_trigger.returncode == 0, new_trigger.stdout + new_trigger.stderr
    assert len(fake.completion_requests()) == 8          # upstream changed: probe again

    missed = pulumi("up", "--yes", "--skip-preview", E2E_TRIGGER="t2",
                    E2E_THRESHOLDS='{"ttft_p99_ms": 1}')
    assert missed.returncode != 0
    out = missed.stdout + missed.stderr
    assert "SLA MISSED" in out and "ttft_p99_ms: measured" in out and "TTFT histogram:" in out
    assert "fimfleet.SlaViolationError: FIM latency SLA missed" in out and "Traceback" not in out, out[-3000:]

    state = pulumi("stack", "export")
    assert state.returncode == 0
    assert KEY not in state.stdout                       # key and its hash are ciphertext
    assert '"api_key_sha256"' in state.stdout


def _sla_resource(pulumi):
    state = pulumi("stack", "export", "--show-secrets")
    assert state.returncode == 0, state.stderr
    res = [r for r in json.loads(state.stdout)["deployment"].get("resources", []) if r["type"].endswith(":FimSlaCheck")]
    return res[0] if res else None


def _no_nulls(value):
    """``value`` without null dict entries: Read's round trip through the engine drops them."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def test_stack_deployed_before_the_package_refreshes_updates_and_destroys(fake, tmp_path):
    """The v1 state (made by components/sla.py at commit 74c5056 with the program node.py ran then)
    under today's code: refresh loads the provider pickled in it, an unchanged program
    changes nothing (the inputs it no longer sends do not count), a new trigger updates,
    and destroy deletes. Only the fake's address is rewritten, because its port is new."""
    text = STATE_V1.read_text()
    old_url = next(r["outputs"]["endpoint"] for r in json.loads(text)["deployment"]["resources"]
                   if r["type"].endswith(":FimSlaCheck"))
    (tmp_path / "v1.json").write_text(text.replace(old_url, fake.url))
    pulumi = _project(tmp_path, "slacompat", E2E_NAME="node-sla", E2E_URL=fake.url, E2E_TRIGGER="t1",
                      E2E_THRESHOLDS=json.dumps({"ttft_p50_ms": 2000.0, "ttft_p95_ms": 3000.0, "ttft_p99_ms": 5000.0,
                                                 "min_decode_tokens_per_s": 1.0, "max_errors": 0}),
                      E2E_EXTRA='{"concurrency": 1, "max_tokens": 8}')
    for args in (("stack", "init", "v1"), ("config", "set", "unused", "x"),
                 ("stack", "import", "--file", str(tmp_path / "v1.json"))):
        r = pulumi(*args)
        assert r.returncode == 0, r.stdout + r.stderr
    before = _sla_resource(pulumi)
    assert "probe_options" in before["outputs"]          # the old shape

    refresh = pulumi("refresh", "--yes", "--skip-preview")
    assert refresh.returncode == 0, refresh.stdout + refresh.stderr
    assert _no_nulls(_sla_resource(pulumi)["outputs"]) == _no_nulls(before["outputs"])

    same = pulumi("up", "--yes", "--skip-preview")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "2 unchanged" in same.stdout and "updated" not in same.stdout
    assert fake.completion_requests() == []              # no probe: nothing changed

    update = pulumi("up", "--yes", "--skip-preview", E2E_TRIGGER="t2")
    assert update.returncode == 0, update.stdout + update.stderr
    assert "1 updated" in update.stdout and "replace" not in update.stdout
    assert len(fake.completion_requests()) == 4
    after = _sla_resource(pulumi)["outputs"]
    assert after["passed"] is True and after["trigger"] == "t2" and "probe_options" not in after

    destroy = pulumi("destroy", "--yes", "--skip-preview")
    assert destroy.returncode == 0, destroy.stdout + destroy.stderr
    assert "2 deleted" in destroy.stdout and _sla_resource(pulumi) is None
