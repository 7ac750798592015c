"""The README's main job: the local test VM as a VPS, deployed with `pulumi up -s local`.

Steps (each cached or idempotent, with progress on stderr):
  1. the pinned vLLM CPU install and its wheelhouse (toolchain/vllm/install.sh)
  2. the tiny random FIM model (toolchain/tinymodel/make_tiny_model.py)
  3. the `local` stack's config: VM and model paths, two generated API keys as secrets
     (kept in .work/Pulumi.local.yaml, outside version control)
  4. the VM image with the vLLM venv pre-installed, a booted-RAM snapshot, a snapshot whose
     engine already serves this stack's runtime (scripts/engine_snapshot.py), and a fresh VM
     restored from it (toolchain/testbed/vm.py)
  5. `pulumi up -s local`, then the endpoint, the SLA report and the Continue.dev config

The e2e tests import these functions, so the demo and the tests run one code path.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components import cache  # noqa: E402

CACHE = cache.root()
WORK = ROOT / ".work"
VM_PY = ROOT / "toolchain" / "testbed" / "vm.py"
VARIANT = "vllm"
KEY_NAMES = ("alice", "bob")


def say(msg: str) -> None:
    print(f"fimfleet demo: {msg}", file=sys.stderr, flush=True)


def run(argv, *, capture=True, check=True, env=None, timeout=None, input=None) -> str:
    proc = subprocess.run([str(a) for a in argv], cwd=ROOT, text=True, env=env, timeout=timeout, input=input,
                          stdout=subprocess.PIPE if capture else None, stderr=None)
    if check and proc.returncode != 0:
        raise SystemExit(f"fimfleet demo: `{' '.join(map(str, argv))[:200]}` failed with exit {proc.returncode}")
    return proc.stdout or ""


def last_value(out: str, key: str) -> str:
    for line in reversed(out.splitlines()):
        if line.startswith(key + "="):
            return line.split("=", 1)[1].strip()
    raise SystemExit(f"fimfleet demo: no {key}= line in the output")


def prepare() -> dict:
    """vLLM venv + wheelhouse, tiny model. Returns their paths."""
    say("vLLM CPU install (cached; the first run downloads about 3.5 GB)")
    venv = last_value(run([ROOT / "toolchain/vllm/install.sh"]), "VLLM_VENV")
    wheelhouse = last_value(run([ROOT / "toolchain/vllm/install.sh", "wheelhouse"]), "VLLM_WHEELHOUSE")
    say("tiny FIM model (cached)")
    model = last_value(run([f"{venv}/bin/python", ROOT / "toolchain/tinymodel/make_tiny_model.py"]), "TINY_MODEL_DIR")
    return {"vllm_python": f"{venv}/bin/python", "wheelhouse": wheelhouse, "model_dir": model}


def vm(*args, state: Path, **kw) -> dict:
    out = run([sys.executable, VM_PY, *args, "--state", state], **kw)
    return json.loads(out) if out.strip().startswith("{") else {}


def _testbed_env(wheelhouse: str, variant_env: dict | None = None) -> dict:
    """vm.py's environment; `variant_env`: what a variant's build needs besides (docker-engine:
    the image to preload, toolchain/testbed/variants/docker-engine.sh)."""
    return {**os.environ, "FIMFLEET_WHEELHOUSE": wheelhouse,
            "FIMFLEET_VLLM_LOCK": str(ROOT / "toolchain/vllm/requirements-cpu.lock"), **(variant_env or {})}


def serving_snapshot(serving_config: Path, wheelhouse: str, variant: str = VARIANT, node: str = "node",
                     variant_env: dict | None = None) -> Path:
    """The snapshot whose engine serves `serving_config`'s runtime as `node` (built the first time)."""
    from scripts import engine_snapshot

    env = _testbed_env(wheelhouse, variant_env)
    return engine_snapshot.ensure(vm, serving_config, CACHE, env, variant=variant, node=node)


def serving_snapshot_cached(serving_config: Path, wheelhouse: str, variant: str = VARIANT, node: str = "node",
                            variant_env: dict | None = None) -> bool:
    """Whether serving_snapshot() would find it built."""
    from scripts import engine_snapshot

    env = _testbed_env(wheelhouse, variant_env)
    return engine_snapshot.cached(vm, serving_config, CACHE, env, variant=variant, node=node)


