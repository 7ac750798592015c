"""Failures a user can read, through the real CLI: an expected failure shows fimfleet's message
and no Python traceback from the dynamic-provider host (components/errors.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import API_KEY, TINY_CONFIG, ssh_key, temp_project

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def cli(tmp_path, stack: str, passphrase: str = "test-own-passphrase", **env):
    """`./fimfleet pulumi ... -s stack` on a throwaway copy of the project with its own file backend."""
    project = temp_project(tmp_path)
    (tmp_path / "state").mkdir()
    env = {**os.environ, "FIMFLEET_BACKEND_URL": f"file://{tmp_path}/state", "PULUMI_CONFIG_PASSPHRASE": passphrase, **env}

    def pulumi(*args, **kw):
        cut = args.index("--") if "--" in args else len(args)  # a value that starts with "--" comes last
        return subprocess.run([str(ROOT / "fimfleet"), "pulumi", "--cwd", str(project), *args[:cut], "-s", stack,
                               *args[cut:]], env=env, capture_output=True, text=True, timeout=600, **kw)
    return pulumi


def test_unreachable_host_fails_up_with_one_readable_error(tmp_path):
    pulumi = cli(tmp_path, "cpu-epyc-prod")

    assert pulumi("stack", "init").returncode == 0
    for args, stdin in ((("config", "set", "--secret", "fimfleet:sshPrivateKey"), ssh_key()),
                        (("config", "set", "--secret", "--path", "fimfleet:apiKeys.alice", API_KEY), None),
                        (("config", "set", "--path", "fimfleet:nodes.node.address", "127.0.0.1"), None),
                        (("config", "set", "--path", "fimfleet:nodes.node.port", "1"), None)):
        r = pulumi(*args, input=stdin)
        assert r.returncode == 0, r.stderr
    up = pulumi("up", "--yes", "--skip-preview")
    out = up.stdout + up.stderr
    assert up.returncode != 0
    assert "fimfleet.Unreachable: cannot reach root@127.0.0.1:1 over SSH" in out, out[-3000:]
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]


def test_an_engine_flag_that_vllm_refuses_fails_preview_with_vllms_words(tmp_path, vllm_python):
    """The rendered arguments go through the pinned vLLM's own parser (components/validate.py)."""
    pulumi = cli(tmp_path, "cpu-epyc-prod", FIMFLEET_VLLM_PYTHON=vllm_python)

    assert pulumi("stack", "init").returncode == 0
    for args, stdin in ((("config", "set", "--secret", "fimfleet:sshPrivateKey"), ssh_key()),
                        (("config", "set", "--secret", "--path", "fimfleet:apiKeys.alice", API_KEY), None),
                        (("config", "set", "--path", "fimfleet:nodes.node.address", "203.0.113.10"), None),
                        (("config", "set", "--path", "fimfleet:engine.extraArgs[0]", "--", "--fimfleet-no-such-flag"), None)):
        r = pulumi(*args, input=stdin)
        assert r.returncode == 0, r.stderr
    preview = pulumi("preview")
    out = preview.stdout + preview.stderr
    assert preview.returncode != 0
    assert "fimfleet:engine = " in out and "--fimfleet-no-such-flag" in out, out[-3000:]
    assert "unrecognized arguments" in out and "Fix engine.extraArgs / engine.env" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_local_stack_whose_test_vm_is_gone_fails_preview_naming_the_key(tmp_path):
    """A testbedState without its VM (deleted, or never started) was a FileNotFoundError traceback
    from inside the program; it is one config error now, before any resource is registered."""
    pulumi = cli(tmp_path, "local", passphrase="fimfleet-local")  # the local stacks' published passphrase
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))

    assert pulumi("stack", "init").returncode == 0
    for args in (("config", "set", "--secret", "--path", "fimfleet:apiKeys.alice", API_KEY),
                 ("config", "set", "--path", "fimfleet:model.localPath", str(model)),
                 ("config", "set", "--path", "fimfleet:host.testbedState", str(tmp_path / "no-vm"))):
        r = pulumi(*args)
        assert r.returncode == 0, r.stderr
    preview = pulumi("preview")
    out = preview.stdout + preview.stderr
    assert preview.returncode != 0
    assert f'fimfleet:host.testbedState = "{tmp_path / "no-vm"}": no test VM there' in out, out[-3000:]
    assert "./fimfleet demo" in out and "Traceback" not in out and "FileNotFoundError" not in out, out[-3000:]
