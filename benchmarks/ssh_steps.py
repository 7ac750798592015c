#!/usr/bin/env python3
"""What fimfleet's remote steps cost in SSH alone, on the test VM, side by side in one run:

  A. as before components/ssh.py shared connections: each step opens its own connection
     (handshake, login), runs one mkdir per file it uploads, its script and its marker;
  B. as before 2026-12-06: steps on one host share one connection, but each apply still
     starts three shells: one mkdir for all its files, its script, its marker;
  C. as now: RemoteStepProvider.create, one shell per apply (directories made over SFTP,
     the marker written after the script in the same shell).

Every step has the shape of a typical fimfleet step: 4 files in 3 directories, a one-line
script, the marker. Rounds rotate the legs' order on one VM restored from the booted
snapshot; the per-step medians and their ratios go to benchmarks/results/ssh_steps.json.

    .venv/bin/python benchmarks/ssh_steps.py [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components import host, remote, ssh, upload  # noqa: E402
from scripts import local_deploy as ld  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "ssh_steps.json"


def files(i: int) -> list[dict]:
    return [{"path": f"/etc/fimfleet/bench/{d}/f{i}-{n}", "mode": "0644", "content": f"{i} {n}\n"}
            for n, d in enumerate(("a", "a", "b", "c"))]


def upload_as_before(client, fs: list[dict]) -> None:
    """The upload before 2026-12-06: a shell for `mkdir -p` of the parents, then SFTP."""
    code, _, err = ssh.run(client, "mkdir -p -- " + " ".join(map(shlex.quote, upload.parents(fs))))
    assert code == 0, err
    sftp = client.open_sftp()
    try:
        upload.write_files(sftp, fs)
    finally:
        sftp.close()


def script_then_marker(client, i: int) -> None:
    """The script and the marker in shells of their own, as both older legs ran them."""
    for script in (f"cat /etc/fimfleet/bench/*/f{i}-* >/dev/null; echo {i}", remote._mark_command(f"bench-{i}", "x")):
        code, _, err = ssh.run(client, script)
        assert code == 0, err


def step_as_before(conn: dict, i: int) -> None:
    """The old RemoteStepProvider._exec: its own session, a mkdir per file, script, marker."""
    with ssh.session(ssh.SshTarget.from_props(conn)) as client:
        for f in files(i):
            upload_as_before(client, [f])  # one file at a time: one mkdir each, as before
        script_then_marker(client, i)


def step_three_shells(conn: dict, i: int) -> None:
    """RemoteStepProvider._exec before 2026-12-06: the shared connection, three shells."""
    with ssh.shared_session(ssh.SshTarget.from_props(conn)) as client:
        upload_as_before(client, files(i))
        script_then_marker(client, i)


def step_as_now(conn: dict, i: int) -> None:
    remote.RemoteStepProvider().create({
        "connection": conn, "apply": f"cat /etc/fimfleet/bench/*/f{i}-* >/dev/null; echo {i}", "check": "",
        "destroy": "", "files": files(i), "uploads": None, "env": {}, "triggers": [], "timeoutS": 120,
        "label": f"bench {i}"})


def timed_steps(fn, conn: dict, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.monotonic()
        fn(conn, i)
        out.append(time.monotonic() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    paths = ld.prepare()
    state = Path(tempfile.mkdtemp(prefix="ssh-steps-")) / "vm"
    ld.start_vm(state, paths["wheelhouse"])
    try:
        conn = host.testbed_connection(str(state))
        legs = {"before": step_as_before, "three_shells": step_three_shells, "now": step_as_now}
        got: dict[str, list[float]] = {name: [] for name in legs}
        step_as_before(conn, 0)  # the guest's first login starts its user session: not part of either leg
        names = list(legs)
        for r in range(a.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                ssh.drop_shared()  # each leg of B and C starts without a connection, as a new `pulumi up` does
                times = timed_steps(legs[name], conn, a.steps)
                got[name].extend(times)
                ld.say(f"round {r + 1}: {name}: {statistics.median(times):.3f} s per step")
        med = {name: statistics.median(v) for name, v in got.items()}
        result = {
            "steps_per_round": a.steps, "rounds": a.rounds,
            "per_step_s_before_median": round(med["before"], 3),
            "per_step_s_three_shells_median": round(med["three_shells"], 3),
            "per_step_s_now_median": round(med["now"], 3),
            "ratio_now_over_before_median": round(med["now"] / med["before"], 3),
            "ratio_now_over_three_shells_median": round(med["now"] / med["three_shells"], 3),
            **{f"per_step_s_{name}": [round(x, 3) for x in v] for name, v in got.items()},
            "where": "test VM (QEMU TCG) restored from the booted snapshot, on this machine",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    finally:
        ld.stop_vm(state)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
