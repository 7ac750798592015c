"""Rendered host files pass real tools: systemd-analyze verify, bash -n, shellcheck,
and a list of the kernel's sysctl names."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from components import config, grammar, host, kernel, monitor, nginx_base, remote, runtime, watchdog
from components.ingress import args_for as ingress_args
from components.ingress import render_files as ingress_files
from components.ingress import step_scripts as ingress_scripts
from tests.helpers import raw_config

KNOWN_SYSCTLS = grammar.known_sysctls()
# Installed on the host by earlier steps (the venv, fimfleet's scripts, the docker.io package).
INSTALLED_BY_FIMFLEET = ("/opt/fimfleet/", "/usr/local/lib/fimfleet/", "/usr/bin/docker")


def cfg_for(tier="cpu-epyc-prod", **sections):
    raw, secret = raw_config(tier, **sections)
    return config.parse(raw, secret)


def verify_unit(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    problems = []
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.search(r"Command (\S+) is not executable", line)
        if m and m.group(1).startswith(INSTALLED_BY_FIMFLEET):
            continue
        if "Unit docker.service not found" in line:
            continue
        if line.strip():
            problems.append(line)
    assert not problems, f"{name}:\n" + "\n".join(problems)


def units(cfg, node="node"):
    r = runtime.render(cfg, node)
    kr = kernel.render(kernel.args_for(cfg))
    m = {f["path"].rsplit("/", 1)[-1]: f["content"] for f in monitor.render_files(monitor.args_for(cfg, node), r.unit, "k" * 32, "CA")}
    engine_unit = r.unit_file.replace("[Install]", r.cgroup_dropin.split("[Service]", 1)[1].strip() + "\n\n[Install]")
    yield r.unit, engine_unit
    yield "fimfleet-tuning.service", next(f["content"] for f in kr.installed if f["path"] == kernel.UNIT_PATH)
    for name in (monitor.names(node)["service"], monitor.names(node)["timer"]):
        yield name, m[name]


VARIANTS = {
    "cpu-systemd": ("cpu-epyc-prod", {}),
    "gpu-docker": ("gpu-l40s", {}),
    "cpu-docker-tcmalloc-watchdog": ("cpu-epyc-7b-int8", {"runtime": {"kind": "docker", "allocator": "tcmalloc"},
                                                          "monitor": {"watchdog": True}}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_units_pass_systemd_analyze_verify(variant, tmp_path):
    tier, sections = VARIANTS[variant]
    for name, content in units(cfg_for(tier, **sections)):
        verify_unit(tmp_path, name, content)


def test_verify_catches_a_broken_unit(tmp_path):
    with pytest.raises(AssertionError, match="Unknown key"):
        verify_unit(tmp_path, "broken.service", "[Service]\nExecStart=/bin/true\nMemorySwapMaximum=0\n")


def scripts(cfg):
    kr = kernel.render(kernel.args_for(cfg))
    yield "kernel-apply", kr.apply
    yield "kernel-check", kr.check
    yield "kernel-destroy", kr.destroy
    yield "kernel-tuning", next(f["content"] for f in kr.installed if f["path"] == kernel.APPLY_SCRIPT)
    yield "preflight", host.preflight_script(cfg)
    from components import templates

    yield "packages", templates.render("host/packages.sh.j2", packages=host.packages(cfg))
    yield "packages-destroy", templates.render("host/packages-destroy.sh.j2")
    r = runtime.render(cfg, "node")
    for step, body in runtime.scripts(cfg, "node").items():
        yield f"runtime-{step}", body
    wheelhouse = cfg_for(cfg.tier.name, runtime={"wheelhouseUrl": "http://10.0.2.2:8000/"}) if cfg.tier.device == "cpu" else cfg
    yield "install-venv-wheelhouse", runtime.scripts(wheelhouse, "node")["install"]
    docker = cfg_for("cpu-epyc-7b-int8", runtime={"kind": "docker"})
    yield "pull-image", runtime.scripts(docker, "node")["install"]
    acme = cfg_for(cfg.tier.name, ingress={"tls": "acme", "domain": "example.com", "acmeEmail": "ops@example.com"})
    for c, tag in ((cfg, ""), (acme, "-acme")):
        for step, body in ingress_scripts(ingress_args(c), ingress_files(ingress_args(c), "example.com", "CERT", "KEY")[1]).items():
            yield f"ingress-{step}{tag}", body
    n = nginx_base.render(nginx_base.NginxBase())
    for t in ("apply", "check", "destroy"):
        yield f"host-nginx-{t}", getattr(n, t)
    for t, body in monitor.scripts(monitor.args_for(cfg, "node"), r.unit).items():
        yield f"monitor-{t}", body
    w = watchdog.render()
    for t in ("apply", "check", "destroy"):
        yield f"watchdog-{t}", getattr(w, t)
    for f in ("fim-probe.sh", "recover.sh"):
        yield f, (templates.FILES / "monitor" / f).read_text()


@pytest.mark.parametrize("tier", ["cpu-epyc-prod", "gpu-l40s"])
def test_scripts_pass_bash_n_and_shellcheck(tier, tmp_path):
    assert shutil.which("shellcheck"), "shellcheck is installed by ./fimfleet bootstrap"
    cfg = cfg_for(tier)
    for name, body in scripts(cfg):
        path = tmp_path / f"{name}.sh"
        # RemoteStep prepends `set -euo pipefail` and runs the script with bash.
        path.write_text("#!/bin/bash\nset -euo pipefail\n" + body if not body.startswith("#!") else body)
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{name}: {syntax.stderr}"
        # an apply runs inside a subshell, its marker after it (remote._then_mark): that parses too
        wrapped = subprocess.run(["bash", "-n"], input=remote._then_mark(body, "id", "digest"), capture_output=True, text=True)
        assert wrapped.returncode == 0, f"{name} as an apply: {wrapped.stderr}"
        lint = subprocess.run(["shellcheck", "-S", "warning", "-s", "bash", str(path)], capture_output=True, text=True)
        assert lint.returncode == 0, f"{name}:\n{lint.stdout}"


def test_shellcheck_catches_a_bad_script(tmp_path):
    path = tmp_path / "bad.sh"
    path.write_text("#!/bin/bash\nrm -rf $dir/\n[ $x = 1 ]\n")
    assert subprocess.run(["shellcheck", "-S", "warning", str(path)], capture_output=True).returncode != 0


def test_sysctl_file_uses_only_known_keys():
    cfg = cfg_for()
    content = next(f["content"] for f in kernel.render(kernel.args_for(cfg)).installed if f["path"] == kernel.SYSCTL_PATH)
    keys = [l.split("=", 1)[0].strip() for l in content.splitlines() if l and not l.startswith("#")]
    assert keys and set(keys) <= KNOWN_SYSCTLS, set(keys) - KNOWN_SYSCTLS
    # The scheduler knob moved to debugfs in Linux 5.13: it must not be written as a sysctl.
    assert "kernel.sched_migration_cost_ns" not in keys


def test_sysctl_override_reaches_the_file_and_the_verify_script():
    cfg = cfg_for(kernel={"sysctl": {"vm.swappiness": "7"}})
    r = kernel.render(kernel.args_for(cfg))
    assert "vm.swappiness = 7" in next(f["content"] for f in r.installed if f["path"] == kernel.SYSCTL_PATH)
    assert "want_sysctl vm.swappiness 7\n" in r.check


def test_engine_unit_is_loopback_only_and_hardened():
    r = runtime.render(cfg_for(), "node")
    assert "--host 127.0.0.1" in r.unit_file
    for directive in ("NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "LimitMEMLOCK=infinity",
                      "CPUAffinity=1-31", "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"):
        assert directive in r.unit_file, directive
    assert "MemorySwapMax=0" in r.cgroup_dropin and "OOMPolicy=kill" in r.cgroup_dropin
    assert "VLLM_CPU_KVCACHE_SPACE=16" in r.env_file


@pytest.mark.parametrize("kind", ["systemd", "docker"])
def test_the_unit_steps_check_names_every_file_the_step_uploads(kind):
    cfg = cfg_for("cpu-epyc-7b-int8", runtime={"kind": kind})
    args = runtime.args_for(cfg, "node")
    uploaded = [f["path"] for f in args.service_files]
    assert len(uploaded) == (4 if kind == "docker" else 3)
    listed = next(line for line in args.scripts["unit_check"].splitlines() if line.startswith("for f in "))
    assert shlex.split(listed[len("for f in "):].split(";")[0]) == uploaded


def test_gpu_container_requests_gpus():
    r = runtime.render(cfg_for("gpu-l40s"), "node")
    assert "--gpus all" in r.unit_file and "vllm/vllm-openai:v0.32.0" in r.unit_file
    assert "--tensor-parallel-size 1" in r.unit_file and "--gpu-memory-utilization 0.9" in r.unit_file


def test_engine_start_reports_progress_with_the_engines_last_log_line(tmp_path):
    """`pulumi up` shows these lines live (components/ssh.py PROGRESS_PREFIX) instead of minutes of dots."""
    from components import ssh, templates

    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {"systemctl": "exit 0", "curl": "exit 7",
                       "journalctl": "echo 'INFO Loading weights took 1.20 seconds'"}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    unit_file = tmp_path / "unit"
    unit_file.write_text("[Service]\n")
    script = templates.render("runtime/start.sh.j2", unit="vllm-node.service", served_name="m", port=8000,
                              timeout_s=3, poll_s=1, report_every_s=1, ready_body="{}", container="c",
                              env_file="/e", venv="/v", user="u", state_dir="/s", cache_dir="/c", kind="systemd",
                              stamp=str(tmp_path / "stamp"), files=[str(unit_file)])
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{stubs}:/usr/bin:/bin"})
    progress = [l for l in proc.stderr.splitlines() if l.startswith(ssh.PROGRESS_PREFIX)]
    assert proc.returncode == 1 and "did not answer a completion within 3 s" in proc.stderr
    assert progress and "s elapsed" in progress[0] and "s left of 3" in progress[0], proc.stderr
    assert progress[0].endswith("engine: INFO Loading weights took 1.20 seconds"), progress


def _start_with_stubs(tmp_path, stamp_text: str | None, unit_text="[Service]\n"):
    """start.sh against stub systemctl/curl (the engine is active and answers); returns (proc, systemctl calls)."""
    from components import templates

    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir(exist_ok=True)
    for name, body in {"systemctl": f'echo "$*" >> {calls}; exit 0',
                       "curl": "echo '{\"choices\": [{\"text\": \"x\"}]}'", "journalctl": "true"}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    unit_file, stamp = tmp_path / "unit", tmp_path / "stamp"
    unit_file.write_text(unit_text)
    if stamp_text is not None:
        stamp.write_text(stamp_text)
    script = templates.render("runtime/start.sh.j2", unit="vllm-node.service", served_name="m", port=8000,
                              timeout_s=3, poll_s=1, ready_body="{}", container="c", env_file="/e", venv="/v",
                              user="u", state_dir="/s", cache_dir="/c", kind="systemd", stamp=str(stamp),
                              files=[str(unit_file)])
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{stubs}:/usr/bin:/bin"})
    return proc, calls.read_text().splitlines()


def test_an_engine_serving_the_same_files_is_adopted_not_restarted(tmp_path):
    import hashlib

    proc, calls = _start_with_stubs(tmp_path, hashlib.sha256(b"[Service]\n").hexdigest() + "\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"ready_after_s": 0, "adopted": True}
    assert not any(c.startswith("restart") for c in calls), calls


def test_changed_files_or_no_record_restart_the_engine_and_record_what_it_started_with(tmp_path):
    import hashlib

    for i, stamp in enumerate((None, hashlib.sha256(b"[Service]\nold\n").hexdigest())):
        d = tmp_path / str(i)
        d.mkdir()
        proc, calls = _start_with_stubs(d, stamp)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["adopted"] is False
        assert "restart vllm-node.service" in calls, calls
        assert (d / "stamp").read_text().strip() == hashlib.sha256(b"[Service]\n").hexdigest()


# a reader that may stop before its writer is done: `grep -q`, `grep -m`, `head`
EARLY_EXIT_READER = re.compile(r"\|\s*(grep\s+(-\w*[qm]\w*\b)|head\b)")


def test_no_shell_template_pipes_into_a_reader_that_stops_early():
    """Every remote script runs under `set -o pipefail` (components/ssh.py): when the reader of
    a pipe exits early, the writer dies of SIGPIPE or a write error (curl: exit 23) and the whole
    pipeline fails at random with the writer's output size. This failed Prometheus's check on the
    VM. Read into a variable first (`grep -q PATTERN <<<"$out"`)."""
    from components import templates

    offenders = []
    for path in sorted(p for p in templates.FILES.rglob("*") if p.suffix in (".j2", ".sh") and p.is_file()):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
            if EARLY_EXIT_READER.search(code):
                offenders.append(f"{path.relative_to(templates.FILES)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_early_exit_rule_catches_the_pattern():
    assert EARLY_EXIT_READER.search("curl -fsS http://x/metrics | grep -q '^up 1'")
    assert EARLY_EXIT_READER.search("sed -n p f | head -n1")
    assert not EARLY_EXIT_READER.search("grep -q '^up 1' <<<\"$metrics\"")


def test_the_bandwidth_step_output_is_read_back_and_a_missing_figure_is_none():
    line = '{"bandwidth_bytes_per_s": 13702047957.0, "processes": 2}'
    assert runtime.reported(f"noise\n{line}\n", "bandwidth_bytes_per_s") == 13702047957.0
    assert runtime.reported("", "bandwidth_bytes_per_s") is None
    assert runtime.reported('{"bandwidth_bytes_per_s": 0}', "bandwidth_bytes_per_s") is None


METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="False",num_cpu_blocks="None",num_gpu_blocks="16384"} 1.0
vllm:num_requests_running{engine="0"} 0.0
"""


