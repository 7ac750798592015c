"""One local stack on a test VM, driven through the real CLI: what the e2e modules share."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx

from components import host, ssh
from scripts import local_deploy as ld
from tests.helpers import image_build


def live(request):
    """Long setup (images, snapshots, an engine start) prints its progress to the test log as it
    goes, instead of minutes of silence that pytest would show only on a failure."""
    return request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled()


def selected(request, module: str) -> bool:
    """Whether this pytest session runs any test of tests/e2e/`module`."""
    return any(item.path.name == module for item in request.session.items)


class Node:
    def __init__(self, tmp: Path, stack: str = "local"):
        self.tmp = tmp
        self.stack = stack
        self.state = tmp / "vm"
        self.config_file = tmp / f"Pulumi.{stack}.yaml"
        self.up_seconds = None
        self.wiped_up = None  # test_local_deploy's test_07f's up, which test_07g also judges

    def ssh(self, script: str, timeout=120) -> tuple[int, str, str]:
        return vm_ssh(self.state, script, timeout)

    def outputs(self, secrets=False) -> dict:
        return ld.outputs(self.config_file, show_secrets=secrets, stack=self.stack)

    def pulumi(self, *args, check=False, program: Path | None = None) -> subprocess.CompletedProcess:
        """The real CLI on this stack; `program`: another tree's Pulumi program (program_at)."""
        where = ["--cwd", str(program)] if program else []
        return subprocess.run([str(ld.ROOT / "fimfleet"), "pulumi", *args, *where, "-s", self.stack,
                               "--non-interactive", "--config-file", str(self.config_file)], cwd=ld.ROOT,
                              capture_output=True, text=True, timeout=3600, check=check)


def vm_ssh(state: Path, script: str, timeout=120) -> tuple[int, str, str]:
    """`script` on the test VM of `state`, under `set -euo pipefail` (components/ssh.py)."""
    with ssh.session(ssh.SshTarget.from_props(host.testbed_connection(str(state)))) as client:
        return ssh.run(client, script, timeout_s=timeout)


def journal_cursor(state: Path) -> str:
    """Where the journal of the test VM of `state` ends now; unit_journal reads what follows."""
    code, out, err = vm_ssh(state, "journalctl -n 0 --show-cursor --no-pager")
    assert code == 0, err
    return re.search(r"-- cursor: (\S+)", out).group(1)


def unit_journal(state: Path, unit: str, cursor: str) -> str:
    """What systemd and the unit's processes logged for `unit` after `cursor`."""
    code, out, err = vm_ssh(state, f"journalctl -u {shlex.quote(unit)} --after-cursor={shlex.quote(cursor)} -o cat --no-pager")
    assert code == 0, err
    return out


def shown(proc: subprocess.CompletedProcess) -> str:
    """What a failed CLI run said: its steps and Diagnostics, without the Outputs block (the
    dashboard JSON alone would fill any tail), and the end of stderr."""
    text = re.sub(r"\nOutputs:\n.*?(?=\nResources:)", "\n<outputs left out>", proc.stdout, flags=re.S)
    return text[-8000:] + "\n--- stderr ---\n" + (proc.stderr or "")[-2000:]


IMPOSSIBLE_TTFT_MS = "0.001"
TTFT_KEYS = ("ttftP50Ms", "ttftP95Ms", "ttftP99Ms")


def set_impossible_sla(node, on: bool = True) -> None:
    """TTFT limits no engine meets (on), or the stack's own again. `--type float`: without it,
    `config set --path` stores 0.001 as text and `up` fails on config validation instead."""
    for k in TTFT_KEYS:
        if on:
            node.pulumi("config", "set", "--path", f"fimfleet:sla.{k}", IMPOSSIBLE_TTFT_MS, "--type", "float", check=True)
        else:
            node.pulumi("config", "rm", "--path", f"fimfleet:sla.{k}", check=True)


