"""Monitor settings per tier, and the env file that root bash sources every round.

The restart timing itself is measured against real vLLM in
tests/integration/test_monitor_recovery.py; this checks the arithmetic and the quoting.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from components import config, monitor, tiers
from tests.helpers import TINY_CONFIG, ForkLog, raw_config

STACKS = Path(__file__).resolve().parents[2] / "stacks"


def stack_monitor(stack: str) -> dict:
    """The fimfleet:monitor section a stack file sets (most set none)."""
    return (yaml.safe_load((STACKS / f"Pulumi.{stack}.yaml").read_text())["config"] or {}).get("fimfleet:monitor") or {}


def settings_for(tier: str, model: dict | None = None, **monitor_cfg) -> monitor.Settings:
    sections = {"monitor": monitor_cfg} if monitor_cfg else {}
    raw, secret = raw_config(tier, **sections, **({"model": model} if model else {}))
    return monitor.settings(config.parse(raw, secret))


@pytest.mark.parametrize("tier", sorted(n for n in tiers.TIERS if n != "local-vm"))
def test_every_tier_detects_a_hang_within_the_budget(tier):
    s = settings_for(tier)
    assert s.detection_bound_s <= monitor.DETECT_BUDGET_S, s
    # the probe waits at least twice the SLA's TTFT p99 unless the budget caps it
    p99_s = tiers.TIERS[tier].sla["ttftP99Ms"] / 1000
    assert s.probe_timeout_s >= min(2 * p99_s, monitor.DETECT_BUDGET_S / s.failure_threshold - s.interval_s - 2)


def test_local_stack_detects_a_hang_within_the_budget(tmp_path):
    """The local stack file's own monitor settings (if any) on the local-vm tier."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    s = settings_for("local-vm", model={"source": "local", "localPath": str(tmp_path)}, **stack_monitor("local"))
    assert s.detection_bound_s <= monitor.DETECT_BUDGET_S, s


