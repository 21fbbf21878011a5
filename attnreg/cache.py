"""Where attnreg keeps what it measured or built on this machine: $ATTNREG_CACHE_DIR, default
~/.cache/attnreg (the tuning cache, the Vulkan shim, the OpenCL tensor-core probe)."""

from __future__ import annotations

import os
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("ATTNREG_CACHE_DIR")
                or os.path.join(os.path.expanduser("~"), ".cache", "attnreg"))
