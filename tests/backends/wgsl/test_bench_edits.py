"""The GPU bench scripts' source edits still apply to the shaders they edit: each variant or
phase of bench/wgsl_*.py is a text replacement in a named WGSL file, and a kernel change that
rewords the text would otherwise be found only on the GPU machine, as the script stops there
("no longer contains"). Only the texts are checked here; the builds run on the GPU."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from attnreg import shaders

SCRIPTS = ("bench.wgsl_mma_prefill", "bench.wgsl_mma_phases", "bench.wgsl_decode_phases",
           "bench.prefill_tiles")


# Every WGSL file an edit could name: kernel sources and piece files.
_WGSL = set(shaders.FAMILIES) | set(shaders.PIECE_FILES)


def _edits(value: Any) -> Iterator[tuple[str, str, str]]:
    """Every (shader, old, new) edit held in a module-level value (nested lists, tuples and
    dicts), the way the scripts declare their variant tables."""
    if (isinstance(value, tuple) and len(value) == 3 and all(isinstance(x, str) for x in value)
            and value[0] in _WGSL):
        yield value
    elif isinstance(value, (list, tuple)):
        for x in value:
            yield from _edits(x)
    elif isinstance(value, dict):
        for x in value.values():
            yield from _edits(x)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_edit_of_the_bench_scripts_applies(script: str) -> None:
    module = importlib.import_module(script)
    found = {e for name, v in vars(module).items() if name.isupper() for e in _edits(v)}
    assert len(found) >= 5, f"{script}: its edit tables were not found"
    # program.load serves only the kernel sources: an edit of a piece file changes nothing
    pieces = [(f, old[:40]) for f, old, _ in sorted(found) if f not in shaders.FAMILIES]
    assert not pieces, f"{script}: edits of piece files, which no build would see: {pieces}"
    stale = [(f, old[:60]) for f, old, _ in sorted(found) if old not in shaders.load(f)]
    assert not stale, f"{script}: edits whose text the shader no longer has: {stale}"
