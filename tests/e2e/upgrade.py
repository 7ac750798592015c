"""The `local` stack as the program before HostBase deployed it: where test_local_deploy starts.

That program's `up` onto the restored serving VM took about 190 s under emulation, most of it
the old commit's own slowness (a package list that still installs python3-pip, Debian's
update-rc.d before each Prometheus daemon), and all it does follows from its inputs. So the VM
right after it is saved, with the exported state and the stack's config file (its salt and API
keys), keyed by those inputs. A later run restores them, on the same local ports when they are
free, and runs only this tree's takeover, which is what test_01c judges. A fresh machine, a
changed input or an entry older than MAX_AGE_S deploys the old program again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from components import templates
from scripts import local_deploy as ld

UPGRADE_FROM = "f3020e7645ad45657d29184da42133e9b7a913aa"
"""The last commit before HostBase (issue 11): the first `up` deploys its program, as a stack
deployed before that change would have been; then this tree's program must take it over.
Its runtime renders the unit files the serving snapshot holds while the runtime is unchanged;
after a runtime change its first `up` starts the engine again (minutes longer, still correct)."""

ROOT = ld.CACHE / "testbed" / "upgrade"
RECORD = "first-up.json"
"""Written last: an entry without it is incomplete."""
MAX_AGE_S = 7 * 86400
"""Its certificates and the guest's clock date from the save: well inside their validity."""


def program_at(commit: str, dest: Path) -> Path | None:
    """The Pulumi program as it was at `commit` (its whole tree, with this checkout's .venv), or None
    when this clone lacks the commit (a shallow clone: `git fetch --unshallow`)."""
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ld.ROOT, capture_output=True).returncode:
        return None
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ld.ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / ".venv").symlink_to(ld.ROOT / ".venv")
    return dest


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


class OldStack:
    """`node`'s stack and VM as UPGRADE_FROM's program left them (node: tests/e2e/local_stack.Node,
    its config file already made by ld.stack_config)."""

    def __init__(self, node, paths: dict):
        self.node, self.paths = node, paths
        self.program = program_at(UPGRADE_FROM, node.tmp / "before-hostbase")
        serving = ld.serving_snapshot(node.config_file, paths["wheelhouse"])
        cli = ld.fimfleet_pulumi("version").strip()
        # created_at: the saved VM's disk is an overlay on exactly that snapshot's disk
        backing = serving.name, json.loads((serving / "manifest.json").read_text())["created_at"]
        self.dir = ROOT / templates.digest(UPGRADE_FROM, backing, (ld.ROOT / "stacks/Pulumi.local.yaml").read_text(),
                                           Path(__file__).read_text(), os.path.realpath(ld.ROOT / ".venv"),
                                           paths["model_dir"], cli)
        record = self.dir / RECORD
        fresh = bool(self.program) and record.exists() and time.time() - record.stat().st_mtime < MAX_AGE_S
        self.record = json.loads(record.read_text()) if fresh else None
        """The saved up's output, seconds and ports: None without a usable cache entry."""

    @property
    def cached(self) -> bool:
        return self.record is not None

    def start(self) -> None:
        """The VM: restored with the old program's deployment in it and the stack's state imported,
        or, without a cache entry, the serving snapshot's (up() then deploys the old program)."""
        n = self.node
        if not self.cached:
            ld.start_vm(n.state, self.paths["wheelhouse"], serving_config=n.config_file)
            return
        ld.say(f"restoring the VM that {UPGRADE_FROM[:7]}'s program deployed ({self.dir}); its up is not run again")
        shutil.copy(self.dir / "Pulumi.local.yaml", n.config_file)
        ld.stack_config(n.config_file, n.state, self.paths["model_dir"])  # this run's VM, the same keys
        ports = self.record["ports"]
        same = all(_free(p) for p in ports.values())  # else free ones: each step's connection updates
        ld.start_vm(n.state, self.paths["wheelhouse"], snapshot=self.dir / "vm", host_ports=ports if same else None)
        ld.fimfleet_pulumi("stack", "import", "-s", n.stack, "--file", str(self.dir / "state.json"))

    def up(self) -> tuple[subprocess.CompletedProcess, float]:
        """The old program's `up` and its seconds: run now, or as recorded when it was saved."""
        if self.cached:
            r = self.record
            return subprocess.CompletedProcess(r["args"], 0, r["stdout"], r["stderr"]), r["seconds"]
        t0 = time.monotonic()
        proc = self.node.pulumi("up", "--yes", "--skip-preview", program=self.program)
        seconds = time.monotonic() - t0
        if self.program and proc.returncode == 0:
            self._save(proc, seconds)
        return proc, seconds

    def _save(self, proc: subprocess.CompletedProcess, seconds: float) -> None:
        """The VM (frozen, then restored on its ports), the state and the config, under a lock: two
        runs at once save one entry."""
        n = self.node
        self.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(f"{self.dir}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (self.dir / RECORD).unlink(missing_ok=True)
            ports = ld.vm("status", state=n.state)["ports"]
            _write(self.dir / "state.json", ld.fimfleet_pulumi("stack", "export", "-s", n.stack))
            _write(self.dir / "Pulumi.local.yaml", n.config_file.read_text())
            ld.vm("save", "--to", str(self.dir / "vm"), "--label", json.dumps({"upgrade_from": UPGRADE_FROM}),
                  state=n.state)
            ld.start_vm(n.state, self.paths["wheelhouse"], snapshot=self.dir / "vm", same_ports=True)
            _write(self.dir / RECORD, json.dumps({"args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr,
                                                  "seconds": seconds, "ports": {"22": ports["22"], "443": ports["443"]}}))
        for stale in ROOT.iterdir():  # entries of other inputs: their serving snapshot may be gone
            if stale.is_dir() and stale != self.dir:
                shutil.rmtree(stale, ignore_errors=True)
                Path(f"{stale}.lock").unlink(missing_ok=True)
        ld.say(f"saved the old program's deployment for later runs in {time.monotonic() - t0:.0f} s ({self.dir})")
