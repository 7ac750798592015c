"""Shared test data: valid stack configs to start from, a throwaway SSH key, the image build module,
and a session kill for a crashed CLI."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

API_KEY = "k" * 8 + "0123456789abcdef0123456789"

# The shape of the tiny test model's config.json: all that sizing and engine arguments read.
TINY_CONFIG = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
               "intermediate_size": 256, "vocab_size": 8192, "max_position_embeddings": 4096,
               "tie_word_embeddings": True}


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before: the kernel hands a
    just-closed port out again (about 1 pick in 100 here), so two picks made before either is bound can
    collide, as nginx's http and https ports once did in CI."""
    with _PORTS_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port


@functools.lru_cache(maxsize=1)
def ssh_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


@functools.lru_cache(maxsize=1)
def provided_tls() -> dict[str, str]:
    """tlsCert (the leaf, then its CA) and tlsKey of a real chain, as `ingress.tls: provided` takes them."""
    from components import tls

    out = tls.issue("code.example.com", ["code.example.com"], [], days=90)
    return {"tlsCert": out["certPem"], "tlsKey": out["keyPem"]}


def raw_config(tier: str = "cpu-epyc-prod", **sections) -> tuple[dict, frozenset]:
    """A valid raw config (short keys) plus its secret keys; `sections` replace or add keys."""
    raw = {
        "tier": tier,
        "host": {"address": "203.0.113.10"},
        "sshPrivateKey": ssh_key(),
        "apiKeys": {"alice": API_KEY, "bob": API_KEY[::-1]},
    }
    if "nodes" in sections:  # the stack names its machines itself (components/nodes_config.py)
        del raw["host"]
    raw.update(copy.deepcopy(sections))
    return raw, frozenset({"sshPrivateKey", "apiKeys"})


def parse(**sections):
    """raw_config(**sections), validated."""
    from components import config

    return config.parse(*raw_config(**sections))


def problems_of(raw, secret=frozenset({"sshPrivateKey", "apiKeys"})):
    """The problems config.parse reports for `raw` (it must refuse it)."""
    import pytest

    from components import config

    with pytest.raises(config.ConfigError) as err:
        config.parse(raw, secret)
    return err.value.problems


def temp_project(tmp_path):
    """A throwaway Pulumi project whose program is this repository and whose stack files are copies.

    `pulumi stack init` writes an encryption salt into the project's stack file; tests run their
    pulumi commands with `--cwd` of this copy so they never touch stacks/ in the repository."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proj = tmp_path / "project"
    shutil.copytree(root / "stacks", proj / "stacks")
    text = (root / "Pulumi.yaml").read_text().replace("virtualenv: .venv", f"virtualenv: {root / '.venv'}")
    (proj / "Pulumi.yaml").write_text(text + f"main: {root}\n")
    return proj


@functools.cache
def image_build():
    """toolchain/image/build.py as a module, under a name no installed package has (PyPI's `build`)."""
    path = Path(__file__).resolve().parents[1] / "toolchain" / "image" / "build.py"
    spec = importlib.util.spec_from_file_location("fimfleet_image_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vm_state_keys(raw: dict, state: str) -> dict[str, str]:
    """The config paths that name a local stack's test VMs: host.testbedState for a single-node
    stack, nodes.<name>.testbedState for a fleet (one VM each, `state`-<name>)."""
    nodes = raw.get("nodes") or raw.get("fimfleet:nodes")
    if nodes:
        return {f"nodes.{n}.testbedState": f"{state}-{n}" for n in nodes}
    return {"host.testbedState": state}


def set_path(raw: dict, dotted: str, value) -> None:
    """raw[a][b][c] = value for dotted 'a.b.c' (short keys, as config.parse takes them)."""
    *heads, leaf = dotted.split(".")
    for h in heads:
        if not isinstance(raw.get(h), dict):
            raw[h] = {}
        raw = raw[h]
    raw[leaf] = value


def host_key() -> str:
    """An OpenSSH public key line, standing in for the VM's host key."""
    from cryptography.hazmat.primitives import serialization

    pub = serialization.load_ssh_private_key(ssh_key().encode(), None).public_key()
    return pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def fake_testbed(state: Path) -> Path:
    """An info.json like toolchain/testbed/vm.py writes, for previewing a local stack without a VM."""
    state.mkdir()
    (state / "id_ed25519").write_text(ssh_key())
    (state / "info.json").write_text(json.dumps({"ssh": {"host": "127.0.0.1", "port": 1, "user": "root",
                                                         "key": str(state / "id_ed25519"),
                                                         "host_key": host_key()},
                                                 "ports": {"22": 1, "443": 2}}))
    return state


def proc_stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, session, ...); None
    once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session `sid`, as a CI runner that stops a job takes them all.
    The CLI starts each plugin in a process group of its own (setpgid), so killing the CLI, or its
    group, would orphan its language host and dynamic provider beyond the test run."""
    deadline = time.monotonic() + 30
    while True:
        pids = [int(d.name) for d in Path("/proc").glob("[0-9]*")
                if (f := proc_stat(d.name)) and f[3] == str(sid) and f[0] != "Z"]
        if not pids:
            return
        assert time.monotonic() < deadline, f"processes of session {sid} outlived SIGKILL for 30 s: {pids}"
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class ForkLog:
    """A PATH holding only `tools` (each logs its name, then runs the real one) and a bash that logs
    any other command it looks up, for scripts that must fork only where they say they do."""

    def __init__(self, tmp: Path, tools: dict[str, str | None]):
        """tools: name -> the wrapper's body after logging (None: exec the real tool)."""
        import shutil

        self.log = tmp / "forks.log"
        self.bin = tmp / "fork-bin"
        self.bin.mkdir()
        for name, body in tools.items():
            wrapper = self.bin / name
            wrapper.write_text(f"#!/bin/bash\necho {name} >> {self.log}\n"
                               + (body if body is not None else f'exec {shutil.which(name)} "$@"\n'))
            wrapper.chmod(0o755)
        self.env = {"PATH": str(self.bin),
                    "BASH_FUNC_command_not_found_handle%%": f'() {{ echo "$1" >> {self.log}; return 127; }}'}

    def take(self) -> list[str]:
        """The commands logged since the last take."""
        names = self.log.read_text().split() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return names
