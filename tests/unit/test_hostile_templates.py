"""One quoting rule: every value rendered into a shell script goes through the `q` filter.

Static: every `{{ ... }}` in a shell template (files/**/*.sh.j2, and monitor.env.j2, which
root sources) ends in `| q` or `| int`, or names a script rendered by fimfleet itself.
Dynamic: the templates are rendered with hostile values (`;`, `$(...)`, backticks, quotes,
newlines) and executed with bash in a private mount namespace, with every external
command stubbed out; the payloads use only bash builtins, and none of them may run. Each
template is rendered twice: with realistic shapes (hostile_renders), and with the payload as
every value it takes, so a new template is covered the day it is added (hostile_everywhere).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import jinja2
import pytest
from jinja2 import meta, nodes

from components import templates

SHELL_TEMPLATES = sorted(p.relative_to(templates.FILES).as_posix() for p in templates.FILES.rglob("*.j2")
                         if p.name.endswith(".sh.j2") or p.name == "monitor.env.j2")
SAFE_FILTERS = {"q", "int"}
PRE_RENDERED = {"verify", "check"}
"""Whole scripts rendered from other templates (each checked here on its own), pasted in as they are."""


def unquoted_expressions(name: str) -> list[str]:
    env = templates.environment()
    tree = env.parse(env.loader.get_source(env, name)[0])
    bad = []
    for out in tree.find_all(nodes.Output):
        for node in out.nodes:
            if isinstance(node, nodes.TemplateData):
                continue
            if isinstance(node, nodes.Const):
                continue  # a literal, e.g. {{ "{{" }}
            if isinstance(node, nodes.Filter) and node.name in SAFE_FILTERS:
                continue
            if isinstance(node, nodes.Name) and node.name in PRE_RENDERED:
                continue
            bad.append(f"line {node.lineno}: {{{{ {_src(node)} }}}}")
    return bad


def _src(node) -> str:
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Getattr):
        return f"{_src(node.node)}.{node.attr}"
    if isinstance(node, nodes.Filter):
        return f"{_src(node.node)} | {node.name}"
    return type(node).__name__


def test_shell_templates_exist():
    assert len(SHELL_TEMPLATES) >= 15, SHELL_TEMPLATES


@pytest.mark.parametrize("name", SHELL_TEMPLATES)
def test_every_value_in_a_shell_template_goes_through_q(name):
    assert not unquoted_expressions(name), f"{name}: unquoted values (use | q):\n" + "\n".join(unquoted_expressions(name))


def test_the_check_finds_an_unquoted_value():
    env = jinja2.Environment()
    tree = env.parse("rm -rf {{ venv }}\necho {{ x | q }}\n")
    outs = [n for o in tree.find_all(nodes.Output) for n in o.nodes if not isinstance(n, nodes.TemplateData)]
    assert [isinstance(n, nodes.Filter) and n.name in SAFE_FILTERS for n in outs] == [False, True]


MARK = "/mnt/fimfleet-hostile/ran"
PAYLOADS = [f"x; echo semicolon >> {MARK}", f"$(echo dollar >> {MARK})", f"`echo backtick >> {MARK}`",
            f"x' ; echo squote >> {MARK} ; '", f'x" ; echo dquote >> {MARK} ; "', f"x\necho newline >> {MARK}"]


def run_sandboxed(script: str, tmp_path: Path) -> str:
    """Run `script` with bash where every external command is a no-op, in a private mount namespace
    whose system directories are empty tmpfs; returns what the payloads wrote (empty if none ran)."""
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "script.sh").write_text(script)
    mounts = " ".join(f"mount -t tmpfs none {d};" for d in ("/etc", "/var", "/usr/local", "/opt", "/srv", "/root",
                                                            "/home", "/run", "/mnt"))
    inner = (f"{mounts} mkdir -p /mnt/fimfleet-hostile && mount --bind {tmp_path}/out /mnt/fimfleet-hostile && "
             f"cp {tmp_path}/script.sh /run/script.sh && "
             "exec env -i PATH=/nonexistent /bin/bash -c 'command_not_found_handle() { return 0; }; source /run/script.sh' "
             ">/dev/null 2>&1")
    subprocess.run(["unshare", "-m", "--propagation", "private", "/bin/sh", "-c", inner], timeout=60)
    ran = tmp_path / "out" / "ran"
    return ran.read_text() if ran.exists() else ""


def hostile_renders(payload: str):
    """The templates that take strings from the stack config, rendered with `payload` in each of them."""
    r = templates.render
    yield "install-venv", r("runtime/install-venv.sh.j2", venv=payload, lock_path=payload, user=payload,
                            state_dir=payload, wheelhouse_url=payload, index_url="")
    yield "install-venv-index", r("runtime/install-venv.sh.j2", venv="/opt/v", lock_path="/l", user="u",
                                  state_dir="/s", wheelhouse_url="", index_url=payload)
    yield "model", r("runtime/model.sh.j2", source="local", kind="systemd", model_path=payload, user=payload, state_dir=payload,
                     cache_dir=payload)
    yield "model-docker", r("runtime/model.sh.j2", source="local", kind="docker", uid=10001, model_path=payload,
                            user=payload, state_dir=payload, cache_dir=payload, home=payload)
    yield "pull-image", r("runtime/pull-image.sh.j2", image=payload, images=payload, docker_config=payload, login=False)
    yield "bandwidth", r("runtime/bandwidth.sh.j2", venv=payload, script=payload)
    yield "kv-capacity", r("runtime/kv-capacity.sh.j2", port=payload)
    yield "start", r("runtime/start.sh.j2", unit=payload, served_name=payload, port=payload, timeout_s=0,
                     **_start_extras(payload))
    every = dict(unit=payload, container=payload, env_file=payload, venv=payload, state_dir=payload, cache_dir=payload,
                 lock_path=payload, files=[payload],
                 user=payload, stamp=payload, images=payload, health=payload, home=payload, docker_config=payload,
                 writable_dir=payload)
    for part in ("unit", "unit-check", "unit-destroy", "model-destroy", "venv-destroy", "image-destroy"):
        yield f"runtime-{part}", r(f"runtime/{part}.sh.j2", kind="docker", **every)
    yield "runtime-check", r("runtime/check.sh.j2", unit=payload)
    verify = r("kernel/verify.sh.j2", sysctl={payload: payload}, sysfs={payload: payload}, limits={payload: payload},
               limits_path=payload)
    yield "kernel-verify", verify
    yield "kernel-apply", r("kernel/apply.sh.j2", sysctl={payload: payload}, sysfs={payload: payload}, modules=[payload],
                            sysctl_path=payload, apply_script=payload, verify="true", staged_dir=payload, state_dir=payload,
                            sysctl_staged=payload,
                            installs=[{"name": payload, "dest": payload, "mode": payload}])
    yield "kernel-tuning", r("kernel/tuning-apply.sh.j2", sysfs={payload: payload}, debugfs={payload: payload})
    yield "kernel-destroy", r("kernel/destroy.sh.j2", sysctl_path=payload, limits_path=payload, unit_path=payload,
                              apply_script=payload, modules_path=payload, staged_dir=payload,
                              state_dir=payload)
    yield "packages", r("host/packages.sh.j2", packages=[payload])


def _start_extras(payload: str) -> dict:
    """start.sh.j2 may take more values than these tests know of: give every other one the payload too."""
    names = _referenced(templates.environment(), "runtime/start.sh.j2")
    return {**{n: payload for n in names - {"unit", "served_name", "port", "timeout_s"}}, "files": [payload, payload]}


@pytest.mark.parametrize("payload", PAYLOADS, ids=["semicolon", "dollar", "backtick", "squote", "dquote", "newline"])
def test_hostile_values_never_run_as_commands(payload, tmp_path):
    ran = {}
    for name, script in hostile_renders(payload):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        if out := run_sandboxed(script, tmp_path):
            ran[name] = out
    assert not ran, ran


def _referenced(env, name: str) -> set[str]:
    """Every value `name` and the templates it includes take."""
    tree = env.parse(env.loader.get_source(env, name)[0])
    names = set(meta.find_undeclared_variables(tree))
    for inc in meta.find_referenced_templates(tree):
        names |= _referenced(env, inc) if inc else set()
    return names


def hostile_everywhere(payload: str):
    """Every shell template, with `payload` as every value it takes: a string, each field of a
    list entry or mapping, each key and value. Catches a template that no render above names."""

    class Hostile(str):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Hostile(self)

        def __iter__(self):
            return iter([Hostile(self)])

        def items(self):
            return [(Hostile(self), Hostile(self))]

        def __index__(self):  # "%d" | format(...) in the preflight's messages
            return 1

        def __gt__(self, other):  # `gpu_count > 0`: take the branch that uses the value
            return True if isinstance(other, (int, float)) else str.__gt__(self, other)

    env = templates.environment()
    for name in SHELL_TEMPLATES:
        values = {n: "true" if n in PRE_RENDERED else Hostile(payload) for n in _referenced(env, name)}
        yield name, env.get_template(name).render(**values)


@pytest.mark.parametrize("payload", PAYLOADS, ids=["semicolon", "dollar", "backtick", "squote", "dquote", "newline"])
def test_hostile_values_in_every_template_never_run(payload, tmp_path):
    rendered = dict(hostile_everywhere(payload))
    assert set(rendered) == set(SHELL_TEMPLATES)
    ran = {}
    for i, (name, script) in enumerate(sorted(rendered.items())):
        (tmp_path / str(i)).mkdir()
        if out := run_sandboxed(script, tmp_path / str(i)):
            ran[name] = out
    assert not ran, ran


def test_the_sandbox_detects_an_injection(tmp_path):
    assert run_sandboxed(f"rm -rf {PAYLOADS[0]}\n", tmp_path) == "semicolon\n"