def test_the_test_vms_tier_probes_less_often_and_a_stack_value_wins(tmp_path):
    """local-vm's own monitor default (components/tiers.py) over MonitorConfig's 5 s; every
    other tier keeps 5 s; a stack's monitor.intervalS overrides the tier."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    model = {"source": "local", "localPath": str(tmp_path)}
    assert settings_for("local-vm", model=model).interval_s == tiers.TIERS["local-vm"].monitor["intervalS"] == 15
    assert settings_for("local-vm", model=model, intervalS=7).interval_s == 7
    assert {settings_for(t).interval_s for t in tiers.TIERS if t != "local-vm"} == {5}


def test_explicit_probe_timeout_wins_and_the_bound_says_so():
    s = settings_for("cpu-epyc-prod", probeTimeoutS=60, intervalS=30)
    assert s.probe_timeout_s == 60
    assert s.detection_bound_s == 2 * (30 + 60 + 2)  # the settings that took 277 s before


def test_env_file_is_data_when_sourced(tmp_path):
    """A hostile served model name (it comes from config) stays a value in root's shell."""
    raw, secret = raw_config("cpu-epyc-prod")
    cfg = config.parse(raw, secret)
    hostile = "m$(touch pwned1)`touch pwned2`'; touch pwned3; '\"x\nTOUCH=1"
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, served_name=hostile))
    env = next(f["content"] for f in monitor.render_files(monitor.args_for(cfg, "node"), "vllm-node.service", "k" * 32, "CA")
               if f["path"].endswith(".env"))
    (tmp_path / "monitor.env").write_text(env)
    out = subprocess.run(["bash", "-c", 'set -eu; source ./monitor.env; printf "%s" "$PROBE_BODY"'], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["model"] == hostile
    assert not list(tmp_path.glob("pwned*"))


FAKE_SYSTEMCTL = """#!/bin/bash
case "$1" in
  show) date -u -d "@$ENTERED" '+%a %Y-%m-%d %H:%M:%S UTC' ;;
  is-active) exit 0 ;;
  *) exit 0 ;;
esac
"""


def grace_round(tmp_path: Path, ok_at: int, entered: int, kept: dict | None = None) -> tuple[str, str]:
    """One recover.sh round whose probe fails and whose /metrics does not answer, with the last
    passed probe at ok_at and the engine's unit entered active at entered (epoch seconds)."""
    root = Path(__file__).resolve().parents[2] / "files" / "monitor"
    (tmp_path / "recover.sh").write_text((root / "recover.sh").read_text())
    (tmp_path / "fim-probe.sh").write_text("#!/bin/bash\necho 'probe failed: HTTP 502' >&2\nexit 1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    for name in ("logger", "curl"):
        (bin_dir / name).write_text("#!/bin/bash\nexit 7\n")
    for f in [*bin_dir.iterdir(), tmp_path / "recover.sh", tmp_path / "fim-probe.sh"]:
        f.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    (state / "ok-at").write_text(f"{ok_at}\n")
    (state / "progress-at").write_text(f"{ok_at}\n")
    for name, text in (kept or {}).items():  # what a round killed while writing left
        (state / name).write_text(text)
    (tmp_path / "monitor.env").write_text(
        f"ENGINE_UNIT=vllm-node.service\nSTATE_DIR={state}\nFAILURE_THRESHOLD=2\nGRACE_S=600\nSTALL_S=30\n"
        "RESTART_TIMEOUT_S=5\nMETRICS_URL=http://127.0.0.1:9/metrics\nMETRICS_TIMEOUT_S=1\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ENTERED": str(entered)}
    out = subprocess.run(["bash", str(tmp_path / "recover.sh"), str(tmp_path / "monitor.env")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    return out.stdout, (state / "failures").read_text().strip() if (state / "failures").exists() else "0"


@pytest.mark.parametrize("entered_after_ok_s", [0, 40])
def test_a_start_after_the_last_passed_probe_is_in_its_grace(tmp_path, entered_after_ok_s):
    """A deploy's restart in the very second of the last passed probe (the timestamps have whole
    seconds) or later is a start: its failed probes are not counted toward a restart."""
    ok_at = int(time.time()) - 60
    out, failures = grace_round(tmp_path, ok_at, ok_at + entered_after_ok_s)
    assert "start grace" in out and failures == "0", out


def test_a_counter_a_killed_round_left_empty_or_cut_reads_as_zero(tmp_path):
    """ok-at and restarted-at were read with cat: an empty file made `[ -ge "" ]` fail, so a
    starting engine lost its grace and was restarted once too early."""
    ok_at = int(time.time()) - 60
    out, failures = grace_round(tmp_path, ok_at, ok_at + 40, kept={"ok-at": "", "restarted-at": "17x"})
    assert "start grace" in out and failures == "0", out


def test_a_failure_of_an_engine_that_served_since_its_start_counts(tmp_path):
    ok_at = int(time.time()) - 60
    out, failures = grace_round(tmp_path, ok_at, ok_at - 3600)
    assert "start grace" not in out and "probe failed (1/2)" in out and failures == "1", out


FAKE_CURL = """for a in "$@"; do [[ $a == */metrics ]] && { printf 'vllm:prompt_tokens_total{e="0"} 5\\nvllm:generation_tokens_total{e="0"} 7\\n'; exit 0; }; done
printf '%s\\n' "$*" >> @ARGV@
while IFS= read -r line; do printf '%s\\n' "$line" >> @STDIN@; done
printf '{"choices": [{"text": "x"}]}\\n200'
"""


def test_a_healthy_round_forks_only_for_the_probe_and_metrics_and_keeps_the_key_out_of_argv(tmp_path):
    """Why recover.sh and fim-probe.sh read state with builtins: a round runs every few seconds for
    the engine's whole life. The probe key reaches curl on stdin: argv is readable by every local user."""
    raw, secret = raw_config("cpu-epyc-prod")
    cfg = config.parse(raw, secret)
    env = next(f["content"] for f in monitor.render_files(monitor.args_for(cfg, "node"), "vllm-node.service", "k" * 32, "CA")
               if f["path"].endswith(".env"))
    root = Path(__file__).resolve().parents[2] / "files" / "monitor"
    for name in ("recover.sh", "fim-probe.sh"):
        (tmp_path / name).write_text((root / name).read_text())
        (tmp_path / name).chmod(0o755)
    state, key = tmp_path / "state", "probe-key-" + "z" * 22
    state.mkdir()
    (tmp_path / "probe.key").write_text(key + "\n")
    (tmp_path / "monitor.env").write_text(env + f"STATE_DIR={state}\nPROBE_KEY_FILE={tmp_path / 'probe.key'}\n")
    argv, stdin = tmp_path / "curl.argv", tmp_path / "curl.stdin"
    forks = ForkLog(tmp_path, {"curl": FAKE_CURL.replace("@ARGV@", str(argv)).replace("@STDIN@", str(stdin)), "awk": None})
    for _ in range(2):
        before = time.time()
        r = subprocess.run(["/bin/bash", str(tmp_path / "recover.sh"), str(tmp_path / "monitor.env")], env=forks.env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout == "", r
        assert sorted(forks.take()) == ["awk", "curl", "curl"]  # the /metrics pipe starts both at once
        at, verdict = (state / "last").read_text().split()
        assert verdict == "ok" and int(before) <= int(at) <= time.time()
        assert (state / "failures").read_text() == "0\n" and (state / "ok-at").read_text() == f"{at}\n"
        assert (state / "engine-sample").read_text() == "5 7 "
    assert key not in argv.read_text() and "-H @-" in argv.read_text()
    assert stdin.read_text().splitlines() == [f"Authorization: Bearer {key}"] * 2
