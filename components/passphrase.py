"""The local test stacks' published passphrase, and the rule that keeps it off real stacks.

./fimfleet refuses it before `config set --secret` and `up`; this module covers the official CLI.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from components.config import ConfigError, Problem

LOCAL_PASSPHRASE = "fimfleet-local"
"""The local test stacks' published passphrase (./fimfleet sets it for them); never for a real stack."""


def is_local_stack(stack: str) -> bool:
    return stack == "local" or stack.startswith("local-")


def check_passphrase(stack: str, dry_run: bool, environ=None, stack_dir: Path | None = None) -> None:
    """Refuse to deploy a real stack whose secrets are encrypted with the published passphrase."""
    env = os.environ if environ is None else environ
    if dry_run or is_local_stack(stack) or env.get("PULUMI_CONFIG_PASSPHRASE") != LOCAL_PASSPHRASE:
        return
    stack_file = (stack_dir or Path(__file__).resolve().parent.parent / "stacks") / f"Pulumi.{stack}.yaml"
    text = stack_file.read_text() if stack_file.exists() else ""
    if re.search(r"^secretsprovider: *(?!passphrase)[a-z]+://", text, re.M):
        return
    raise ConfigError([Problem("env:PULUMI_CONFIG_PASSPHRASE", "<the local test stacks' passphrase>",
                               f"stack {stack} must not encrypt its secrets with the passphrase published for the local "
                               "test stacks: export PULUMI_CONFIG_PASSPHRASE=<your own> (then re-set the secrets), or "
                               f"pulumi stack change-secrets-provider -s {stack} awskms://... (or another KMS)")])
