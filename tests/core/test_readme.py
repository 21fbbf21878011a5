"""The README's Python examples run as written (plugin skeletons excepted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
RUNNABLE = [b for b in BLOCKS if "hookimpl" not in b]


def test_readme_has_examples() -> None:
    assert len(RUNNABLE) >= 3


@pytest.mark.parametrize("index", range(len(RUNNABLE)))
def test_readme_example_runs(index: int) -> None:
    # Blocks build on the first one (imports, spec, tensors), as a reader would run them.
    scope: dict[str, object] = {}
    for block in RUNNABLE[: index + 1]:
        exec(compile(block, f"README.md block {index}", "exec"), scope)
