"""The runtime's destroy and image-pull scripts (files/runtime/), rendered and run by bash with every
path in a temp dir and systemctl, docker and userdel as no-op stand-ins: what they delete."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from components import templates


def run_destroy(tmp: Path, kind: str, venv: Path) -> None:
    fake = tmp / "bin"
    fake.mkdir()
    for tool in ("systemctl", "docker", "userdel"):
        (fake / tool).write_text("#!/bin/sh\nexit 0\n")
        (fake / tool).chmod(0o755)
    kw = {k: str(tmp / k) for k in ("state_dir", "cache_dir", "home", "images", "health", "docker_config", "env_file",
                                    "stamp")}
    body = templates.render("runtime/destroy.sh.j2", unit="vllm-node.service", venv=str(venv), user="fimfleet-test",
                            kind=kind, container="vllm-node", **kw)
    body = body.replace("/etc/systemd/system/", f"{tmp}/units/")  # the unit's own files, here
    proc = subprocess.run([shutil.which("bash"), "-s"], input="set -euo pipefail\n" + body, capture_output=True, text=True,
                          env={"PATH": f"{fake}:/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr


def tree(root: Path) -> Path:
    deep = root / "lib" / "python3.11" / "site-packages" / "pkg" / "sub"
    deep.mkdir(parents=True)
    (deep / "f.py").write_text("x = 1\n")
    return root


def test_the_venv_fimfleet_installed_is_deleted(tmp_path):
    venv = tree(tmp_path / "opt" / "vllm")
    (venv / ".fimfleet-lock").write_text("0123456789abcdef\n")
    tree(tmp_path / "opt" / "vllm.new")  # an install cut short
    run_destroy(tmp_path, "systemd", venv)
    assert not venv.exists() and not (tmp_path / "opt" / "vllm.new").exists()
    assert (tmp_path / "opt").is_dir()


def test_a_destroy_cut_short_and_an_install_cut_short_leave_nothing_after_the_next_destroy(tmp_path):
    """A destroy killed while it deleted the venv left part of it without its stamp, which the next
    deploy's preflight refuses; an install killed between its two renames left the old venv aside."""
    venv = tmp_path / "opt" / "vllm"
    tree(tmp_path / "opt" / "vllm.trash")  # the first destroy renamed it, then was killed
    old = tree(tmp_path / "opt" / "vllm.old")
    (old / ".fimfleet-lock").write_text("0123456789abcdef\n")
    run_destroy(tmp_path, "systemd", venv)
    assert sorted(p.name for p in (tmp_path / "opt").iterdir()) == []


@pytest.mark.parametrize("kind", ["systemd", "docker"])
def test_a_directory_fimfleet_did_not_install_is_left_alone(tmp_path, kind):
    """No stamp, or the docker runtime (which installs no venv): runtime.venvPath is not fimfleet's to delete."""
    theirs = tree(tmp_path / "srv" / "app")
    if kind == "docker":
        (theirs / ".fimfleet-lock").write_text("0123456789abcdef\n")
    run_destroy(tmp_path, kind, theirs)
    assert (theirs / "lib" / "python3.11" / "site-packages" / "pkg" / "sub" / "f.py").is_file()


@pytest.mark.parametrize("login", [True, False])
def test_a_registry_login_the_stack_no_longer_sets_is_removed_by_the_next_pull_step(tmp_path, login):
    """The login file is uploaded by the image step only while runtime.registryUser is set; without
    it, the old file (a registry password) stayed on the host until destroy."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("systemctl", "docker"):  # the image is there already: no pull
        (fake / tool).write_text("#!/bin/sh\n[ \"$2\" = inspect ] && [ \"$3\" = -f ] && echo sha256:abc\nexit 0\n")
        (fake / tool).chmod(0o755)
    conf = tmp_path / "docker"
    conf.mkdir()
    (conf / "config.json").write_text('{"auths": {}}')
    body = templates.render("runtime/pull-image.sh.j2", image="r.example.com/vllm@sha256:" + "a" * 64,
                            images=str(tmp_path / "images"), docker_config=str(conf), login=login)
    proc = subprocess.run([shutil.which("bash"), "-s"], input="set -euo pipefail\n" + body, capture_output=True,
                          text=True, env={"PATH": f"{fake}:/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (conf / "config.json").exists() is login
