"""What NVIDIA's OpenCL C 1.2 compiler refuses and PoCL's clang accepts, caught on CI's machine:
the H100's tensor-core builds failed (and the planner fell back to the sub-group kernels, 5x
slower) when a shared macro became variadic."""

from __future__ import annotations

import re
from importlib import resources


def _sources() -> dict[str, str]:
    root = resources.files("attnreg.kernels_cl")
    return {p.name: p.read_text(encoding="utf-8") for p in root.iterdir() if p.name.endswith(".cl")}


def test_sources_are_found() -> None:
    assert {"common.cl", "flash_core.cl", "mma_tile.cl"} <= set(_sources())


def test_no_variadic_macros() -> None:
    """NVIDIA: "variadic macros not supported in OpenCL"."""
    bad = [f"{name}:{text[:m.start()].count(chr(10)) + 1}"
           for name, text in _sources().items()
           for m in re.finditer(r"^\s*#\s*define\s+\w+\([^)]*\.\.\.\s*\)", text, re.M)]
    assert not bad, f"variadic macros (NVIDIA's OpenCL refuses them): {bad}"
    assert not [n for n, t in _sources().items() if "__VA_ARGS__" in t]
