"""One import path in a checkout and in the wheel: ``attnreg.backends``, ``attnreg.shaders``,
``attnreg.kernels_cl``.

The repository keeps the backend plugins (backends/), the WGSL (shaders/) and the OpenCL C
(kernels_cl/) beside attnreg/; the built distribution maps them under it, so nothing generic
lands in site-packages, and an editable install maps them the same way. A checkout used
without installing (``PYTHONPATH=.``, the GPU machine) has no such mapping: this finder
resolves those three names to the sibling folders. It is added only in that case.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

MAPPED = ("backends", "shaders", "kernels_cl")


class _SiblingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        head, _, sub = fullname.partition(".")
        if head != "attnreg" or sub not in MAPPED:
            return None
        init = self.root / sub / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    """Map the sibling folders when attnreg runs from an uninstalled checkout."""
    pkg = Path(__file__).resolve().parent
    root = pkg.parent
    if (pkg / "backends").exists() or not (root / "backends" / "__init__.py").is_file():
        return               # a built distribution (mapped at build time), or no checkout
    if not any(isinstance(f, _SiblingFinder) for f in sys.meta_path):
        sys.meta_path.append(_SiblingFinder(root))


install()
