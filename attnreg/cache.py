"""Where attnreg keeps what it measured or built on this machine: $ATTNREG_CACHE_DIR, default
~/.cache/attnreg (the tuning cache, the Vulkan shim, the OpenCL probes' verdicts)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()


def root() -> Path:
    return Path(os.environ.get("ATTNREG_CACHE_DIR")
                or os.path.join(os.path.expanduser("~"), ".cache", "attnreg"))


def verdict(name: str, key: str, compute: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """A probe's answer for ``key`` from the JSON file ``name`` under root(), computed (and
    stored) when absent; also whether it came from the file. An unwritable cache only costs
    the probe once per process."""
    path = root() / name
    with _LOCK:
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        if key in stored:
            return dict(stored[key]), True
        got = compute()
        stored[key] = got
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as fh:
                json.dump(stored, fh, indent=1)
            os.replace(fh.name, path)
        except OSError:
            pass
        return got, False
