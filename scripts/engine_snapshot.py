"""A test-VM snapshot whose vLLM engine already serves the local stack's runtime.

The engine start under emulation is most of a fresh deploy (about 8 minutes), and only the
runtime's files decide what the engine runs. So the engine is started once, with the
runtime's own rendered steps (components/runtime.py: venv, model, unit files, start.sh),
after the host's packages, on a VM restored from the image's booted snapshot, and that VM
is frozen again (RAM and disk). A VM restored from it serves at once; `pulumi up` then deploys everything as on
a fresh host, and start.sh adopts the engine because it already runs exactly these files
(recorded after its start) instead of starting it a second time.

Cached under $FIMFLEET_CACHE/testbed/serving/<key>, keyed by the booted snapshot and
everything that reaches the engine; built under a lock, so two runs at once build it once.
"""

from __future__ import annotations

import fcntl
import functools
import json
import secrets
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components import config, host, runtime, ssh, templates, upload  # noqa: E402

NODE = "node"  # __main__.py's single node; a fleet's other nodes name their own


def say(msg: str) -> None:
    print(f"fimfleet: serving snapshot: {msg}", file=sys.stderr, flush=True)


def stack_config(config_file: Path, vm_state: Path) -> config.StackConfig:
    """The runtime-relevant part of a local stack file (its secrets stay encrypted and unread)."""
    doc = yaml.safe_load(config_file.read_text()).get("config") or {}
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in doc.items()
              if k.startswith(config.NAMESPACE + ":") and not (isinstance(v, dict) and "secure" in v)}
    raw_host = json.loads(values.get("fimfleet:host", "{}"))
    values["fimfleet:host"] = json.dumps({**raw_host, "testbedState": str(vm_state)})
    values["fimfleet:apiKeys"] = json.dumps({"snapshot": "fimfleet-" + secrets.token_urlsafe(24)})
    return config.from_mapping(values, frozenset({"fimfleet:apiKeys"}))


def _steps(cfg: config.StackConfig, node: str = NODE) -> dict:
    r = runtime.render(cfg, node)
    return {"node": node, "packages": templates.render("host/packages.sh.j2", packages=host.packages(cfg)),
            # only what the engine's start runs: a changed check or destroy script keeps the snapshot
            "scripts": {k: v for k, v in runtime.scripts(cfg, node).items() if k in ("install", "model", "start")},
            "files": runtime.service_files(node, r),
            "lock": runtime.LOCK_FILE.read_text(), "model": cfg.model.local_path, "kind": cfg.runtime.kind,
            "remote_model": runtime.model_path(cfg)}


def snapshot_key(base: dict, steps: dict) -> str:
    """The booted snapshot it grows from, and everything that reaches the engine or its host's
    records (the docker runtime's pull step decides which images destroy removes)."""
    return templates.digest(base["dir"], base.get("created_at"), steps["packages"], steps["scripts"],
                            steps["files"], steps["lock"], steps["remote_model"], upload.dir_digest(steps["model"]))


def _run(client, what: str, script: str, timeout_s: float, node: str) -> str:
    t0 = time.monotonic()
    what = f"{node}'s {what}"
    say(f"{what} ...")
    code, out, err = ssh.run(client, script, timeout_s=timeout_s, label=f"serving snapshot: {what}")
    if code:
        raise RuntimeError(f"serving snapshot: {what} failed (exit {code}):\n{(err or out)[-2000:]}")
    say(f"{what}: done in {time.monotonic() - t0:.0f} s")
    return out


def provision(vm_state: Path, steps: dict, start_timeout_s: float, who: str) -> str:
    """The host's packages (the engine preloads jemalloc from them), then the runtime's steps in
    the order VllmRuntime runs them; returns start.sh's output. `who` names it in progress lines."""
    sh = steps["scripts"]
    run = functools.partial(_run, node=who)
    with ssh.session(ssh.SshTarget.from_props(host.testbed_connection(str(vm_state)))) as client:
        run(client, "packages", steps["packages"], 1800)
        if steps["kind"] == "systemd":
            upload.put_files(client, [{"path": runtime.REMOTE_LOCK, "mode": "0644", "content": steps["lock"]}])
        run(client, "vLLM virtualenv" if steps["kind"] == "systemd" else "engine image pull", sh["install"], 3600)
        upload.put_dir(client, steps["model"], steps["remote_model"])
        run(client, "model", sh["model"], 600)
        upload.put_files(client, steps["files"])
        say(f"starting {who}'s engine once (under emulation this takes several minutes; progress follows)")
        return run(client, "engine start", sh["start"], start_timeout_s + 120)


