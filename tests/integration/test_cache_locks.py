"""Cache builders run safely side by side: two ./fimfleet commands at once (demo and test) used
to break the tiny-model build when one renamed the other's .tmp folder."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.conftest import MAKE_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def test_two_tiny_model_builds_at_once_both_succeed(tmp_path, vllm_python):
    out = tmp_path / "model"
    procs = [subprocess.Popen([vllm_python, str(MAKE_MODEL), "--out", str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    assert all(f"TINY_MODEL_DIR={out}" in r[0] for r in results)
    logs = "".join(r[1] for r in results)
    assert logs.count("[tinymodel] wrote") == 1 and "waiting" in logs and "cached" in logs, logs[-3000:]
    assert json.loads((out / "fimfleet-tiny.json").read_text())
    assert not (tmp_path / "model.tmp").exists()
