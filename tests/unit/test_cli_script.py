"""./fimfleet itself, run from a scratch copy whose .toolchain holds a stub `pulumi` that prints its
arguments: the passphrase guard against the spellings Pulumi's CLI reads, `env`, paths, usage.
Nothing is built and no real Pulumi runs."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUARD = "which is public"
STUB = """#!/usr/bin/env bash
if [[ ${1-} == stack && ${2-} == --show-name ]]; then
  [[ -n ${STUB_SELECTED-} ]] || { echo "error: no stack selected" >&2; exit 255; }
  echo "$STUB_SELECTED"; exit 0
fi
if [[ "$*" == "stack ls --json" ]]; then echo "${STUB_STACKS-[]}"; exit 0; fi
echo "PULUMI RAN: $*"
echo "FIMFLEET_CACHE=$FIMFLEET_CACHE"
echo "PULUMI_CONFIG_PASSPHRASE_FILE=${PULUMI_CONFIG_PASSPHRASE_FILE-}"
"""


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / ".toolchain").mkdir(parents=True)
    shutil.copy(ROOT / "fimfleet", r / "fimfleet")
    stub = r / ".toolchain" / "pulumi"
    stub.write_text(STUB)
    stub.chmod(0o755)
    (r / "stacks").mkdir()
    (r / "stacks" / "Pulumi.prod.yaml").write_text("config: {}\n")
    (r / "stacks" / "Pulumi.salted.yaml").write_text("encryptionsalt: v1:abc=:v1:def:ghi==\nconfig: {}\n")
    (r / "stacks" / "Pulumi.kms.yaml").write_text("secretsprovider: awskms://alias/fimfleet\nconfig: {}\n")
    (tmp_path / "home").mkdir()
    return r


def fimfleet(repo, *args, cwd=None, script=None, **env):
    """The script with a clean environment: no passphrase of the caller's, state and HOME in tmp."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PULUMI_", "FIMFLEET_"))}
    base.update(HOME=str(repo.parent / "home"), FIMFLEET_BACKEND_URL=f"file://{repo.parent / 'state'}")
    base.update(env)
    base = {k: v for k, v in base.items() if v is not None}
    return subprocess.run([str(script or repo / "fimfleet"), *args], cwd=cwd or repo, env=base,
                          capture_output=True, text=True, timeout=60)


REFUSED = [
    "up -s prod", "up -sprod", "up -s=prod", "up --stack prod", "up --stack=organization/fimfleet/prod",
    "--color never up -s prod", "-v 3 up -s prod", "--verbose 3 up -s prod", "-C . up -s prod",
    "--cwd . up -s prod", "--tracing file:/tmp/t up -s prod", "--profiling p up -s prod",
    "--memprofilerate 1 up -s prod", "--otel-traces file:///tmp/t up -s prod",
    "--logflow --logtostderr --non-interactive --disable-integrity-checking --emoji -Q up -s prod",
    "update -s prod", "down -s prod", "dn -s prod", "destroy -s prod", "refresh -s prod", "import -s prod",
    "config set --secret k v -s prod", "config set --secret=true k v -s prod", "config set --secret=1 k v -s prod",
    "config set k v --secret --stack prod", "config -s prod set --secret k v", "config set-all --secret k=v -s prod",
    "config cp -d prod", "config copy --dest=prod",
    "stack init prod", "stack init --stack prod", "stack init -s prod", "stack init -sprod", "stack create prod",
    "stack new prod", "stack -s prod init", "stack select --create prod", "stack select -c prod",
    "stack init prod --secrets-provider passphrase", "stack change-secrets-provider passphrase -s prod",
    "stack change-secrets-provider default -s prod", "new python -s prod", "state move --dest prod urn:x",
    "preview -s prod",  # its settings file has no salt yet: preview would write one
    "up -ys prod",  # -s among other letters: what it reads depends on the other flags
    "--no-such-flag up -s prod",  # the command cannot be told: the stack decides
    "--no-such-flag up", "stack --secrets-provider passphrase init prod",  # ... and only -s names it
]