def _in_use(path: Path) -> bool:
    """A VM restored from it still runs (its disk backs that VM's overlay)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path) in cmdline.read_bytes().decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _kind(sdir: Path) -> tuple[str, str] | None:
    """The image variant a snapshot grew from and the engine unit it serves (None: no readable
    manifest, a broken one)."""
    try:
        saved = json.loads((sdir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return saved.get("variant"), (saved.get("label") or {}).get("engine")


def _locate(vm, config_file: Path, cache: Path, env: dict, variant: str, node: str) -> tuple:
    """(builder VM state, config, steps, snapshot dir): where this stack's serving snapshot is or goes."""
    root = cache / "testbed" / "serving"
    root.mkdir(parents=True, exist_ok=True)
    build_state = root / f"builder-{secrets.token_hex(4)}"
    base = vm("snapshot", "--variant", variant, state=build_state, env=env)
    cfg = stack_config(config_file, build_state)
    steps = _steps(cfg, node)
    return build_state, cfg, steps, root / snapshot_key(base, steps)


def cached(vm, config_file: Path, cache: Path, env: dict, variant: str = "vllm", node: str = NODE) -> bool:
    """Whether ensure() would find it built (the image and its booted snapshot are built if missing)."""
    return (_locate(vm, config_file, cache, env, variant, node)[-1] / "manifest.json").exists()


def ensure(vm, config_file: Path, cache: Path, env: dict, variant: str = "vllm", node: str = NODE) -> Path:
    """The serving snapshot for this stack file, built if missing. `vm` runs vm.py (local_deploy.vm);
    `variant`: the image it grows from (vllm: the venv is there; docker: dockerd is, and the
    engine image is pulled from the stack's runtime.image, so that registry must answer;
    docker-engine: dockerd holds that image already, toolchain/testbed/variants/docker-engine.sh).
    `node`: the node whose engine it serves (its unit carries the node's name)."""
    build_state, cfg, steps, sdir = _locate(vm, config_file, cache, env, variant, node)
    if (sdir / "manifest.json").exists():
        return sdir
    # Two may build at once (scripts/local_fleet.py, tests/e2e/local_stack.py): name which in progress lines.
    who = node if variant == "vllm" else f"{node} ({variant})"
    with open(f"{sdir}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (sdir / "manifest.json").exists():
            return sdir
        t0 = time.monotonic()
        say(f"building {sdir} for {who} (once per runtime change): restoring the booted VM")
        try:
            vm("restore", "--variant", variant, state=build_state, env=env)
            out = provision(build_state, steps, cfg.runtime.start_timeout_s, who)
            started = json.loads(out.strip().splitlines()[-1])
            vm("save", "--to", str(sdir), "--label", json.dumps({"engine": runtime.unit_name(node), **started}),
               state=build_state)
        finally:
            vm("stop", "--purge", state=build_state, check=False)
        say(f"built for {who} in {time.monotonic() - t0:.0f} s (engine ready after {started['ready_after_s']} s)")
    prune(sdir.parent, sdir, variant, node)
    return sdir


def prune(root: Path, keep: Path, variant: str, node: str) -> None:
    """Delete the older snapshots of this variant and node (a runtime that no longer deploys);
    another node's, another variant's and one a running VM uses stay."""
    for stale in root.iterdir():
        if stale.is_dir() and stale != keep and "." not in stale.name and not stale.name.startswith("builder-") \
                and _kind(stale) in ((variant, runtime.unit_name(node)), None) and not _in_use(stale):
            shutil.rmtree(stale, ignore_errors=True)
