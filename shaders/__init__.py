"""WGSL sources, loaded as package data (never by checkout path): one kernel family a file
(flash_prefill with its helpers in flash_prefill_steps), the code families share
(attn_common, attn_keys, decode_*_common, mma_common, utility_common), and the pieces the
program builder (backends/webgpu/program.py) picks between for a module's generated
prefix."""

from __future__ import annotations

from functools import cache
from importlib import resources

FAMILIES = ("attn_common", "attn_keys", "flash_prefill_steps", "flash_prefill", "decode_common",
            "decode_qk_common", "decode_pv_common", "decode_partial", "decode_qk", "decode_pv",
            "reduce",
            "mma_common", "mma_hw", "mma_emu", "flash_prefill_mma", "decode_mma",
            "mma_prefill_common", "mma_staging", "mma_hw_staged", "mma_emu_staged", "mma_hw_direct",
            "mma_emu_direct", "flash_prefill_mma_direct",
            "utility_common", "patch16", "copy_rows", "copy_bw", "quantize_kv")
# Files of named pieces (not modules): ``// piece: NAME`` starts a piece, which runs to the
# next such line; what comes before the first is the file's own comment.
PIECE_FILES = ("prefix", "storage", "kv_units")
_MARK = "// piece: "


@cache
def load(name: str) -> str:
    """The text of ``shaders/<name>.wgsl`` (KeyError for an unknown name)."""
    if name not in FAMILIES:
        raise KeyError(f"no WGSL source {name!r}; known: {FAMILIES}")
    return _read(name)


@cache
def pieces(name: str) -> dict[str, str]:
    """The pieces of ``shaders/<name>.wgsl`` by name, each its lines up to the next piece
    with the blank lines around them dropped, ending in a newline."""
    if name not in PIECE_FILES:
        raise KeyError(f"no WGSL piece file {name!r}; known: {PIECE_FILES}")
    got: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in _read(name).splitlines():
        if line.startswith(_MARK):
            key = line[len(_MARK):].strip()
            if key in got:
                raise ValueError(f"shaders/{name}.wgsl: piece {key!r} twice")
            current = got[key] = []
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v).strip("\n") + "\n" for k, v in got.items()}


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.wgsl").read_text(encoding="utf-8")