@pytest.mark.parametrize("args", REFUSED)
def test_the_public_passphrase_is_refused_for_a_real_stack_however_pulumi_is_called(repo, args):
    # The selected stack is a local one: the refusal comes from reading the stack on the command line.
    proc = fimfleet(repo, "pulumi", *args.split(), STUB_SELECTED="local")
    assert proc.returncode == 1 and "PULUMI RAN" not in proc.stdout, proc.stdout + proc.stderr
    assert GUARD in proc.stderr and "PULUMI_CONFIG_PASSPHRASE=" in proc.stderr
    assert "change-secrets-provider" in proc.stderr


@pytest.mark.parametrize("args, env", [
    ("up", {"STUB_SELECTED": "prod"}),
    ("--non-interactive --cwd . up --yes", {"STUB_SELECTED": "prod"}),
    ("up", {"PULUMI_OPTION_STACK": "prod", "STUB_SELECTED": "local"}),  # pulumi reads any flag from PULUMI_OPTION_*
    ("config set k v -s prod", {"PULUMI_OPTION_SECRET": "true"}),
    ("stack select prod", {"PULUMI_OPTION_CREATE": "1"}),
    ("up", {"STUB_SELECTED": None}),  # no stack selected: an interactive up offers to create one
    ("new python", {}),
])
def test_the_guard_refuses_when_pulumi_reads_the_stack_or_flag_elsewhere(repo, args, env):
    proc = fimfleet(repo, "pulumi", *args.split(), **{"STUB_SELECTED": "local", **env})
    assert proc.returncode == 1 and "PULUMI RAN" not in proc.stdout, proc.stdout + proc.stderr
    assert GUARD in proc.stderr


ALLOWED = [
    "up -s local", "up -s local-fleet", "up --stack=organization/fimfleet/local-docker", "--color never up -s local",
    "-v 3 up -slocal", "--no-such-flag up -s local", "stack init local-x", "stack select --create local",
    "stack select prod", "config set k v -s prod", "config set --secret=false k v -s prod",
    "config set k -- --secret", "config set-all --plaintext k=v -s prod", "config -s prod", "stack output -s prod",
    "stack ls", "-v 3 version", "up --help", "up -s prod --help",
    "stack change-secrets-provider awskms://alias/x -s prod", "stack init prod --secrets-provider=awskms://alias/x",
    "stack select -c prod --secrets-provider hashivault://k",
    "up -s kms",  # its settings name a KMS provider
    "preview -s salted",  # its salt is there already: preview only decrypts
]


@pytest.mark.parametrize("args", ALLOWED)
def test_local_stacks_reads_and_kms_stacks_pass_the_guard(repo, args):
    proc = fimfleet(repo, "pulumi", *args.split(), STUB_SELECTED="prod")
    assert proc.returncode == 0 and f"PULUMI RAN: {args}\n" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("args", ["up -s prod", "stack init prod", "config set --secret k v -s prod"])
def test_an_own_passphrase_passes_the_guard(repo, args, tmp_path):
    own = fimfleet(repo, "pulumi", *args.split(), PULUMI_CONFIG_PASSPHRASE="my own long passphrase")
    assert own.returncode == 0 and "PULUMI RAN" in own.stdout, own.stderr
    (tmp_path / "pass").write_text("my own long passphrase\n")
    own = fimfleet(repo, "pulumi", *args.split(), PULUMI_CONFIG_PASSPHRASE_FILE=str(tmp_path / "pass"))
    assert own.returncode == 0 and "PULUMI RAN" in own.stdout, own.stderr


def in_a_terminal(repo, args: str, **env) -> subprocess.CompletedProcess:
    """./fimfleet pulumi ARGS with a terminal on both ends (script(1)'s pty), where pulumi prompts."""
    line = " ".join(shlex.quote(a) for a in [str(repo / "fimfleet"), "pulumi", *args.split()])
    return fimfleet(repo, "-qec", line, "/dev/null", script="script", **{"CI": None, "TERM": "xterm", **env})


PROD = '[{"name": "prod", "current": true}, {"name": "organization/fimfleet/staging", "current": false}]'