def assert_sla_missed(proc: subprocess.CompletedProcess) -> None:
    """`up` failed on the SLA report itself, not on config or a traceback."""
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, "an SLA no engine can meet did not fail pulumi up"
    assert "SLA MISSED" in text and f"limit <= {IMPOSSIBLE_TTFT_MS}" in text and "Traceback" not in text, shown(proc)


def keys(node) -> dict[str, str]:
    raw = node.pulumi("config", "--show-secrets", "--json", check=True).stdout
    return json.loads(json.loads(raw)["fimfleet:apiKeys"]["value"])


def client(node) -> httpx.Client:
    out = node.outputs()
    ca = node.tmp / "ca.pem"
    ca.write_text(out["caPem"])
    return httpx.Client(base_url=out["endpoint"], verify=str(ca), timeout=120)


def one_completion(node) -> None:
    """A two-token FIM completion through the ingress, TLS verified against the caPem output."""
    with client(node) as c:
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {next(iter(keys(node).values()))}"},
                   json={"model": node.outputs()["model"], "prompt": "<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>",
                         "max_tokens": 2})
        assert r.status_code == 200, r.text


DOCKER_STACK = "local-docker"
DOCKER_VARIANT = "docker-engine"


@dataclass(frozen=True)
class DockerEngine:
    """fimfleet's engine image on the host's test registry (toolchain/image/build.py as `build`)."""

    build: object
    pushed: str
    """repo@sha256:... as this machine names it"""

    @property
    def image(self) -> str:
        """The same digest, as the guest names it (the registry at 10.0.2.2)."""
        return self.pushed.replace(self.build.REGISTRY, self.build.GUEST_REGISTRY, 1)

    @property
    def variant_env(self) -> dict:
        """The docker-engine variant holds this image already: pulled natively while the image was
        built, since the same pull under emulation was most of a fresh machine's CI run."""
        return {"FIMFLEET_PRELOAD_IMAGE": self.pushed, "FIMFLEET_PRELOAD_AS": self.image}


def docker_engine() -> DockerEngine:
    """The image built (cached by its pins) and pushed by the CLI, as a user runs it: it installs
    buildah and docker-registry on a fresh machine. Its progress goes to the test log."""
    build = image_build()
    proc = subprocess.run([str(ld.ROOT / "fimfleet"), "image", "push"], cwd=ld.ROOT, stdout=subprocess.PIPE,
                          text=True, timeout=3000)
    if proc.returncode != 0:
        raise RuntimeError("./fimfleet image push failed: its output is above")
    return DockerEngine(build, proc.stdout.strip().splitlines()[-1])


def docker_config(config_file: Path, state: Path | None, model_dir: str, engine: DockerEngine) -> Path:
    """The local-docker stack's config, its runtime.image the pushed digest."""
    return ld.stack_config(config_file, state, model_dir, {"fimfleet:runtime.image": engine.image}, stack=DOCKER_STACK)


def docker_snapshot_beside(tmp: Path, paths: dict) -> threading.Thread:
    """The docker e2e's serving snapshot, built in a thread while the caller builds the local
    stack's, on a machine that lacks both (a fresh one, or after a runtime change): at once they
    took 648 s and 675 s on the 2-core machine, one after the other 476 s + 591 s.
    Join it before anything is measured. A failure is only reported: test_local_docker builds
    what is missing itself, and fails there if it must."""
    def build():
        try:
            engine = docker_engine()
            cfg = docker_config(tmp / f"Pulumi.{DOCKER_STACK}.yaml", None, paths["model_dir"], engine)
            ld.serving_snapshot(cfg, paths["wheelhouse"], DOCKER_VARIANT, variant_env=engine.variant_env)
        except Exception as e:  # noqa: BLE001 - reported; the docker e2e's own fixture tries again
            print(f"fimfleet: the docker e2e's serving snapshot, built beside this one, failed ({type(e).__name__}: {e}); "
                  "test_local_docker builds it itself", file=sys.stderr, flush=True)

    worker = threading.Thread(target=build, name="docker-serving-snapshot", daemon=True)
    worker.start()
    return worker
