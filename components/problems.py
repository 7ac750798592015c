"""How a config problem is shown: the key, the value (never a secret's) and the fix."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
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

    def __str__(self) -> str:
        shown = "<secret>" if _secret(self.key) else json.dumps(self.value, default=str)
        full = self.key if ":" in self.key else f"{NAMESPACE}:{self.key}"
        return f"{full} = {shown}: {self.fix}"


class ConfigError(ValueError):
    """All problems of one stack config; str() lists them one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid stack config:\n" + "\n".join(f"  - {p}" for p in problems))
