"""One local stack on a test VM, driven through the real CLI: what the e2e modules share."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx

from components import host, ssh
from scripts import local_deploy as ld


def live(request):
    """Long setup (images, snapshots, an engine start) prints its progress to the test log as it
    goes, instead of minutes of silence that pytest would show only on a failure."""
    return request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled()


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
