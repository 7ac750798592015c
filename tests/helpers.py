"""Shared test data: valid stack configs to start from, and a throwaway SSH key."""

from __future__ import annotations

import copy
import functools

API_KEY = "k" * 8 + "0123456789abcdef0123456789"


@functools.lru_cache(maxsize=1)
def ssh_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


def raw_config(tier: str = "cpu-epyc-prod", **sections) -> tuple[dict, frozenset]:
    """A valid raw config (short keys) plus its secret keys; `sections` replace or add keys."""
    raw = {
        "tier": tier,
        "host": {"address": "203.0.113.10"},
        "sshPrivateKey": ssh_key(),
        "apiKeys": {"alice": API_KEY, "bob": API_KEY[::-1]},
    }
    raw.update(copy.deepcopy(sections))
    return raw, frozenset({"sshPrivateKey", "apiKeys"})
