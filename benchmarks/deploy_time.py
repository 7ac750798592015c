#!/usr/bin/env python3
"""Deploy-time benchmark: fimfleet's `pulumi up` against the same steps as a plain runbook.

Run in one invocation, side by side, on this machine:
  A. `pulumi up -s local` onto a fresh test VM (the demo's code path), wall time;
  B. the same remote steps replayed as a sequential shell runbook (one SSH connection,
     files uploaded, scripts run in dependency order, no Pulumi) onto another fresh VM,
     taken from A's own state, so both do exactly the same work;
  C. a no-op `pulumi up` of the deployed stack against `pulumi up` of an empty Python
     program, and of a program with one unchanged dynamic resource (the floor of any
     program whose resources are Python dynamic providers), same CLI, median of 5, alternating;
     and the same no-op `up` compiling every template again (no compiled templates kept).
Ratios are what matters here: the machine is noisy. A and B's ratio is also given without each
leg's engine start (start.sh's own ready_after_s): the same work in both, most of either leg under
emulation, and a minute apart between runs. Results go to benchmarks/results/.

    .venv/bin/python benchmarks/deploy_time.py            # A, B and C (two fresh VMs, ~25 min)
    .venv/bin/python benchmarks/deploy_time.py --noop     # C only, on the demo's deployed stack
    .venv/bin/python benchmarks/deploy_time.py --runbook  # B only: the demo stack's steps onto a fresh VM
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components import cache, host, ssh, upload  # noqa: E402
from benchmarks import _up_phases as up_phases  # noqa: E402
from scripts import local_deploy as ld  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "deploy_time.json"


def timed(fn, *a, **kw):
    t0 = time.monotonic()
    out = fn(*a, **kw)
    return time.monotonic() - t0, out


def pulumi(config_file: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "fimfleet"), "pulumi", *args, "-s", "local", "--non-interactive",
                           "--config-file", str(config_file)], cwd=ROOT, capture_output=True, text=True, check=True,
                          env=env)


def uncompiled_templates_env(tmp: Path) -> dict:
    """The environment of an `up` that compiles every template again (as before they were kept,
    components/templates.py): a cache whose jinja directory cannot be made, sharing the rest."""
    cold = tmp / "cache-without-templates"
    cold.mkdir(exist_ok=True)
    (cold / "jinja").write_text("not a directory: no compiled templates are kept\n")
    for entry in cache.root().iterdir():
        if entry.name != "jinja" and not (cold / entry.name).exists():
            (cold / entry.name).symlink_to(entry)
    return {**os.environ, "FIMFLEET_CACHE": str(cold)}


def runbook_steps(config_file: Path) -> list[dict]:
    """The RemoteSteps of the deployed stack, in the order Pulumi created them."""
    del config_file  # `stack export` reads the state only and takes no --config-file
    state = json.loads(ld.fimfleet_pulumi("stack", "export", "--show-secrets", "-s", "local"))
    steps = [_plain(r["outputs"]) for r in state["deployment"]["resources"]
             if r["type"] == "pulumi-python:dynamic:Resource" and "apply" in r.get("outputs", {})]
    return steps


SECRET_SIG = "4dabf18193072939515e22adb298388d"


def _plain(value):
    """Unwrap the secrets of an exported state (`--show-secrets` keeps them as JSON plaintext)."""
    if isinstance(value, dict):
        if SECRET_SIG in value and "plaintext" in value:
            return _plain(json.loads(value["plaintext"]))
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def replay(steps: list[dict], state_dir: Path) -> list[dict]:
    """Each step in turn over one connection: its label, seconds and stdout."""
    done = []
    with ssh.session(ssh.SshTarget.from_props(host.testbed_connection(str(state_dir)))) as client:
        for s in steps:
            t0 = time.monotonic()
            if s.get("files"):
                upload.put_files(client, s["files"])
            for up in s.get("uploads") or ():
                upload.put_dir(client, up["local"], up["remote"])
            code, out, err = ssh.run(client, s["apply"], timeout_s=3600, env=s.get("env"))
            if code:
                raise SystemExit(f"runbook step {s.get('label')} failed: {err[-2000:]}")
            done.append({"label": s.get("label"), "seconds": round(time.monotonic() - t0, 1), "stdout": out})
    return done


def engine_start_s(stdouts) -> float:
    """The engine's own start, as the runtime's start.sh reports it ({"ready_after_s": N, ...}):
    under emulation it is most of either leg and varies between runs by a minute or more."""
    for out in stdouts:
        lines = (out or "").strip().splitlines()
        try:
            report = json.loads(lines[-1]) if lines else {}
        except ValueError:
            continue
        if isinstance(report, dict) and "ready_after_s" in report:
            return float(report["ready_after_s"])
    raise SystemExit("no step reported the engine's start (ready_after_s)")


EMPTY_PROGRAM = "import pulumi\npulumi.export('ok', True)\n"
ONE_DYNAMIC_RESOURCE = """import pulumi
from pulumi.dynamic import CreateResult, Resource, ResourceProvider


