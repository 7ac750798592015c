"""A real `pulumi preview --policy-pack policy/` of every stack in stacks/, with the built CLI, offline.

Stack files hold no secrets; each preview gets throwaway secrets in a temp copy of the
stack file (`--config-file`). Host addresses are from the documentation range and are
never contacted: preview runs no remote step. Each stack is previewed once, with the
policy pack (tests/integration/test_policy.py holds the stacks it must block). Cloud
stacks (host.provider hcloud/aws/...) need their provider plugins, which cannot be
fetched here: their mock tests are in tests/unit/test_cloud.py.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import API_KEY, TINY_CONFIG, fake_testbed, host_key, ssh_key, vm_state_keys

ROOT = Path(__file__).resolve().parents[2]


def _previewable(path: Path) -> bool:
    host = (yaml.safe_load(path.read_text()).get("config") or {}).get("fimfleet:host") or {}
    return host.get("provider", "ssh") in ("ssh", "local-vm")


STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml") if _previewable(p))
POLICY_RESULT = re.compile(r"\[(mandatory|advisory)\]\s+([a-z0-9-]+)")


def policy_results(out: str) -> list[tuple[str, str]]:
    """(enforcement level, policy name) of every policy violation in a preview's output."""
    return POLICY_RESULT.findall(out)

pytestmark = pytest.mark.integration


# Non-local stacks must not use the published local passphrase (./fimfleet refuses it for their
# secrets), so the temp stack copies get a fresh salt and this throwaway passphrase.
TEST_PASSPHRASE = "fimfleet-tests-throwaway-passphrase"


_STATE: list[str] = []


def _test_state() -> str:
    """One scratch state backend per test process: previews never touch the demo's .state/."""
    if not _STATE:
        _STATE.append(tempfile.mkdtemp(prefix="fimfleet-test-state-"))
        atexit.register(shutil.rmtree, _STATE[0], True)
    return f"file://{_STATE[0]}"


def pulumi(*args, check=True, **kw):
    env = dict(kw.get("env") or os.environ)
    env.setdefault("FIMFLEET_BACKEND_URL", _test_state())
    kw["env"] = {**env, "PULUMI_CONFIG_PASSPHRASE": TEST_PASSPHRASE}
    kw.setdefault("cwd", ROOT)
    proc = subprocess.run([str(ROOT / "fimfleet"), "pulumi", *args], capture_output=True, text=True, timeout=600, **kw)
    if check and proc.returncode:
        raise AssertionError(f"pulumi {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return proc


def stack_copy(stack: str, tmp_path: Path, extra: dict | None = None, env: dict | None = None) -> Path:
    """A temp copy of a stack file with throwaway secrets; `env` (e.g. its own FIMFLEET_BACKEND_URL) goes to every call."""
    # The stack is created from a scratch project dir, so its new passphrase salt lands in the copy,
    # never in stacks/ of the repository.
    project = tmp_path / "project"
    (project / "stacks").mkdir(parents=True)
    shutil.copy(ROOT / "Pulumi.yaml", project)
    cfg = project / "stacks" / f"Pulumi.{stack}.yaml"
    text = (ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text()
    cfg.write_text("".join(line for line in text.splitlines(True) if not line.startswith("encryptionsalt:")))
    pulumi("stack", "select", "--create", stack, env=env, cwd=project)
    key = tmp_path / "id"
    key.write_text(ssh_key())
    pulumi("config", "set", "--secret", "fimfleet:sshPrivateKey", "--config-file", str(cfg), "-s", stack,
           input=ssh_key(), env=env)
    for name, value in (("alice", API_KEY), ("bob", API_KEY[::-1])):
        pulumi("config", "set", "--secret", "--path", f"fimfleet:apiKeys.{name}", value, "--config-file", str(cfg), "-s", stack, env=env)
    for k, v in (extra or {}).items():
        pulumi("config", "set", "--path", k, v, "--config-file", str(cfg), "-s", stack, env=env)
    return cfg




@pytest.mark.parametrize("stack", STACKS)
def test_preview_every_stack(stack, tmp_path):
    extra = {}
    if stack.startswith("local"):
        doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
        for path, state in vm_state_keys(doc, str(tmp_path / "testbed")).items():
            extra[f"fimfleet:{path}"] = str(fake_testbed(Path(state)))
        model = tmp_path / "tiny-model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        extra["fimfleet:model.localPath"] = str(model)
    cfg = stack_copy(stack, tmp_path, extra)
    out = pulumi("preview", "-s", stack, "--config-file", str(cfg), "--non-interactive", "--diff",
                 "--policy-pack", "policy/").stdout
    # The pack ran (it names itself in the summary) and found nothing mandatory; *-prod stacks get advice.
    assert re.search(r"fimfleet\|local\|policy\s+0\.1\.0", out), out[-3000:]
    want = [("advisory", "prod-hardening")] if stack.endswith("-prod") else []
    assert sorted(set(policy_results(out))) == want
    for resource in ("node-host-preflight", "node-kernel-apply", "node-runtime-service", "node-ingress-nginx",
                     "node-monitor-timer", "node-sla"):
        assert resource in out, f"{resource} missing from the preview of {stack}"
    # Secrets set for the preview never show in its output.
    assert API_KEY not in out and "PRIVATE KEY" not in out


@pytest.mark.parametrize("own_machine", [False, True], ids=["beside-a-node", "own-machine"])
def test_preview_of_a_three_node_fleet_lists_the_gateway_the_nodes_and_the_rollout_gates(tmp_path, own_machine):
    """The README's growing-a-stack example, on the headline tier (documentation-range addresses),
    with the gateway beside the first node or on a machine of its own."""
    extra = {f"fimfleet:nodes.epyc{i}.address": f"203.0.113.{10 + i}" for i in (1, 2, 3)}
    if own_machine:
        extra.update({"fimfleet:gateway.host": "203.0.113.5", "fimfleet:gateway.hostKey": host_key()})
    else:
        extra.update({"fimfleet:gateway.host": "epyc1", "fimfleet:ingress.httpsPort": "8443",
                      "fimfleet:ingress.httpPort": "8080"})
    cfg = stack_copy("cpu-epyc-prod", tmp_path, extra)
    pulumi("config", "rm", "--path", "fimfleet:nodes.node", "--config-file", str(cfg), "-s", "cpu-epyc-prod")
    out = pulumi("preview", "-s", "cpu-epyc-prod", "--config-file", str(cfg), "--non-interactive",
                 "--policy-pack", "policy/").stdout
    for name in ("gateway-ingress-nginx", "fleet-probe-key", "fleet-sla",
                 *[f"epyc{i}-{part}" for i in (1, 2, 3) for part in ("drain", "enable", "runtime-service", "sla")]):
        assert re.search(rf"\b{name}\b", out), f"{name} missing from the fleet's preview:\n{out[-4000:]}"
    # its own machine is a host of its own: preflight, packages, kernel and nginx, no engine
    for name in ("gateway-host-preflight", "gateway-kernel-apply", "gateway-nginx"):
        assert bool(re.search(rf"\b{name}\b", out)) is own_machine, f"{name}:\n{out[-4000:]}"
    assert not re.search(r"\bgateway-runtime", out)
    assert "mandatory" not in out, out[-3000:]
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
