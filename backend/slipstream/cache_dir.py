"""Where Slipstream keeps what it makes once: the converted default model and the compiled
kernels. ``SLIPSTREAM_CACHE``, else ``$XDG_CACHE_HOME/slipstream``, else
``~/.cache/slipstream``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream"
    )
    return Path(root)
