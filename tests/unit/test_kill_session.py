"""The e2e's session kill: a killed `pulumi up` must not leave the plugins that the CLI started in
process groups of their own (they outlived every CI run before)."""

from __future__ import annotations

import subprocess
import sys
import time

from tests import helpers

# A leader with a child in its own process group (as the CLI's plugins are) and one in the leader's.
SCRIPT = """
import os, subprocess, sys, time
plugin = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], process_group=0)
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(plugin.pid, same.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    fields = helpers.proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def test_every_process_of_the_session_is_killed_its_own_process_groups_too():
    leader = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    children = [int(p) for p in leader.stdout.readline().split()]
    assert len(children) == 2 and all(_alive(p) for p in children)
    try:
        helpers.kill_session(leader.pid)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in children if _alive(p)]
    finally:
        leader.kill()
        subprocess.run(["kill", "-9", *map(str, children)], capture_output=True)
