"""files/runtime/bandwidth.py, run as the runtime's bandwidth step runs it: with the engine's
own interpreter (the pinned vLLM venv, whose numpy it uses), one process per CPU."""

import json
import os
import subprocess

from components import runtime, templates


def test_the_bandwidth_probe_measures_this_machine(vllm_python):
    proc = subprocess.run([vllm_python, str(templates.FILES / "runtime/bandwidth.py")], capture_output=True,
                          text=True, timeout=300, env={"TRIAD_SECONDS": "0.5", "TRIAD_MIB": "16", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["processes"] == len(os.sched_getaffinity(0))
    # a few hundred MB/s at the very least, even on an emulated or loaded CPU
    assert runtime.reported(proc.stdout, "bandwidth_bytes_per_s") == out["bandwidth_bytes_per_s"] > 2e8
