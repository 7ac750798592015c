"""The policy pack run for real by the built CLI (through fimfleet's language host), and the
PR workflows that run it.

Each mandatory policy blocks a deliberately bad copy of a real stack, alone and with its own
message naming the config key to change. The good stacks pass in test_preview.py, which
previews every stack once with the pack. The SSH policy has no bad stack here: cloud
firewalls need provider plugins that cannot be fetched (tests/unit/test_policy_pack.py
runs it on the firewall inputs of pulumi-hcloud and pulumi-aws).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers import API_KEY, ssh_key
from tests.integration.test_preview import ROOT, TEST_PASSPHRASE, policy_results, pulumi, stack_copy

pytestmark = pytest.mark.integration

# Bad stack -> (base stack, config changes (None: remove the key), the one policy that must block
# it, text its message must hold).
BAD = {
    "plain-api-key": ("cpu-epyc-7b-int8", {"fimfleet:apiKeys": None, "fimfleet:apiKeys.carol": "c" * 32},
                      "credentials-are-secret",
                      "fimfleet:apiKeys is stored in plain text in the stack config: store it as a secret"),
    "self-signed-tls": ("cpu-epyc-7b-int8", {"fimfleet:ingress.allowSelfSigned": "false"},
                        "no-self-signed-tls-outside-local", "set fimfleet:ingress.tls to acme"),
    "loose-prod-sla": ("cpu-epyc-prod", {"fimfleet:sla.ttftP99Ms": "2400"}, "sla-gate-on-prod",
                       "fimfleet:sla.ttftP99Ms = 2400 is looser than the cpu-epyc-prod tier's 1200"),
    "no-prod-sla": ("cpu-epyc-prod", {"fimfleet:sla.enabled": "false"}, "sla-gate-on-prod",
                    "set fimfleet:sla.enabled to true"),
    "public-metrics": ("cpu-epyc-7b-int8", {"fimfleet:ingress.metricsAllowCidrs[0]": "0.0.0.0/1",
                                            "fimfleet:ingress.metricsAllowCidrs[1]": "128.0.0.0/1"},
                       "metrics-not-public", "opens /metrics to 0.0.0.0/0"),
}


def bad_preview(name: str, tmp_path: Path) -> tuple[int, str]:
    stack, changes, _, _ = BAD[name]
    work = tmp_path / name
    (work / "state").mkdir(parents=True)
    # Its own state (two run at once), and no vLLM argument check: that is the program's, not the pack's.
    env = {k: v for k, v in os.environ.items() if k != "FIMFLEET_VLLM_PYTHON"}
    env["FIMFLEET_BACKEND_URL"] = f"file://{work / 'state'}"
    cfg = stack_copy(stack, work, env=env)
    for key, value in changes.items():
        op = ("rm", key) if value is None else ("set", "--path", key, value)
        pulumi("config", *op, "--config-file", str(cfg), "-s", stack, env=env)
    proc = pulumi("preview", "-s", stack, "--config-file", str(cfg), "--non-interactive", "--policy-pack", "policy/",
                  check=False, env=env)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def bad_stacks(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """All bad previews, two at a time (each is a CLI, a program and a policy pack process)."""
    tmp = tmp_path_factory.mktemp("bad-stacks")
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(BAD, pool.map(lambda n: bad_preview(n, tmp), BAD)))


@pytest.mark.parametrize("name", list(BAD))
def test_each_mandatory_policy_blocks_its_bad_stack(name, bad_stacks):
    rc, out = bad_stacks[name]
    _, _, policy, message = BAD[name]
    assert rc != 0, out[-3000:]
    mandatory = {p for level, p in policy_results(out) if level == "mandatory"}
    assert mandatory == {policy}, out[-3000:]
    assert message in out, out[-3000:]


def test_actionlint_passes_the_workflows_and_catches_a_broken_one(tmp_path):
    """actionlint (built from its Go module by toolchain/build.sh) over .github/workflows; a wrong
    pulumi/actions input must fail it, so a pass means something."""
    actionlint = ROOT / ".toolchain" / "actionlint"
    assert actionlint.exists(), "actionlint is missing from the toolchain: run ./fimfleet bootstrap"
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert {w.name for w in workflows} >= {"preview.yml", "up.yml"}
    ok = subprocess.run([str(actionlint), "-no-color", "-oneline", *map(str, workflows)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    broken = tmp_path / ".github" / "workflows"
    broken.mkdir(parents=True)
    (broken / "preview.yml").write_text((ROOT / ".github/workflows/preview.yml").read_text()
                                        .replace("policyPacks:", "policy-packs:"))
    bad = subprocess.run([str(actionlint), "-no-color", "-oneline", str(broken / "preview.yml")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and 'input "policy-packs" is not defined' in bad.stdout


def test_workflows_preview_every_stack_with_the_pack_and_gate_prod():
    preview = yaml.safe_load((ROOT / ".github/workflows/preview.yml").read_text())
    step = next(s for s in preview["jobs"]["preview"]["steps"] if s.get("with", {}).get("command") == "preview")
    assert step["with"]["policyPacks"] == "policy/" and step["with"]["comment-on-pr"] is True
    assert step["with"]["diff"] is True
    up_stack = yaml.safe_load((ROOT / ".github/workflows/up-stack.yml").read_text())["jobs"]["up"]
    assert up_stack["environment"]["name"] == "${{ inputs.stack }}"
    up = yaml.safe_load((ROOT / ".github/workflows/up.yml").read_text())
    assert up[True]["push"]["branches"] == ["main"]  # PyYAML reads the `on:` key as True
    assert up["jobs"]["up-prod"]["needs"] == ["plan", "up"]
    # No secret value is written in a workflow: every one comes from secrets.* or vars.*.
    for wf in (ROOT / ".github").rglob("*.yml"):
        assert "PRIVATE KEY" not in wf.read_text()


def test_stack_secrets_script_sets_every_secret_as_secret(tmp_path):
    """.github/scripts/stack-secrets.sh with the built CLI, in a scratch copy of the project files."""
    shutil.copy(ROOT / "Pulumi.yaml", tmp_path)
    (tmp_path / "stacks").mkdir()
    text = (ROOT / "stacks" / "Pulumi.cpu-epyc-prod.yaml").read_text()
    (tmp_path / "stacks" / "Pulumi.cpu-epyc-prod.yaml").write_text(
        "".join(line for line in text.splitlines(True) if not line.startswith("encryptionsalt:")))
    env_out = subprocess.run([str(ROOT / "fimfleet"), "env"], capture_output=True, text=True, check=True).stdout
    env = dict(os.environ, **dict(line.split("=", 1) for line in env_out.splitlines()))
    env.update(PULUMI_BACKEND_URL=f"file://{tmp_path / 'state'}", PULUMI_CONFIG_PASSPHRASE=TEST_PASSPHRASE,
               FIMFLEET_SSH_PRIVATE_KEY=ssh_key(),
               FIMFLEET_API_KEYS=json.dumps({"alice": API_KEY, "bob": API_KEY[::-1]}))
    (tmp_path / "state").mkdir()
    script = ROOT / ".github" / "scripts" / "stack-secrets.sh"
    subprocess.run([str(script), "cpu-epyc-prod"], cwd=tmp_path, env=env, check=True, timeout=120)
    text = (tmp_path / "stacks" / "Pulumi.cpu-epyc-prod.yaml").read_text()
    assert API_KEY not in text and API_KEY[::-1] not in text and "PRIVATE KEY" not in text
    cfg = yaml.safe_load(text)["config"]
    assert set(cfg["fimfleet:apiKeys"]) == {"alice", "bob"}
    assert all(set(v) == {"secure"} for v in cfg["fimfleet:apiKeys"].values())
    assert set(cfg["fimfleet:sshPrivateKey"]) == {"secure"}
    shown = json.loads(subprocess.run(["pulumi", "config", "--json", "--show-secrets", "-s", "cpu-epyc-prod"],
                                      cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout)
    assert json.loads(shown["fimfleet:apiKeys"]["value"]) == {"alice": API_KEY, "bob": API_KEY[::-1]}
    assert shown["fimfleet:sshPrivateKey"]["value"].strip() == ssh_key().strip()

    missing = subprocess.run([str(script), "cpu-epyc-prod"], cwd=tmp_path, capture_output=True, text=True,
                             env={k: v for k, v in env.items() if k != "FIMFLEET_API_KEYS"}, timeout=60)
    assert missing.returncode == 1 and "FIMFLEET_API_KEYS" in missing.stderr