def start_vm(state: Path, wheelhouse: str, serving_config: Path | None = None, same_ports: bool = False,
             variant: str = VARIANT, guest_ports: tuple[int, ...] = (443,), node: str = "node",
             variant_env: dict | None = None, snapshot: Path | None = None,
             host_ports: dict[str, int] | None = None) -> dict:
    """A fresh VM with guest 443 forwarded to a free local port: restored from the snapshot whose
    engine already serves `serving_config`'s runtime (scripts/engine_snapshot.py), or, without
    it, from the variant's booted snapshot (the engine then starts during `pulumi up`).
    `same_ports`: the stopped VM's ssh and https ports, as a host reinstalled under its address.
    `variant`: vllm (the systemd runtime's venv), docker (the docker runtime's daemon) or
    docker-engine (that daemon with the engine image in it already). `guest_ports`: the guest's
    ports forwarded to free local ones (a gateway beside the ingress needs its own). `node`: the node
    whose engine the serving snapshot runs (a fleet's VMs each serve their own). `variant_env`: see
    _testbed_env. `snapshot`: restore this saved snapshot instead (tests/e2e/upgrade.py).
    `host_ports`: guest port -> local port ("22" included), instead of free ones."""
    env = _testbed_env(wheelhouse, variant_env)
    if (state / "info.json").exists():
        status = vm("status", state=state, check=False)
        if same_ports:
            host_ports = status["ports"]
        if not same_ports and status.get("running") and status.get("variant") == variant \
                and all(str(g) in status.get("ports", {}) for g in guest_ports):
            # The deployed node lives on this VM: a rerun converges on it instead of starting over.
            say(f"reusing the running test VM in {state}")
            return status
    ports = [a for g in guest_ports for a in ("--forward", str(g))]
    if host_ports:
        ports = ["--ssh-port", str(host_ports["22"])]
        ports += [a for g in guest_ports for a in ("--forward", f"{host_ports[str(g)]}:{g}")]
    say("test VM: image, snapshot and a fresh VM restored from it (the first build takes several minutes)")
    if snapshot is not None:
        return vm("restore", "--snapshot", str(snapshot), *ports, state=state, env=env)
    if serving_config is None:
        return vm("restore", "--variant", variant, *ports, state=state, env=env)
    sdir = serving_snapshot(serving_config, wheelhouse, variant, node, variant_env)
    say(f"restoring a VM whose engine already serves this stack's runtime ({sdir}); `pulumi up` adopts it")
    return vm("restore", "--snapshot", str(sdir), *ports, state=state, env=env)


def stop_vm(state: Path) -> None:
    vm("stop", state=state, check=False)


def fimfleet_pulumi(*args, capture=True, check=True, input=None, timeout=3600) -> str:
    return run([ROOT / "fimfleet", "pulumi", *args], capture=capture, check=check, input=input, timeout=timeout)


def stack_config(config_file: Path, state: Path | None, model_dir: str, extra: dict | None = None,
                 stack: str = "local") -> Path:
    """A local stack's config (stacks/Pulumi.<stack>.yaml), with generated keys kept across runs.
    `state`: the one VM of a single-node stack (a fleet names its VMs in `extra`, per node)."""
    fresh = not config_file.exists()
    if fresh:
        config_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "stacks" / f"Pulumi.{stack}.yaml", config_file)
    fimfleet_pulumi("stack", "select", "--create", stack)
    cf = ["--config-file", str(config_file), "-s", stack]
    if state is not None:
        fimfleet_pulumi("config", "set", "--path", "fimfleet:host.testbedState", str(state), *cf)
    fimfleet_pulumi("config", "set", "--path", "fimfleet:model.localPath", model_dir, *cf)
    if fresh:
        for name in KEY_NAMES:
            fimfleet_pulumi("config", "set", "--secret", "--path", f"fimfleet:apiKeys.{name}",
                            "fimfleet-" + secrets.token_urlsafe(24), *cf)
    for k, v in (extra or {}).items():
        fimfleet_pulumi("config", "set", "--path", k, str(v), *cf)
    return config_file


def backend_dir() -> Path:
    """The file backend that ./fimfleet uses (FIMFLEET_BACKEND_URL, else .state), resolved as it
    resolves it: ~ is the home, a relative path the caller's, a query no part of the path. Not
    FIMFLEET_PULUMI_BACKEND_URL: an outer ./fimfleet set that one, before a test named its own."""
    url = os.environ.get("FIMFLEET_BACKEND_URL") or f"file://{ROOT / '.state'}"
    return Path(os.path.expanduser(url[len("file://"):].split("?", 1)[0])).absolute()