@pytest.mark.parametrize("args, stacks, refused", [
    ("config set k v -s prod", "[]", "stack prod does not exist"),
    ("config -s staging", PROD.replace("staging", "other"), "stack staging does not exist"),
    ("state delete urn:x -s prod", "[]", "stack prod does not exist"),
    ("config", "[]", "names no stack and none is selected"),
    ("stack", "[]", "names no stack and none is selected"),
    ("stack select", PROD, "names no stack:"),  # its list offers <create a new stack>, whatever is selected
    ("up -s kms", "[]", "stack kms does not exist"),  # a created stack loses the KMS its settings file names
    ("config rm k -s prod", "[]", "stack prod does not exist"),
    ("config set k v -s prod", PROD, None),
    ("config -s staging", PROD, None),  # a backend that names it organization/project/stack
    ("stack select prod", "[]", None),  # a name given: pulumi does not offer to create it
    ("config set k v -s local-x", "[]", None),  # a local stack's passphrase is this one
    ("--non-interactive config set k v -s prod", "[]", None),
    ("version", "[]", None),
    ("up -s kms", '[{"name": "kms"}]', None),
    ("config cp k -d local -s prod", "[]", None),  # config copy does not offer to create its source
])
def test_in_a_terminal_a_stack_pulumi_would_offer_to_create_is_refused(repo, args, stacks, refused):
    """pulumi prompts to create a stack it does not find (config, state, `stack`, `stack select`),
    and one created so takes its salt from the passphrase in force: the public one."""
    selected = None if "none is selected" in (refused or "") else "prod"
    proc = in_a_terminal(repo, args, STUB_STACKS=stacks, STUB_SELECTED=selected)
    if refused:
        assert proc.returncode == 1 and "PULUMI RAN" not in proc.stdout, proc.stdout
        assert refused in proc.stdout and GUARD in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0 and f"PULUMI RAN: {args}" in proc.stdout, proc.stdout
    if refused:  # the same without a terminal: pulumi itself says the stack is not found
        assert "PULUMI RAN" in fimfleet(repo, "pulumi", *args.split(), STUB_STACKS=stacks).stdout
        own = in_a_terminal(repo, args, STUB_STACKS=stacks, PULUMI_CONFIG_PASSPHRASE="my own long passphrase")
        assert own.returncode == 0 and "PULUMI RAN" in own.stdout, own.stdout
        ci = in_a_terminal(repo, args, STUB_STACKS=stacks, STUB_SELECTED=selected, CI="true")  # pulumi does not read CI: it still prompts
        assert ci.returncode == 1 and refused in ci.stdout, ci.stdout


def test_env_masks_secret_values_and_shows_the_public_passphrase(repo):
    secrets = {"PULUMI_CONFIG_PASSPHRASE": "correct-horse-battery-staple-42", "PULUMI_ACCESS_TOKEN": "pul-0123456789",
               "PULUMI_SOME_SECRET": "s3cr3t-value", "PULUMI_DB_PASSWORD": "pw-value", "PULUMI_API_KEY": "key-value"}
    proc = fimfleet(repo, "env", **secrets)
    assert proc.returncode == 0, proc.stderr
    for name, value in secrets.items():
        assert f"{name}=<secret>\n" in proc.stdout and value not in proc.stdout
    assert f"PULUMI_HOME={repo}/.pulumi\n" in proc.stdout
    public = fimfleet(repo, "env")
    assert "PULUMI_CONFIG_PASSPHRASE=fimfleet-local\n" in public.stdout


def test_relative_paths_are_the_callers(repo, tmp_path):
    caller = tmp_path / "caller"
    caller.mkdir()
    env = dict(FIMFLEET_CACHE="relcache", FIMFLEET_BACKEND_URL="file://relstate", PULUMI_CONFIG_PASSPHRASE_FILE="pass")
    proc = fimfleet(repo, "pulumi", "version", cwd=caller, **env)
    assert proc.returncode == 0, proc.stderr
    assert f"FIMFLEET_CACHE={caller}/relcache\n" in proc.stdout
    assert f"PULUMI_CONFIG_PASSPHRASE_FILE={caller}/pass\n" in proc.stdout
    shown = fimfleet(repo, "env", cwd=caller, **env).stdout
    assert f"PULUMI_BACKEND_URL=file://{caller}/relstate\n" in shown
    assert (caller / "relstate").is_dir() and not (repo / "relstate").exists()


