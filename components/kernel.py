"""KernelTuning: sysctl, THP, limits and network settings for CPU inference, applied and verified.

Values are pure functions of the tier; the component renders them from files/kernel/
and applies them in one RemoteStep whose `check` reads the live values back, so
`pulumi up --refresh` finds hand-made drift and the next apply repairs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi

from components import templates
from components.remote import RemoteStep

SYSCTL_PATH = "/etc/sysctl.d/90-fimfleet.conf"
LIMITS_PATH = "/etc/security/limits.d/90-fimfleet.conf"
UNIT_PATH = "/etc/systemd/system/fimfleet-tuning.service"
APPLY_SCRIPT = "/usr/local/lib/fimfleet/kernel-tuning.sh"
MODULES_PATH = "/etc/modules-load.d/fimfleet.conf"
STATE_DIR = "/var/lib/fimfleet/kernel"
"""The values recorded before fimfleet's first change (defaults.conf), which destroy restores."""
STAGED_DIR = f"{STATE_DIR}/staged"
"""Where the step uploads its files: the apply installs them only once the host passed its checks,
so a first apply refused there (a sysctl this kernel lacks) leaves nothing for the next boot."""
THP = "/sys/kernel/mm/transparent_hugepage"


@dataclass(frozen=True)
class KernelArgs:
    """What KernelTuning needs: the stack's own sysctl values on top of the tuned ones."""

    sysctl_overrides: dict[str, str] = field(default_factory=dict)
    """fimfleet:kernel.sysctl, already checked against the sysctl name grammar."""


def args_for(cfg) -> KernelArgs:
    """A validated StackConfig's kernel section as KernelArgs."""
    return KernelArgs(sysctl_overrides={k: str(v) for k, v in (cfg.kernel.sysctl or {}).items()})


def tuned_sysctl(args: KernelArgs) -> dict[str, str]:
    """The tuned sysctl values, then the stack's own overrides."""
    values = {
        # Weights are mmapped in many regions; the default 65530 maps is too few for 14B+.
        "vm.max_map_count": "1048576",
        # torch reserves large virtual ranges up front.
        "vm.overcommit_memory": "1",
        # Never page out weights or the KV cache; the engine's cgroup also forbids swap.
        "vm.swappiness": "1",
        "vm.vfs_cache_pressure": "50",
        "vm.dirty_background_ratio": "5",
        "vm.dirty_ratio": "10",
        # Reclaiming a local node instead of allocating remotely stalls decode on NUMA boxes.
        "vm.zone_reclaim_mode": "0",
        "fs.file-max": "2097152",
        # SSE streams: pace with fq + BBR, keep the window open between editor keystrokes.
        "net.core.default_qdisc": "fq",
        "net.ipv4.tcp_congestion_control": "bbr",
        "net.core.rmem_max": "16777216",
        "net.core.wmem_max": "16777216",
        "net.ipv4.tcp_rmem": "4096 87380 16777216",
        "net.ipv4.tcp_wmem": "4096 65536 16777216",
        "net.ipv4.tcp_slow_start_after_idle": "0",
        "net.ipv4.tcp_notsent_lowat": "16384",
        "net.core.somaxconn": "4096",
        "net.core.netdev_max_backlog": "16384",
        "net.ipv4.tcp_max_syn_backlog": "8192",
    }
    values.update(args.sysctl_overrides)
    return values


def tuned_sysfs() -> dict[str, str]:
    """THP only where the engine asks for it (madvise), and no compaction stalls from khugepaged."""
    return {f"{THP}/enabled": "madvise", f"{THP}/defrag": "madvise", f"{THP}/khugepaged/defrag": "0"}


def tuned_debugfs() -> dict[str, str]:
    """kernel.sched_migration_cost_ns left sysctl in Linux 5.13; it now lives in debugfs."""
    return {"/sys/kernel/debug/sched/migration_cost_ns": "5000000"}


LIMITS = {"memlock": "unlimited", "nofile": "1048576", "nproc": "65535", "stack": "16384"}
MODULES = ("tcp_bbr",)


@dataclass(frozen=True)
class RenderedKernel:
    installed: list[dict]
    """The files as the apply installs them: {path, mode, content}."""
    files: list[dict]
    """What the step uploads: each of `installed`, staged under STAGED_DIR."""
    apply: str
    check: str
    destroy: str
    sysctl: dict[str, str]


def render(args: KernelArgs) -> RenderedKernel:
    sysctl, sysfs, debugfs = tuned_sysctl(args), tuned_sysfs(), tuned_debugfs()
    paths = dict(sysctl_path=SYSCTL_PATH, limits_path=LIMITS_PATH, unit_path=UNIT_PATH,
                 apply_script=APPLY_SCRIPT, modules_path=MODULES_PATH, staged_dir=STAGED_DIR,
                 state_dir=STATE_DIR)
    verify = templates.render("kernel/verify.sh.j2", sysctl=sysctl, sysfs=sysfs, limits=LIMITS, **paths)
    installed = [
        {"path": SYSCTL_PATH, "mode": "0644", "content": templates.render("kernel/sysctl.conf.j2", sysctl=sysctl)},
        {"path": LIMITS_PATH, "mode": "0644", "content": templates.render("kernel/limits.conf.j2", limits=LIMITS)},
        {"path": UNIT_PATH, "mode": "0644", "content": templates.render("kernel/tuning.service.j2", **paths)},
        {"path": APPLY_SCRIPT, "mode": "0755",
         "content": templates.render("kernel/tuning-apply.sh.j2", sysfs=sysfs, debugfs=debugfs)},
        {"path": MODULES_PATH, "mode": "0644", "content": "".join(m + "\n" for m in MODULES)},
    ]
    # installed[0] is the sysctl file: the apply tries its values live before it installs any
    installs = [{"name": f"{i}-{f['path'].rsplit('/', 1)[-1]}", "dest": f["path"], "mode": f["mode"]}
                for i, f in enumerate(installed)]
    files = [{"path": f"{STAGED_DIR}/{i['name']}", "mode": "0600", "content": f["content"]}
             for i, f in zip(installs, installed)]
    return RenderedKernel(
        installed=installed,
        files=files,
        apply=templates.render("kernel/apply.sh.j2", sysctl=sysctl, sysfs={**sysfs, **debugfs}, modules=MODULES,
                               verify=verify, installs=installs, sysctl_staged=installs[0]["name"], **paths),
        check=verify,
        destroy=templates.render("kernel/destroy.sh.j2", **paths),
        sysctl=sysctl,
    )


def digest_of(args: KernelArgs) -> str:
    """The tuning as deployed (its files hold every value): a change is measured again by the SLA
    gate, and rolled. A change to how the apply works alone rolls nothing."""
    return templates.digest(render(args).installed)


class KernelTuning(pulumi.ComponentResource):
    """Applies the tier's kernel settings over SSH, then reads them back; see module docstring."""

    def __init__(self, name: str, args: KernelArgs, connection: pulumi.Input[dict],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("fimfleet:kernel:KernelTuning", name, None, opts)
        r = render(args)
        self.digest = digest_of(args)
        self.step = RemoteStep(f"{name}-apply", label="kernel tuning", connection=connection,
                               files=r.files, apply=r.apply, check=r.check, destroy=r.destroy,
                               opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"digest": self.digest})