class Provider(ResourceProvider):
    def create(self, props):
        return CreateResult(id_="one", outs=props)


class One(Resource):
    def __init__(self, name):
        super().__init__(Provider(), name, {"value": "same"})


pulumi.export("ok", One("one").id)
"""
"""The floor of any program with a Python dynamic provider: the engine starts the provider's
own Python process, which imports the Pulumi SDK, before its first diff."""


def reference_cmd(tmp: Path, name: str, program: str) -> list[str]:
    """The `pulumi up` of a reference program, created and deployed on the first call, so that
    every later `up` is a no-op."""
    proj = tmp / name
    proj.mkdir(exist_ok=True)
    (proj / "Pulumi.yaml").write_text(f"name: {name}\nruntime:\n  name: python\n  options:\n"
                                      f"    virtualenv: {ROOT / '.venv'}\n")
    (proj / "__main__.py").write_text(program)
    env_cmd = [str(ROOT / "fimfleet"), "pulumi"]
    subprocess.run(env_cmd + ["stack", "select", "--create", f"local-bench-{name}", "--cwd", str(proj)], check=True,
                   capture_output=True)
    up = env_cmd + ["up", "--yes", "--skip-preview", "--non-interactive", "-s", f"local-bench-{name}", "--cwd", str(proj)]
    if not (proj / ".created").exists():
        subprocess.run(up, check=True, capture_output=True)
        (proj / ".created").touch()
    return up


def reference_up(tmp: Path, name: str, program: str) -> float:
    up = reference_cmd(tmp, name, program)
    t, _ = timed(subprocess.run, up, check=True, capture_output=True)
    return t


def empty_program_up(tmp: Path) -> float:
    return reference_up(tmp, "empty", EMPTY_PROGRAM)


def noop_vs_empty(config_file: Path, tmp: Path, rounds: int = 5) -> dict:
    """Alternating rounds: the deployed stack's no-op up, an empty program's, and a program with
    one unchanged dynamic resource (the floor of the dynamic-provider approach)."""
    noop, uncompiled, empty, one = [], [], [], []
    cold = uncompiled_templates_env(tmp)
    for _ in range(rounds):
        noop.append(timed(pulumi, config_file, "up", "--yes", "--skip-preview")[0])
        uncompiled.append(timed(pulumi, config_file, "up", "--yes", "--skip-preview", env=cold)[0])
        empty.append(empty_program_up(tmp))
        one.append(reference_up(tmp, "one-dynamic", ONE_DYNAMIC_RESOURCE))
    med = statistics.median
    return {"noop_up_s": [round(x, 2) for x in noop],
            "noop_up_templates_compiled_each_run_s": [round(x, 2) for x in uncompiled],
            "empty_program_up_s": [round(x, 2) for x in empty],
            "one_dynamic_resource_up_s": [round(x, 2) for x in one],
            "ratio_noop_over_empty_median": round(med(noop) / med(empty), 3),
            "ratio_noop_templates_compiled_each_run_over_empty_median": round(med(uncompiled) / med(empty), 3),
            "ratio_one_dynamic_over_empty_median": round(med(one) / med(empty), 3),
            "ratio_noop_over_one_dynamic_median": round(med(noop) / med(one), 3),
            # Unset is Python's default; set, every run compiles the program's modules again.
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
            "phases_one_verbose_run": noop_phases(config_file, tmp)}


def noop_phases(config_file: Path, tmp: Path) -> dict:
    """Where each program's no-op `up` goes (benchmarks/_up_phases.py), one verbose run each."""
    verbose = ("-v=9", "--logtostderr")
    runs = {"noop": pulumi(config_file, "up", "--yes", "--skip-preview", *verbose).stderr}
    for name, program in (("empty", EMPTY_PROGRAM), ("one_dynamic", ONE_DYNAMIC_RESOURCE)):
        runs[name] = subprocess.run(reference_cmd(tmp, name.replace("_", "-"), program) + list(verbose),
                                    check=True, capture_output=True, text=True).stderr
    return {name: up_phases.phases(log) for name, log in runs.items()}