def test_a_home_backend_url_is_expanded_and_another_users_is_refused(repo, tmp_path):
    caller = tmp_path / "caller"
    caller.mkdir()
    home = tmp_path / "home"
    shown = fimfleet(repo, "env", cwd=caller, FIMFLEET_BACKEND_URL="file://~/fimfleet-state")
    assert f"PULUMI_BACKEND_URL=file://{home}/fimfleet-state\n" in shown.stdout, shown.stderr
    assert (home / "fimfleet-state").is_dir() and not (caller / "~").exists()
    other = fimfleet(repo, "env", cwd=caller, FIMFLEET_BACKEND_URL="file://~bob/state")
    assert other.returncode == 1 and "full path" in other.stderr and not (caller / "~bob").exists()


def test_a_users_own_backend_url_is_named_once_when_replaced(repo):
    proc = fimfleet(repo, "env", PULUMI_BACKEND_URL="s3://team-state-bucket")
    warning = [line for line in proc.stderr.splitlines() if line]
    assert len(warning) == 1 and "s3://team-state-bucket" in warning[0] and "FIMFLEET_BACKEND_URL" in warning[0]
    assert f"PULUMI_BACKEND_URL=file://{repo.parent}/state\n" in proc.stdout
    # A nested ./fimfleet (scripts/, the tests) replaces the one its parent set without a word.
    parent = f"file://{repo.parent}/other-state"
    nested = fimfleet(repo, "env", PULUMI_BACKEND_URL=parent, FIMFLEET_PULUMI_BACKEND_URL=parent)
    assert nested.returncode == 0 and nested.stderr == ""


@pytest.mark.parametrize("arg", ["--help", "-h", "help", None])
def test_help_prints_usage_and_succeeds(repo, arg):
    proc = fimfleet(repo, *([arg] if arg else []))
    assert proc.returncode == 0 and "./fimfleet pulumi ARGS" in proc.stdout and proc.stderr == ""


def test_an_unknown_command_is_named_before_the_usage(repo):
    proc = fimfleet(repo, "frobnicate")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[0] == "fimfleet: unknown command 'frobnicate'"
    assert "./fimfleet pulumi ARGS" in proc.stderr


def test_no_home_falls_back_to_the_accounts(repo):
    proc = subprocess.run(["env", "-i", "PATH=/usr/bin:/bin", str(repo / "fimfleet"), "pulumi", "version"],
                          cwd=repo, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "unbound variable" not in proc.stderr, proc.stderr
    assert f"FIMFLEET_CACHE={pwd.getpwuid(os.getuid()).pw_dir}/.cache/fimfleet\n" in proc.stdout


def test_a_link_to_the_script_runs_the_checkout(repo, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "fimfleet").symlink_to(repo / "fimfleet")
    proc = fimfleet(repo, "env", cwd=tmp_path, script=tmp_path / "bin" / "fimfleet")
    assert proc.returncode == 0, proc.stderr
    assert f"PULUMI_HOME={repo}/.pulumi\n" in proc.stdout and f"PATH={repo}/.toolchain:" in proc.stdout
    assert not (tmp_path / "bin" / ".pulumi").exists()


def test_the_script_passes_shellcheck():
    assert shutil.which("shellcheck"), "shellcheck is installed by ./fimfleet bootstrap"
    lint = subprocess.run(["shellcheck", "-S", "warning", str(ROOT / "fimfleet")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


@pytest.mark.parametrize("env, want", [
    ({"FIMFLEET_BACKEND_URL": "file:///srv/state?no_checkpoint=true"}, "/srv/state"),
    # an outer ./fimfleet's own (./fimfleet test), then a test's own backend: the test's
    ({"FIMFLEET_PULUMI_BACKEND_URL": "file:///outer/.state", "FIMFLEET_BACKEND_URL": "file:///tmp/e2e/state"},
     "/tmp/e2e/state"),
    ({"FIMFLEET_BACKEND_URL": "file://~/state"}, "{home}/state"),
    ({"FIMFLEET_BACKEND_URL": "file://rel/state"}, "{cwd}/rel/state"),
    ({}, "{root}/.state"),
])
def test_the_demo_looks_for_stale_locks_in_the_backend_the_wrapper_uses(env, want, monkeypatch, tmp_path):
    """./fimfleet resolves ~, a relative path and a query; the demo's stale-lock check read the raw URL."""
    from scripts import local_deploy

    for k in ("FIMFLEET_PULUMI_BACKEND_URL", "FIMFLEET_BACKEND_URL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert str(local_deploy.backend_dir()) == want.format(home=tmp_path / "home", cwd=tmp_path, root=ROOT)
