"""WGSL sources, one kernel family a file, loaded as package data (never by checkout path)."""

from __future__ import annotations

from functools import cache
from importlib import resources

FAMILIES = ("attn_common", "decode_lanes", "flash_prefill", "decode_partial", "reduce", "decode_qk",
            "decode_pv", "patch16", "copy_bw", "flash_prefill_mma", "mma_hw", "mma_emu",
            "mma_common", "decode_mma", "copy_rows")


@cache
def load(name: str) -> str:
    """The text of ``shaders/<name>.wgsl`` (KeyError for an unknown name)."""
    if name not in FAMILIES:
        raise KeyError(f"no WGSL source {name!r}; known: {FAMILIES}")
    return resources.files(__name__).joinpath(f"{name}.wgsl").read_text(encoding="utf-8")
