"""Run the Node scripts beside this file, which use Continue.dev's own npm packages."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def node(script: str, *args: str, timeout: float = 120) -> tuple[int, object]:
    """(exit code, the JSON the script printed). Fails, never skips, when node or the packages are missing."""
    exe = shutil.which("node")
    assert exe, "node is missing: run ./fimfleet bootstrap (it installs nodejs and npm from Debian)"
    assert (HERE / "node_modules" / "@continuedev" / "config-yaml").is_dir(), \
        "Continue's npm packages are missing in tests/js/node_modules: run ./fimfleet bootstrap"
    r = subprocess.run([exe, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout, cwd=HERE)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("{", "["))]
    assert lines, f"{script} printed no JSON (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.returncode, json.loads(lines[-1])