@pytest.mark.parametrize("metrics, tokens", [(METRICS, 16384 * 128), ("vllm:num_requests_running 0.0\n", None)])
def test_the_kv_capacity_step_reads_what_vllm_allocated(tmp_path, metrics, tokens):
    """files/runtime/kv-capacity.sh.j2 against a stub curl serving vLLM's own metric line."""
    cfg = cfg_for()
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (tmp_path / "metrics").write_text(metrics)
    (stubs / "curl").write_text(f"#!/bin/sh\ncat {tmp_path / 'metrics'}\n")
    (stubs / "curl").chmod(0o755)
    script = runtime.scripts(cfg, "node")["kv_capacity"]
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{stubs}:/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert runtime.reported(proc.stdout, "kv_cache_tokens") == tokens


@pytest.mark.parametrize("answers, code, said", [
    (["lock", "lock", "ok"], 0, "waiting for it"),        # apt-daily held the lists lock for a while
    (["Temporary failure resolving"], 1, "Temporary failure resolving"),  # anything else fails at once
    (["lock"] * 60, 1, "held apt's lock for 5 minutes"),
])
def test_apt_update_waits_for_another_apt_runs_lock_and_only_for_that(answers, code, said, tmp_path):
    """A fresh cloud host runs apt-daily at boot: `apt-get update` failed at once on its lists
    lock (DPkg::Lock::Timeout covers dpkg's lock only)."""
    from components import templates

    helper = templates.render("host/apt-update.sh.j2")
    calls = tmp_path / "calls"  # apt_update runs apt-get in a command substitution: count in a file
    calls.write_text("0")
    script = (f"answers=({' '.join(repr(a) for a in answers)}); calls={calls}; apt_opts=(-q)\n"
              "apt-get() { local n; n=$(<\"$calls\"); echo $((n + 1)) >\"$calls\"; local a=${answers[n]}; case $a in ok) return 0 ;;"
              " lock) echo 'E: Could not get lock /var/lib/apt/lists/lock. It is held by process 99 (apt-get)' >&2 ;;"
              " *) echo \"E: $a\" >&2 ;; esac; return 100; }\nsleep() { :; }\n"
              f"{helper}\napt_update; rc=$?; echo \"calls=$(<\"$calls\")\"; exit $rc\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == code and said in r.stderr, r.stderr
    assert r.stdout.strip() == f"calls={len(answers)}"
    assert r.stderr.count("waiting for it") == (1 if answers[0] == "lock" else 0)