def clear_stale_lock(stack: str = "local") -> bool:
    """A CLI killed mid-update (laptop asleep, CI runner gone) leaves its lock behind. For the local
    test stacks only, a lock whose process no longer runs on this machine is cancelled, and said so;
    any other stack is never unlocked behind the user's back (Pulumi names `pulumi cancel` itself)."""
    import socket

    for lock in sorted(backend_dir().glob(f".pulumi/locks/**/{stack}/*.json")):
        try:
            info = json.loads(lock.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        pid, host = int(info.get("pid", 0) or 0), info.get("hostname", "")
        if host != socket.gethostname() or pid <= 0 or Path(f"/proc/{pid}").exists():
            continue
        say(f"stack {stack} was left locked by process {pid}, which no longer runs (a killed `pulumi up`?): "
            f"running `pulumi cancel -s {stack}`; the next up converges")
        fimfleet_pulumi("cancel", "-s", stack, "--yes")
        return True
    return False


def up(config_file: Path, *extra: str, check=True, stack: str = "local") -> subprocess.CompletedProcess:
    argv = [ROOT / "fimfleet", "pulumi", "up", "-s", stack, "--yes", "--non-interactive", "--skip-preview",
            "--config-file", config_file, *extra]
    return subprocess.run([str(a) for a in argv], cwd=ROOT, text=True, check=check)


def destroy(config_file: Path, *extra: str, check=True, stack: str = "local",
            capture=False) -> subprocess.CompletedProcess:
    argv = [ROOT / "fimfleet", "pulumi", "destroy", "-s", stack, "--yes", "--non-interactive", "--skip-preview",
            "--config-file", config_file, *extra]
    return subprocess.run([str(a) for a in argv], cwd=ROOT, text=True, check=check, capture_output=capture)


def previous_outputs() -> dict:
    """The local stack's outputs before this run ({} for a new or empty stack)."""
    proc = subprocess.run([str(ROOT / "fimfleet"), "pulumi", "stack", "output", "-s", "local", "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}


def outputs(config_file: Path, show_secrets=False, stack: str = "local") -> dict:
    args = ["stack", "output", "-s", stack, "--json"] + (["--show-secrets"] if show_secrets else [])
    return json.loads(fimfleet_pulumi(*args))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", type=Path, default=CACHE / "testbed" / "vms" / "demo", help="the VM's state directory")
    ap.add_argument("--config-file", type=Path, default=WORK / "Pulumi.local.yaml")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    paths = prepare()
    cfg = stack_config(a.config_file, a.state, paths["model_dir"])
    info = start_vm(a.state, paths["wheelhouse"], serving_config=cfg)
    say(f"VM up: ssh -p {info['ssh']['port']} -i {info['ssh']['key']} root@127.0.0.1")
    clear_stale_lock()
    before = previous_outputs().get("slaReport")
    say("pulumi up -s local (engine start under emulation takes several minutes)")
    if up(cfg, check=False).returncode != 0:
        # Pulumi has printed what failed; a traceback of this script would only bury it.
        raise SystemExit("fimfleet demo: pulumi up -s local failed (its output above says why). Fix it and "
                         "rerun ./fimfleet demo: it converges on the same VM and state.")
    out = outputs(cfg, show_secrets=True)
    print(f"\nendpoint: {out['endpoint']}\nmodel:    {out['model']}\n")
    report = out.get("slaReport")
    if report and report == before:
        print("SLA report from an earlier run on this same, unchanged host and deployment "
              "(nothing changed, so it was not measured again):")
    elif report:
        print("SLA report, measured in this run through the ingress:")
    print(report or "(no SLA report)")
    # The stack's first user now: a revoked user has no editor config (and KEY_NAMES only seeds new stacks).
    user = sorted(out["editorConfigs"])[0]
    print(f"\nContinue.dev config for {user} (~/.continue/config.yaml; every key has its own, "
          f"see `pulumi stack output editorConfigs --show-secrets`):\n")
    print(out["editorConfigs"][user]["continueYaml"])
    ca = WORK / "fimfleet-ca.pem"
    ca.write_text(out["caPem"])
    print(f"smoke test (CA in {ca}; export FIMFLEET_KEY from the config above):\n  "
          + out["curlSmokeTest"].replace("fimfleet-ca.pem", str(ca)))
    say(f"done in {time.monotonic() - t0:.0f} s; stop the VM with: python3 {VM_PY} stop --state {a.state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
