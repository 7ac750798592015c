"""The runtime's destroy, install and image-pull scripts (files/runtime/), rendered and run by bash with
every path in a temp dir and systemctl, docker and userdel as no-op stand-ins: what they delete."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from components import templates


def stubs(tmp: Path, tools: dict[str, str]) -> dict:
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    for tool, body in tools.items():
        (fake / tool).write_text(f"#!/bin/bash\n{body}\n")
        (fake / tool).chmod(0o755)
    return {"PATH": f"{fake}:/usr/bin:/bin"}


def bash(body: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), "-s"], input="set -euo pipefail\n" + body, capture_output=True,
                          text=True, env=env, timeout=60)


def destroy_parts(kind: str) -> list[str]:
    """The runtime's destroys in the order Pulumi runs them: the unit's, the model's, the install's."""
    return ["unit-destroy", "model-destroy", "venv-destroy" if kind == "systemd" else "image-destroy"]


def run_destroy(tmp: Path, kind: str, venv: Path) -> None:
    env = stubs(tmp, {"systemctl": "exit 0", "docker": "exit 0", "userdel": "exit 0"})
    kw = {k: str(tmp / k) for k in ("state_dir", "writable_dir", "images", "health", "docker_config", "env_file",
                                    "stamp", "lock_path")}
    kw.update(cache_dir=f"{kw['writable_dir']}/hf", home=f"{kw['writable_dir']}/home")  # as in runtime.py
    for part in destroy_parts(kind):
        body = templates.render(f"runtime/{part}.sh.j2", unit="vllm-node.service", venv=str(venv), user="fimfleet-test",
                                kind=kind, container="vllm-node", **kw)
        body = body.replace("/etc/systemd/system/", f"{tmp}/units/")  # the unit's own files, here
        proc = bash(body, env)
        assert proc.returncode == 0, (part, proc.stderr)


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


@pytest.mark.parametrize("kind", ["systemd", "docker"])
def test_the_runtimes_destroys_leave_nothing_its_steps_made(tmp_path, kind):
    """The install step's lock file stayed, and the docker runtime's home (compile caches) and health
    script stayed after a switch to the systemd runtime."""
    made = [tmp_path / p for p in ("units/vllm-node.service", "units/vllm-node.service.d/memory.conf", "env_file",
                                   "stamp", "health", "writable_dir/home/.cache/x",
                                   "state_dir/models/m/config.json", "writable_dir/hf/hub/x", "images", "docker_config/config.json", "lock_path")]
    for f in made:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x\n")
    venv = tmp_path / "opt" / "vllm"
    run_destroy(tmp_path, kind, venv)
    left = [str(f.relative_to(tmp_path)) for f in made if f.exists()]
    # the other kind's install step removes its own: the systemd destroy leaves docker's images list
    assert left == (["images", "docker_config/config.json"] if kind == "systemd" else ["lock_path"])
    assert not (tmp_path / "writable_dir").exists()


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
    env = stubs(tmp_path, {t: '[ "$2" = inspect ] && [ "$3" = -f ] && echo sha256:abc\nexit 0'  # the image is there already
                           for t in ("systemctl", "docker")})
    conf = tmp_path / "docker"
    conf.mkdir()
    (conf / "config.json").write_text('{"auths": {}}')
    body = templates.render("runtime/pull-image.sh.j2", image="r.example.com/vllm@sha256:" + "a" * 64,
                            images=str(tmp_path / "images"), docker_config=str(conf), login=login)
    proc = bash(body, env)
    assert proc.returncode == 0, proc.stderr
    assert (conf / "config.json").exists() is login


IMAGE = "r.example.com/vllm@sha256:" + "a" * 64
# a docker whose store holds $FAKE_STORE's lines; `pull` adds one, then (FAKE_PULL_DIES) kills the script
DOCKER = r"""
case "$1 $2" in
  "image inspect") img=${!#}; grep -qxF -- "$img" "$FAKE_STORE" 2>/dev/null || exit 1; [ "$3" = -f ] && echo sha256:abc; exit 0 ;;
  "pull "*) echo "$2" >> "$FAKE_STORE"; [ -z "${FAKE_PULL_DIES:-}" ] || { kill -9 "$PPID"; exit 137; } ;;
  "image rm") grep -vxF -- "$3" "$FAKE_STORE" > "$FAKE_STORE.new" || true; mv "$FAKE_STORE.new" "$FAKE_STORE" ;;
