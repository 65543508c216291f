"""dlmc's cache directory, the one setting read from the environment (`DLMC_CACHE`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["dlmc_cache_dir"]


def dlmc_cache_dir() -> Path:
    """`$DLMC_CACHE`, else `$XDG_CACHE_HOME/dlmc` or `~/.cache/dlmc`: built-in tiny models
    (`models/`) and Inductor's compile caches (`inductor*/`) live here."""
    if os.environ.get("DLMC_CACHE"):
        return Path(os.environ["DLMC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dlmc"
