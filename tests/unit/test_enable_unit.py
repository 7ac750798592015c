"""files/host/enable-unit.sh.j2, run by bash against a recording `systemctl` on PATH: an enabled
unit is left alone, and a disabled one is enabled without Debian's SysV helper (update-rc.d took
10-16 s per unit on the test VM; systemd reads only the native unit's links)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from components import templates

FAKE = """#!/bin/bash
echo "SKIP=${SYSTEMCTL_SKIP_SYSV:-} $*" >> "$CALLS"
[ "$1" != is-enabled ] || [ -e "$ENABLED" ]
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_enable_unit_enables_only_a_disabled_unit_and_skips_the_sysv_helper(tmp_path: Path, enabled: bool):
    (tmp_path / "systemctl").write_text(FAKE)
    (tmp_path / "systemctl").chmod(0o755)
    if enabled:
        (tmp_path / "enabled").touch()
    script = templates.render("host/enable-unit.sh.j2") + "\nenable_unit prometheus\n"
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"),
                               "ENABLED": str(tmp_path / "enabled")})
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    want = ["SKIP= is-enabled -q prometheus"] + ([] if enabled else ["SKIP=1 enable -q prometheus"])
    assert calls == want
