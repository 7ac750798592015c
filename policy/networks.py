"""CIDR helpers shared by the /metrics and SSH rules: one reading of "a network" and of "everywhere".

"Everywhere" is the config's own (components/grammar.py world_open), so the pack blocks exactly the
sets that the config check refuses, for inputs that did not come through the config check."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from components import grammar

WORLD = grammar.WORLD


def network(text: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """A CIDR or address as the cloud APIs read it ("all"/"any"/"0/0" = every IPv4 address); None if it is none."""
    if not isinstance(text, str):
        return None
    if text.strip().lower() in ("all", "any", "0/0"):
        return WORLD[4]
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        return None


def world_open(cidrs: Iterable[Any]) -> list[str]:
    """Which of 0.0.0.0/0 and ::/0 the networks cover together (0.0.0.0/1 + 128.0.0.0/1 count, and so do
    the IPv4-mapped IPv6 range and 2000::/3, every global IPv6 address); what is not a network is skipped."""
    return grammar.world_open([n for n in map(network, cidrs) if n is not None])
