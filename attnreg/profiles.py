"""Stored DeviceCaps of real adapters, so routing can be read and tested for devices we lack."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from .caps import DeviceCaps
from .errors import SpecError


@lru_cache(maxsize=1)
def profiles() -> dict[str, DeviceCaps]:
    """Profile name -> DeviceCaps, from attnreg/data/profiles.json (shipped in the wheel)."""
    text = resources.files("attnreg").joinpath("data/profiles.json").read_text()
    raw = json.loads(text)
    return {name: DeviceCaps(**{**caps, "features": frozenset(caps.get("features", ()))})
            for name, caps in raw.items() if not name.startswith("_")}


def profile(name: str) -> DeviceCaps:
    table = profiles()
    if name not in table:
        raise SpecError("profile", name, f"one of {sorted(table)}")
    return table[name]
