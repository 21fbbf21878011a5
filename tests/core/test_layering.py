"""The import layering holds (import-linter contracts in pyproject.toml), and the check can
fail: a core module that imports a backend, a backend that imports a tool, or an import
circle in the core (a TYPE_CHECKING import too) breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _view(dest: Path) -> Path:
    """The installed layout (attnreg/ with backends/, shaders/, kernels_cl/ under it), copied
    so that a test can change it."""
    pkg = dest / "attnreg"
    shutil.copytree(ROOT / "attnreg", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for d in ("backends", "shaders", "kernels_cl"):
        shutil.copytree(ROOT / d, pkg / d, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _lint(view: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail("lint-imports (import-linter) is not installed: pip install -e .[test]")
    env = {**os.environ, "PYTHONPATH": str(view)}
    return subprocess.run([str(exe), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=view, env=env, capture_output=True, text=True, timeout=300)


def test_contracts_are_kept(tmp_path: Path) -> None:
    res = _lint(_view(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "6 kept, 0 broken" in res.stdout, res.stdout


# (what a test appends to which module of the installed view, what the report then says)
BREAKS = {
    "core-imports-backend": (
        "plan.py", "\nfrom .backends.webgpu import program  # noqa\n",
        ("only backends import backends",
         "attnreg.plan -> attnreg.backends.webgpu.program")),
    "backend-imports-tool": (
        "backends/opencl/runtime.py", "\nfrom attnreg.tools import cases  # noqa\n",
        ("layers: tools and integrations above backends",
         "only the command imports the tools BROKEN")),
    "core-circle": (                                      # session -> spec
        "spec.py", "\nfrom . import session  # noqa\n",
        ("no import circle among the modules of a package BROKEN",)),
    # Imports made only for type checking count: a DeviceTensor typed by the Session that
    # makes it would be a circle (session -> device_tensor -> session).
    "type-checking-circle": (
        "device_tensor.py", "\nfrom typing import TYPE_CHECKING  # noqa\n\n"
        "if TYPE_CHECKING:\n    from .session import Session  # noqa\n",
        ("no import circle among the modules of a package BROKEN",)),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_a_broken_layer_breaks_the_check(tmp_path: Path, case: str) -> None:
    module, addition, said = BREAKS[case]
    view = _view(tmp_path)
    path = view / "attnreg" / module
    path.write_text(path.read_text() + addition)
    res = _lint(view)
    assert res.returncode != 0
    for line in said:
        assert line in res.stdout, res.stdout
