"""How a config problem is shown: the key, the value (never a secret's) and the fix."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

NAMESPACE = "fimfleet"
SECRET_KEYS = ("sshPrivateKey", "apiKeys", "hfToken", "tlsCert", "tlsKey", "registryPassword")
SECRET_NAME = re.compile(r"(?i)password|passwd|token(?!s)|secret|private_?key|api_?keys?$|tls_?key$|webhook")
"""A key named like a secret: a mistyped `sshPrivatekey` or `runtime.registryPassword` holds one, and
a webhook URL carries its token."""


def _secret(key: str) -> bool:
    parts = re.split(r"[.\[\]]", key.split(":", 1)[-1])
    return parts[0] in SECRET_KEYS or any(SECRET_NAME.search(p) for p in parts if p)


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    fix: str
    secret: bool = False
    """Held as a Pulumi secret: shown as <secret> whatever the key's name (see `masked`)."""

    def __str__(self) -> str:
        fix = self.fix
        if self.secret or _secret(self.key):
            shown = "<secret>"
            if isinstance(self.value, str) and len(self.value) >= 4:  # a fix that quotes it (not a word's letters)
                fix = fix.replace(repr(self.value), "<secret>").replace(self.value, "<secret>")
        else:
            shown = json.dumps(self.value, default=str)
        full = self.key if ":" in self.key else f"{NAMESPACE}:{self.key}"
        return f"{full} = {shown}: {fix}"


def masked(problems: list[Problem], secret_keys) -> list[Problem]:
    """`problems` with the value of every key under one the engine holds as a secret hidden: a
    private key set with --secret under a mistyped name, or a whole secret map's settings."""
    short = {k.removeprefix(f"{NAMESPACE}:") for k in secret_keys}
    return [replace(p, secret=True) if p.key in secret_keys or re.split(r"[.\[]", p.key, maxsplit=1)[0] in short
            else p for p in problems]


class ConfigError(ValueError):
    """All problems of one stack config; str() lists them one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid stack config:\n" + "\n".join(f"  - {p}" for p in problems))


def beneath_own(problems: list[Problem], general_fix: str) -> list[Problem]:
    """A general rule's problems (those whose fix is `general_fix`) only for keys that no rule of
    their own reported: the key's own grammar names the better fix."""
    named = {p.key for p in problems if p.fix != general_fix}
    return [p for p in problems if p.fix != general_fix
            or not any(k == p.key or p.key.startswith((k + ".", k + "[")) or k.startswith((p.key + ".", p.key + "["))
                       for k in named)]
