"""Where fimfleet keeps what it can always rebuild: $FIMFLEET_CACHE, else ~/.cache/fimfleet
(the same rule as ./fimfleet), so the wrapper, the scripts and the program share one place."""

from __future__ import annotations

import os
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("FIMFLEET_CACHE") or Path.home() / ".cache" / "fimfleet")