esac
exit 0
"""


@pytest.mark.parametrize("before", [True, False])
def test_destroy_removes_the_images_the_step_pulled_and_leaves_the_one_the_host_had(tmp_path, before):
    """An image already in dockerd's store was listed as pulled, and destroy removed the host's own
    image; a pull killed after it finished left it unlisted, and destroy kept it."""
    store = tmp_path / "store"
    store.write_text(f"{IMAGE}\n" if before else "")
    env = {**stubs(tmp_path, {"systemctl": "exit 0", "docker": DOCKER}), "FAKE_STORE": str(store)}
    images = tmp_path / "images"
    body = templates.render("runtime/pull-image.sh.j2", image=IMAGE, images=str(images),
                            docker_config=str(tmp_path / "docker"), login=False)
    if not before:
        assert bash(body, {**env, "FAKE_PULL_DIES": "1"}).returncode in (-9, 137)
    proc = bash(body, env)
    assert proc.returncode == 0, proc.stderr
    assert store.read_text().splitlines() == [IMAGE]
    destroy = templates.render("runtime/image-destroy.sh.j2", images=str(images), docker_config=str(tmp_path / "docker"))
    assert bash(destroy, env).returncode == 0
    assert store.read_text().splitlines() == ([IMAGE] if before else [])
    assert not images.exists()


def test_an_install_killed_between_its_two_renames_finishes_the_swap_on_its_rerun(tmp_path):
    """The old venv was aside as .old and the new, whole and stamped, still .new: the rerun found
    no venv and installed it all again (minutes of pip)."""
    lock = tmp_path / "vllm.lock"
    lock.write_text("vllm==0.0.1\n")
    want = subprocess.run(["sha256sum", str(lock)], capture_output=True, text=True).stdout[:16]
    opt = tmp_path / "opt"
    old, new = tree(opt / "vllm.old"), tree(opt / "vllm.new")
    (old / ".fimfleet-lock").write_text("0123456789abcdef\n")
    (new / ".fimfleet-lock").write_text(want + "\n")
    env = stubs(tmp_path, {"python3": "echo reinstalled >&2; exit 3", "useradd": "exit 0", "id": "exit 0"})
    body = templates.render("runtime/install-venv.sh.j2", venv=str(opt / "vllm"), lock_path=str(lock), user="u",
                            state_dir=str(tmp_path / "s"), wheelhouse_url="", index_url="")
    proc = bash(body, env)
    assert proc.returncode == 0, proc.stderr
    assert '"installed": false' in proc.stdout
    assert sorted(p.name for p in opt.iterdir()) == ["vllm"]
    assert (opt / "vllm" / ".fimfleet-lock").read_text().strip() == want


# python3 -m venv DIR makes DIR/bin/{pip,python} (and says so in $FAKE_LOG); that pip installs a tree
# deep enough for destroy's side-by-side unlink (lib/python3.11/site-packages/<pkg>/<sub>)
PYTHON3 = r'''
if [ "$1 $2" = "-m venv" ]; then
  echo venv >> "$FAKE_LOG"
  mkdir -p "$3/bin"
  printf '#!/bin/bash\nd=$(dirname "$(dirname "$0")")/lib/python3.11/site-packages; mkdir -p "$d/vllm/sub" "$d/torch/sub"; echo x > "$d/vllm/sub/f.py"\n' > "$3/bin/pip"
  printf '#!/bin/bash\nexit 0\n' > "$3/bin/python"
  chmod +x "$3/bin/pip" "$3/bin/python"
  exit 0
fi
exit 3
'''
# rm killed while it deletes a stamped venv (FAKE_RM_DIES): it unlinks the stamp first, as rm does
RM = r'''
if [ -n "${FAKE_RM_DIES:-}" ]; then
  for a in "$@"; do
    if [ -f "$a/.fimfleet-lock" ]; then /bin/rm -f "$a/.fimfleet-lock"; kill -9 "$PPID"; exit 137; fi
  done
fi
exec /bin/rm "$@"
'''


@pytest.mark.parametrize("then", ["rerun", "destroy"])
def test_a_venv_install_killed_at_any_line_or_mid_delete_converges_on_its_rerun_and_its_destroy(tmp_path, then):
    """Over an installed venv of another lock: a kill while the old venv was deleted (rm unlinks its
    stamp first) left a stampless .old that destroy took for someone else's, and a kill after .new
    was stamped installed it all again."""
    from tests.unit.test_package_ledger import kill_points

    lock = tmp_path / "vllm.lock"
    lock.write_text("vllm==0.0.2\n")
    want = subprocess.run(["sha256sum", str(lock)], capture_output=True, text=True).stdout[:16]
    log = tmp_path / "log"
    env = {**stubs(tmp_path, {"python3": PYTHON3, "rm": RM, "useradd": "exit 0", "userdel": "exit 0", "id": "exit 0"}),
           "FAKE_LOG": str(log)}
    kw = dict(lock_path=str(lock), user="u", state_dir=str(tmp_path / "s"), wheelhouse_url="", index_url="")
    points = kill_points(templates.render("runtime/install-venv.sh.j2", venv="/opt/vllm", **kw), start="want=")
    assert len(points) >= 8
    for n, kill in enumerate([{"line": line} for line in points] + [{"FAKE_RM_DIES": "1"}]):
        opt = tmp_path / str(n) / "opt"
        venv = tree(opt / "vllm")
        (venv / ".fimfleet-lock").write_text("0123456789abcdef\n")  # an older lock's venv
        body = templates.render("runtime/install-venv.sh.j2", venv=str(venv), **kw)
        lines = body.splitlines()
        if "line" in kill:
            at = lines.index(kill["line"])
            killed = bash("\n".join(lines[:at + 1] + ["kill -9 $$"] + lines[at + 1:]), env)
        else:
            killed = bash(body, {**env, **kill})
        assert killed.returncode in (0, -9, 137), (kill, killed.stderr)  # 0: a line this run does not reach
        stamped = (opt / "vllm.new" / ".fimfleet-lock").exists()
        log.write_text("")
        if then == "rerun":
            proc = bash(body, env)
            assert proc.returncode == 0, (kill, proc.stderr)
            assert sorted(p.name for p in opt.iterdir()) == ["vllm"], kill
            assert (venv / ".fimfleet-lock").read_text().strip() == want, kill
            assert not (stamped and log.read_text()), f"a stamped .new was installed again: {kill}"
        else:
            destroy = templates.render("runtime/venv-destroy.sh.j2", venv=str(venv), user="u",
                                       lock_path=str(tmp_path / str(n) / "lock"))
            assert bash(destroy, env).returncode == 0, kill
            assert sorted(p.name for p in opt.iterdir()) == [], kill