def save(name: str, result: dict) -> None:
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = RESULTS.with_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> int:
    if "--runbook" in sys.argv:
        # B alone: the demo stack's steps (default state) replayed onto a fresh VM.
        tmp = Path(tempfile.mkdtemp(prefix="fimfleet-bench-"))
        paths = ld.prepare()
        steps = runbook_steps(ld.WORK / "Pulumi.local.yaml")
        ld.start_vm(tmp / "vm-b", paths["wheelhouse"])
        try:
            t_runbook, _ = timed(replay, steps, tmp / "vm-b")
        finally:
            ld.stop_vm(tmp / "vm-b")
        save("runbook.json", {"runbook_fresh_vm_s": round(t_runbook, 1), "runbook_steps": [s.get("label") for s in steps]})
        return 0
    if "--noop" in sys.argv:
        tmp = Path(tempfile.mkdtemp(prefix="fimfleet-bench-"))
        save("noop_up.json", noop_vs_empty(ld.WORK / "Pulumi.local.yaml", tmp))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="fimfleet-bench-"))
    os.environ["FIMFLEET_BACKEND_URL"] = f"file://{tmp / 'state'}"  # never the demo's stack
    paths = ld.prepare()
    cfg_a, vm_a, vm_b = tmp / "Pulumi.local.yaml", tmp / "vm-a", tmp / "vm-b"
    try:
        ld.start_vm(vm_a, paths["wheelhouse"])
        ld.stack_config(cfg_a, vm_a, paths["model_dir"])
        t_pulumi, _ = timed(ld.up, cfg_a)
        steps = runbook_steps(cfg_a)
        # A's deployed VM idles at more than a core under emulation (engine, monitor, Prometheus):
        # paused, so B's steps and engine start get the machine A had.
        ld.vm("hmp", "stop", state=vm_a)
        try:
            ld.start_vm(vm_b, paths["wheelhouse"])
            t_runbook, done = timed(replay, steps, vm_b)
            ld.stop_vm(vm_b)
        finally:  # the destroy below needs A running, also when B failed
            ld.vm("hmp", "cont", state=vm_a)
        start_a, start_b = engine_start_s(s.get("stdout") for s in steps), engine_start_s(d["stdout"] for d in done)
        result = {
            "pulumi_up_fresh_vm_s": round(t_pulumi, 1),
            "runbook_fresh_vm_s": round(t_runbook, 1),
            "ratio_pulumi_over_runbook": round(t_pulumi / t_runbook, 3),
            # The engine's start is the same work in both legs but not the same time: without it,
            # the ratio is what the dependency graph and fimfleet's own overhead make of the rest.
            "engine_start_s": {"pulumi": start_a, "runbook": start_b},
            "ratio_without_engine_start": round((t_pulumi - start_a) / (t_runbook - start_b), 3),
            "runbook_steps": [{"label": d["label"], "seconds": d["seconds"]} for d in done],
            **noop_vs_empty(cfg_a, tmp),
            "note": "pulumi up includes the SLA check (a probe through nginx); the runbook replays only the "
                    "remote steps, so the ratio bounds fimfleet's own overhead from above.",
        }
    finally:
        ld.destroy(cfg_a, check=False, capture=True)
        ld.stop_vm(vm_a)
        ld.stop_vm(vm_b)
    save(RESULTS.name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
