"""files/host's systemd helpers, run by bash against a recording `systemctl` on PATH:
- enable-unit.sh.j2: an enabled unit is left alone, and a disabled one is enabled without Debian's
  SysV helper (update-rc.d took 10-16 s per unit on the test VM; systemd reads only the native
  unit's links);
- reload-units.sh.j2: a daemon-reload (2-4 s emulated) only when a unit's file changed, and every
  step that uploads a unit file names it there."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from components import config, kernel, monitor, monitoring, templates
from tests.helpers import raw_config
from tests.unit.test_monitoring_rules import make_args

FAKE = """#!/bin/bash
echo "SKIP=${SYSTEMCTL_SKIP_SYSV:-} $*" >> "$CALLS"
[ "$1" != show ] || printf '%b' "$SHOW"
[ "$1" != is-enabled ] || [ -e "$ENABLED" ]
"""


def run_helper(tmp_path: Path, script: str, **env) -> list[str]:
    """`script` under the deploy's shell options, against FAKE; the systemctl calls it made."""
    (tmp_path / "systemctl").write_text(FAKE)
    (tmp_path / "systemctl").chmod(0o755)
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"), **env})
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize("enabled", [True, False])
def test_enable_unit_enables_only_a_disabled_unit_and_skips_the_sysv_helper(tmp_path: Path, enabled: bool):
    if enabled:
        (tmp_path / "enabled").touch()
    calls = run_helper(tmp_path, templates.render("host/enable-unit.sh.j2") + "\nenable_unit prometheus\n",
                       ENABLED=str(tmp_path / "enabled"))
    want = ["SKIP= is-enabled -q prometheus"] + ([] if enabled else ["SKIP=1 enable -q prometheus"])
    assert calls == want


@pytest.mark.parametrize("show, reloads", [("no\\nno\\n", False), ("no\\nyes\\n", True), ("yes\\n", True), ("", False)])
def test_reload_units_reloads_only_when_systemd_says_a_unit_file_changed(tmp_path: Path, show: str, reloads: bool):
    calls = run_helper(tmp_path, templates.render("host/reload-units.sh.j2") + "\nreload_units a.timer b.service\n",
                       SHOW=show)
    assert calls == ["SKIP= show -p NeedDaemonReload --value a.timer b.service"] + (["SKIP= daemon-reload"] if reloads else [])


def _steps_with_unit_files() -> dict[str, tuple[list[dict], str]]:
    """name -> (files, apply) of every step that uploads a unit file and then starts or enables it."""
    cfg = config.parse(*raw_config("cpu-epyc-prod"))
    kr = kernel.render(kernel.args_for(cfg))
    margs = monitor.args_for(cfg, "node")
    steps = {"kernel": (kr.installed, kr.apply),
             "monitor": (monitor.render_files(margs, "vllm-node.service", "k" * 32, "CA"),
                         monitor.scripts(margs, "vllm-node.service")["apply"])}
    for s in monitoring.steps(make_args()) + monitoring.exporter_steps(monitoring.ExporterArgs("a", monitors=(("a", "vllm-a.service"),))):
        steps[s["name"]] = (s["files"], s["apply"])
    return steps


@pytest.mark.parametrize("name", ["kernel", "monitor", "prometheus", "exporter"])
def test_each_step_reloads_systemd_for_the_unit_files_it_uploads_and_only_through_the_check(name: str):
    files, apply = _steps_with_unit_files()[name]
    uploaded = {f["path"].split("/")[4].removesuffix(".d") for f in files if f["path"].startswith("/etc/systemd/system/")}
    calls = [line.split()[1:] for line in apply.splitlines() if line.startswith("reload_units ")]
    assert len(calls) == 1, apply
    assert uploaded <= set(calls[0]), (uploaded, calls)
    assert not [line for line in apply.splitlines() if line.strip().startswith("systemctl daemon-reload")], apply
