"""A real `pulumi preview` of every stack in stacks/, with the built CLI, offline.

Stack files hold no secrets; each preview gets throwaway secrets in a temp copy of the
stack file (`--config-file`). Host addresses are from the documentation range and are
never contacted: preview runs no remote step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import API_KEY, TINY_CONFIG, ssh_key

ROOT = Path(__file__).resolve().parents[2]
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))

pytestmark = pytest.mark.integration


def pulumi(*args, check=True, **kw):
    proc = subprocess.run([str(ROOT / "fimfleet"), "pulumi", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, **kw)
    if check and proc.returncode:
        raise AssertionError(f"pulumi {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return proc


def stack_copy(stack: str, tmp_path: Path, extra: dict | None = None) -> Path:
    cfg = tmp_path / f"Pulumi.{stack}.yaml"
    shutil.copy(ROOT / "stacks" / f"Pulumi.{stack}.yaml", cfg)
    pulumi("stack", "select", "--create", stack)
    key = tmp_path / "id"
    key.write_text(ssh_key())
    pulumi("config", "set", "--secret", "fimfleet:sshPrivateKey", "--config-file", str(cfg), "-s", stack,
           input=ssh_key())
    for name, value in (("alice", API_KEY), ("bob", API_KEY[::-1])):
        pulumi("config", "set", "--secret", "--path", f"fimfleet:apiKeys.{name}", value, "--config-file", str(cfg), "-s", stack)
    for k, v in (extra or {}).items():
        pulumi("config", "set", "--path", k, v, "--config-file", str(cfg), "-s", stack)
    return cfg


def fake_testbed(tmp_path: Path) -> Path:
    """An info.json like toolchain/testbed/vm.py writes, for previewing the local stack without a VM."""
    state = tmp_path / "testbed"
    state.mkdir()
    (state / "id_ed25519").write_text(ssh_key())
    (state / "info.json").write_text(json.dumps({"ssh": {"host": "127.0.0.1", "port": 1, "user": "root",
                                                         "key": str(state / "id_ed25519")},
                                                 "ports": {"22": 1, "443": 2}}))
    return state


@pytest.mark.parametrize("stack", STACKS)
def test_preview_every_stack(stack, tmp_path):
    extra = {}
    if stack == "local":
        extra["fimfleet:host.testbedState"] = str(fake_testbed(tmp_path))
        model = tmp_path / "tiny-model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        extra["fimfleet:model.localPath"] = str(model)
    cfg = stack_copy(stack, tmp_path, extra)
    out = pulumi("preview", "-s", stack, "--config-file", str(cfg), "--non-interactive", "--diff").stdout
    for resource in ("node-host-preflight", "node-kernel-apply", "node-runtime-service", "node-ingress-nginx",
                     "node-monitor-timer", "node-sla"):
        assert resource in out, f"{resource} missing from the preview of {stack}"
    # Secrets set for the preview never show in its output.
    assert API_KEY not in out and "PRIVATE KEY" not in out


def test_preview_rejects_bad_config_before_any_resource(tmp_path):
    cfg = stack_copy("cpu-epyc-prod", tmp_path, {"fimfleet:engine.kvCacheGiB": "200", "fimfleet:monitor.intervalS": "1"})
    proc = pulumi("preview", "-s", "cpu-epyc-prod", "--config-file", str(cfg), "--non-interactive", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "fimfleet:monitor.intervalS = 1" in out
    assert "does not fit" in out and "fimfleet:host.memoryGiB" in out
    assert "node-host-preflight" not in out


def test_toolchain_reports_real_versions():
    """The version ldflags reached both binaries: the CLI and the bundled Python language host."""
    pins = dict(line.split("=", 1) for line in (ROOT / "toolchain" / "pins.env").read_text().splitlines()
                if line and not line.startswith("#"))
    want = pins["PULUMI_GO_VERSION"]
    assert pulumi("version").stdout.strip() == want
    about = json.loads(pulumi("about", "--json", "-s", "cpu-epyc-prod").stdout)
    plugins = {(p["kind"], p["name"]): p["version"] for p in about["plugins"]}
    assert plugins[("language", "python")] == want.lstrip("v")
    assert about["runtime"]["executable"].endswith("/.venv/bin/python")
