"""The kernel step's verify script, run by bash against this machine's live values (read only:
nothing here tunes the kernel it runs on). It is the `check` of every refresh, so a value it
misreads is drift that never ends, and a mismatch it misses is drift never repaired."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from components import kernel, templates

THP = "/sys/kernel/mm/transparent_hugepage/"


def live_sysctl() -> dict[str, str]:
    """The tuned names with the values this machine has, as `sysctl -n` shows them, normalized."""
    return {k: " ".join(Path("/proc/sys", k.replace(".", "/")).read_text().split())
            for k in kernel.tuned_sysctl(kernel.KernelArgs())}


def live_sysfs() -> dict[str, str]:
    out = {}
    for f in ("enabled", "defrag", "khugepaged/defrag"):
        text = Path(THP, f).read_text().strip()
        m = re.search(r"\[(.*?)\]", text)
        out[THP + f] = m.group(1) if m else text
    return out


def verify(sysctl: dict, sysfs: dict, limits_path: Path) -> subprocess.CompletedProcess:
    script = templates.render("kernel/verify.sh.j2", sysctl=sysctl, sysfs=sysfs, limits=kernel.LIMITS,
                              limits_path=str(limits_path))
    # the unit lookup needs the host's systemd; everything else is read as on a node
    script = script.replace("systemctl is-enabled -q fimfleet-tuning.service", "true")
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30)


@pytest.fixture
def limits(tmp_path) -> Path:
    path = tmp_path / "90-fimfleet.conf"
    path.write_text(templates.render("kernel/limits.conf.j2", limits=kernel.LIMITS))
    return path


def test_live_values_pass(limits):
    proc = verify(live_sysctl(), live_sysfs(), limits)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_every_mismatch_is_named_and_nothing_else(limits, tmp_path):
    live, live_thp = live_sysctl(), live_sysfs()
    sysctl = {**live, "vm.swappiness": "7" if live["vm.swappiness"] != "7" else "8",
              "net.ipv4.tcp_rmem": "1 2 3", "no.such.key": "1"}
    sysfs = {**live_thp, THP + "enabled": "never" if live_thp[THP + "enabled"] != "never" else "always"}
    limits.write_text(limits.read_text().replace("hard    nofile", "soft    nofile"))  # the hard line is gone
    proc = verify(sysctl, sysfs, limits)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines == [
        f"sysctl vm.swappiness: wanted '{sysctl['vm.swappiness']}', live '{live['vm.swappiness']}'",
        f"sysctl net.ipv4.tcp_rmem: wanted '1 2 3', live '{live['net.ipv4.tcp_rmem']}'",  # tabs on /proc read as single spaces
        "sysctl no.such.key: wanted '1', live ''",
        f"{THP}enabled: wanted '{sysfs[THP + 'enabled']}', live '{live_thp[THP + 'enabled']}'",
        f"limits nofile: wanted {kernel.LIMITS['nofile']} in {limits}",
    ], proc.stderr


def test_a_missing_limits_file_names_each_limit(tmp_path):
    proc = verify(live_sysctl(), live_sysfs(), tmp_path / "absent.conf")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"limits {k}: wanted {v} in {tmp_path / 'absent.conf'}"
                                        for k, v in kernel.LIMITS.items()], proc.stderr


def test_the_script_forks_only_for_the_unit_lookup():
    """Why it exists in this shape: the check runs on every refresh under emulation."""
    script = kernel.render(kernel.KernelArgs()).check
    body = "\n".join(l for l in script.splitlines() if not l.lstrip().startswith("#"))
    assert "$(" not in body and not re.search(r"[^|]\|[^|]", body) and "sysctl -n" not in body, body


def test_the_defaults_apply_records_are_what_sysctl_and_the_sysfs_choice_show():
    """apply.sh records the distribution defaults with the same readers the check compares with
    (files/kernel/live.sh.j2), so destroy restores exactly what a later check calls live."""
    keys, paths = sorted(live_sysctl()), sorted(live_sysfs())
    script = templates.render("kernel/live.sh.j2") + "".join(
        [f'live_sysctl {k}; echo "$live"\n' for k in keys] + [f'live_sysfs {p}; echo "$live"\n' for p in paths])
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    # the reference tools, as the recording ran them before: `sysctl -n` and the sed of the choice
    want = [subprocess.run(["sysctl", "-n", k], capture_output=True, text=True).stdout.strip().replace("\t", " ")
            for k in keys]
    want += [subprocess.run(["sed", "-n", r"s/.*\[\(.*\)\].*/\1/p;t;p", p], capture_output=True, text=True).stdout
             .splitlines()[0] for p in paths]
    assert proc.stdout.splitlines() == want


def test_defaults_are_recorded_per_name_once_so_a_key_added_later_is_restored_too(tmp_path):
    """Recorded only at the first apply, a sysctl added to the stack later (and the debugfs knob)
    kept fimfleet's value after `destroy`; recording one twice would record fimfleet's own."""
    knob = tmp_path / "migration_cost_ns"
    knob.write_text("500000\n")

    def apply(names: list[str], live: dict[str, str]) -> str:
        script = (f"state={tmp_path}; sysctl_names=({' '.join(names)}); sysfs_paths=({knob} {tmp_path}/absent)\n"
                  + templates.render("kernel/live.sh.j2")
                  + "live_sysctl() { case $1 in " + " ".join(f"{k}) live={v} ;;" for k, v in live.items()) + " esac; }\n"
                  + templates.render("kernel/record-defaults.sh.j2") + "record_defaults\n")
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True, timeout=30)
        return (tmp_path / "defaults.conf").read_text()

    first = apply(["vm.swappiness"], {"vm.swappiness": "60"})
    assert first == f"vm.swappiness = 60\nsysfs {knob} 500000\n"
    knob.write_text("5000000\n")  # fimfleet's values are live now
    later = apply(["vm.swappiness", "net.core.somaxconn"], {"vm.swappiness": "10", "net.core.somaxconn": "4096"})
    assert later == first + "net.core.somaxconn = 4096\n"
    assert apply(["vm.swappiness", "net.core.somaxconn"], {"vm.swappiness": "10", "net.core.somaxconn": "1"}) == later
    assert not (tmp_path / "defaults.tmp").exists()


def staged(tmp_path: Path, r: kernel.RenderedKernel):
    """The step's files as RemoteStep uploads them before the apply, under tmp_path/root; returns
    the rewrite of every path the step writes to there (/proc/sys stays this machine's, read only)."""
    root = tmp_path / "root"

    def moved(text: str) -> str:
        return re.sub(r"(?<![\w.-])/(etc|var|usr)/", lambda m: f"{root}/{m.group(1)}/", text)

    for f in r.files:
        path = Path(moved(f["path"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f["content"])
    return moved


def run_with_fake_tools(tmp_path: Path, script: str, sysctl: str = "") -> subprocess.CompletedProcess:
    """Runs a step's script with sysctl, modprobe and systemctl that log each call to
    tmp_path/calls (sysctl then runs `sysctl`'s extra lines)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("sysctl", "modprobe", "systemctl"):
        (bin_ / tool).write_text(f'#!/bin/bash\necho "{tool} $*" >> {tmp_path}/calls\n' + (sysctl if tool == "sysctl" else ""))
        (bin_ / tool).chmod(0o755)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                          env={"PATH": f"{bin_}:/usr/bin:/bin"}, timeout=30)


def test_a_first_apply_the_host_refuses_leaves_nothing_for_the_next_boot(tmp_path):
    """The step's files were uploaded in place before the apply's checks ran: a sysctl this kernel
    lacks failed the step, which is then not in the state, and its sysctl.d, limits.d and
    modules-load.d files applied at the next boot, with no destroy to remove them. They are staged
    now, and installed only after the checks; destroy removes the staged copies too."""
    r = kernel.render(kernel.KernelArgs(sysctl_overrides={"no.such.key": "1"}))
    moved = staged(tmp_path, r)
    proc = run_with_fake_tools(tmp_path, moved(r.apply))
    assert proc.returncode == 1 and "sysctl no.such.key does not exist on this kernel" in proc.stderr, proc.stderr
    assert not [f["path"] for f in r.installed if Path(moved(f["path"])).exists()]
    assert not (tmp_path / "calls").exists()  # nothing loaded, set or enabled either
    assert not Path(moved(kernel.STAGED_DIR)).exists()  # and no staged copy: no destroy will come


def test_an_apply_rewrites_only_the_files_that_differ(tmp_path):
    """install(1) rewrote every file on each apply: the unit's new mtime made systemd want a
    daemon-reload (several seconds emulated) on every run."""
    r = kernel.render(kernel.KernelArgs())
    moved = staged(tmp_path, r)
    lines = moved(r.apply).splitlines()
    body = "\n".join(lines[lines.index("# Only a file that differs is written: a new mtime on the unit would cost a daemon-reload."):]
                     ).split("sysctl -q -p")[0]
    run = ["bash", "-euo", "pipefail", "-c", f"staged={moved(kernel.STAGED_DIR)}\n{body}"]
    subprocess.run(run, check=True, timeout=30)
    unit = Path(moved(kernel.UNIT_PATH))
    assert unit.read_text() == next(f["content"] for f in r.installed if f["path"] == kernel.UNIT_PATH)
    os.utime(unit, (1, 1))
    subprocess.run(run, check=True, timeout=30)
    assert unit.stat().st_mtime == 1
    unit.write_text("changed by hand\n")
    subprocess.run(run, check=True, timeout=30)
    assert unit.stat().st_mtime > 1 and "changed by hand" not in unit.read_text()


@pytest.mark.parametrize("earlier", [False, True])
def test_a_value_the_kernel_refuses_puts_back_what_was_live_and_installs_nothing(tmp_path, earlier):
    """vm.swappiness: -1 passes the value grammar, and the kernel's own range refuses it. The file
    went in place first, so `sysctl -p` failed half-way, the host kept the values before it, and
    every boot read the file again. The values are now tried live first: a refusal puts back the
    values before (the earlier apply's file, or the recorded defaults) and installs no file."""
    r = kernel.render(kernel.KernelArgs(sysctl_overrides={"vm.swappiness": "-1"}))
    moved = staged(tmp_path, r)
    sysctl_file = Path(moved(kernel.SYSCTL_PATH))
    if earlier:
        sysctl_file.parent.mkdir(parents=True, exist_ok=True)
        sysctl_file.write_text("vm.swappiness = 10\n")
    knob = tmp_path / "knob"  # a sysfs default: the apply changed no sysfs value yet, so keeps it
    knob.write_text("fimfleet's\n")
    defaults = Path(moved(kernel.STATE_DIR)) / "defaults.conf"
    defaults.parent.mkdir(parents=True, exist_ok=True)
    defaults.write_text(f"sysfs {knob} 500000\n")
    proc = run_with_fake_tools(tmp_path, moved(r.apply), sysctl='if [ "$2" = -p ] && grep -q "= -1$" "$3"; then\n'
                               '  echo "sysctl: setting key \\"vm.swappiness\\": Invalid argument" >&2; exit 255\nfi\n')
    assert proc.returncode == 1, proc.stderr
    assert 'the kernel refused a value of fimfleet:kernel.sysctl (sysctl: setting key "vm.swappiness": Invalid argument)' \
        in proc.stderr, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    live = Path("/proc/sys/vm/swappiness").read_text().strip()
    # every recorded default, the one refused too, then the earlier apply's values over them
    assert f"sysctl -q -w vm.swappiness={live}" in calls, calls
    assert (calls[-1] == f"sysctl -q -p {sysctl_file}") is earlier, calls
    assert sysctl_file.read_text() == "vm.swappiness = 10\n" if earlier else not sysctl_file.exists()
    assert not [f["path"] for f in r.installed[1:] if Path(moved(f["path"])).exists()]
    assert not Path(moved(kernel.STAGED_DIR)).exists()
    assert knob.read_text() == "fimfleet's\n"


def test_destroy_restores_every_recorded_default_and_leaves_no_state(tmp_path):
    """destroy puts back each sysctl and sysfs value recorded before fimfleet's first apply (the
    refused apply above shares this restore, sysctls only), then removes its records."""
    r = kernel.render(kernel.KernelArgs())
    moved = staged(tmp_path, r)
    knob, absent = tmp_path / "knob", tmp_path / "gone"
    knob.write_text("5000000\n")
    state = Path(moved(kernel.STATE_DIR))
    state.mkdir(parents=True, exist_ok=True)
    empty = tmp_path / "empty"  # a knob whose live value read empty when it was recorded
    empty.write_text("fimfleet's\n")
    (state / "defaults.conf").write_text(f"vm.swappiness = 60\nnet.ipv4.tcp_rmem = 4096 131072 6291456\n"
                                         f"sysfs {knob} 500000\nsysfs {absent} 1\nsysfs {empty} \n")
    proc = run_with_fake_tools(tmp_path, moved(r.destroy))
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if c.startswith("sysctl")] == [
        "sysctl -q -w vm.swappiness=60", "sysctl -q -w net.ipv4.tcp_rmem=4096 131072 6291456"]
    assert knob.read_text() == "500000\n" and not absent.exists() and empty.read_text() == "\n"
    assert not state.exists() and not [f["path"] for f in r.files if Path(moved(f["path"])).exists()]
