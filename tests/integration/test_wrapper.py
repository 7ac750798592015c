"""The ./fimfleet wrapper: it refuses a real stack's secrets under the published local passphrase, and
never writes into a .venv directory that the official CLI created."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import temp_project

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
GUARD = "which is public"


def fimfleet_pulumi(tmp_path, *args, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_CONFIG_PASSPHRASE")}
    base.update(FIMFLEET_BACKEND_URL=f"file://{tmp_path}", **env)
    project = tmp_path / "project" if (tmp_path / "project").exists() else temp_project(tmp_path)
    return subprocess.run([str(ROOT / "fimfleet"), "pulumi", "--cwd", str(project), *args], cwd=ROOT, env=base,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ("config", "set", "--secret", "fimfleet:hfToken", "x", "-s", "cpu-epyc-prod", "--config-file", "{cfg}"),
    ("up", "--yes", "--stack=organization/fimfleet/gpu-h100"),
])
def test_default_passphrase_is_refused_for_a_real_stack(tmp_path, args):
    args = [a.replace("{cfg}", str(tmp_path / "c.yaml")) for a in args]
    proc = fimfleet_pulumi(tmp_path, *args)
    assert proc.returncode == 1 and GUARD in proc.stderr and "PULUMI_CONFIG_PASSPHRASE" in proc.stderr
    assert "change-secrets-provider" in proc.stderr


def test_own_passphrase_or_a_local_stack_passes_the_guard(tmp_path):
    cfg = str(tmp_path / "c.yaml")
    own = fimfleet_pulumi(tmp_path, "stack", "init", "cpu-epyc-prod", PULUMI_CONFIG_PASSPHRASE="my own long passphrase")
    assert own.returncode == 0, own.stderr
    own = fimfleet_pulumi(tmp_path, "config", "set", "--secret", "fimfleet:hfToken", "x", "-s", "cpu-epyc-prod",
                          "--config-file", cfg, PULUMI_CONFIG_PASSPHRASE="my own long passphrase")
    assert own.returncode == 0, own.stderr
    assert "secure:" in Path(cfg).read_text()
    local = fimfleet_pulumi(tmp_path, "config", "set", "--secret", "fimfleet:hfToken", "x", "-s", "local",
                            "--config-file", cfg)
    assert GUARD not in local.stderr


def test_a_real_venv_directory_is_named_not_overwritten(tmp_path):
    # The official CLI's Python host creates .venv as a directory; bootstrap must not put a link inside it.
    import shutil

    shutil.copy(ROOT / "fimfleet", tmp_path / "fimfleet")
    shutil.copy(ROOT / "requirements.txt", tmp_path / "requirements.txt")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    proc = subprocess.run([str(tmp_path / "fimfleet"), "bootstrap"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and ".venv is a directory" in proc.stderr and "mv " in proc.stderr, proc.stderr
    assert list((tmp_path / ".venv").iterdir()) == [tmp_path / ".venv" / "bin"]


def test_a_fresh_machine_downloads_vllm_while_the_toolchain_builds(tmp_path):
    """`./fimfleet test` starts the vLLM install before the Go build, and both run at once: the
    stand-in toolchain build below finishes only once the stand-in vLLM install has started."""
    import shutil

    for rel in ("fimfleet", "requirements.txt", "tests/js/package.json", "tests/js/package-lock.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    stubs = {
        "toolchain/vllm/install.sh": """
            [ "${1:-}" != path ] || exit 1  # not installed yet
            touch "$MARKS/vllm-started"; sleep 1; touch "$MARKS/vllm-done"; echo VLLM_VENV=/nowhere""",
        "toolchain/build.sh": """
            for _ in $(seq 100); do [ -e "$MARKS/vllm-started" ] && break; sleep 0.1; done
            [ -e "$MARKS/vllm-started" ] && touch "$MARKS/overlapped"; echo "$MARKS/bin\"""",
        "scripts/test.sh": """
            for _ in $(seq 100); do [ -e "$MARKS/vllm-done" ] && break; sleep 0.1; done; echo tests ran""",
    }
    for rel, body in stubs.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("#!/usr/bin/env bash\nset -eu\n" + body + "\n")
        (tmp_path / rel).chmod(0o755)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.run([str(tmp_path / "fimfleet"), "test"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MARKS": str(marks)})
    assert proc.returncode == 0 and "tests ran" in proc.stdout, proc.stderr[-3000:]
    assert "vLLM in the background" in proc.stderr
    assert (marks / "overlapped").exists(), "the toolchain build ran before the vLLM install started"
    assert os.readlink(tmp_path / ".toolchain") == str(marks / "bin")
