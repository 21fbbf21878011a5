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


def test_a_core_module_importing_a_backend_breaks_the_check(tmp_path: Path) -> None:
    view = _view(tmp_path)
    plan = view / "attnreg" / "plan.py"
    plan.write_text(plan.read_text() + "\nfrom .backends.webgpu import program  # noqa\n")
    res = _lint(view)
    assert res.returncode != 0
    assert "only backends import backends" in res.stdout, res.stdout
    assert "attnreg.plan -> attnreg.backends.webgpu.program" in res.stdout, res.stdout


def test_a_backend_importing_a_tool_breaks_the_check(tmp_path: Path) -> None:
    view = _view(tmp_path)
    runtime = view / "attnreg" / "backends" / "opencl" / "runtime.py"
    runtime.write_text(runtime.read_text() + "\nfrom attnreg.tools import cases  # noqa\n")
    res = _lint(view)
    assert res.returncode != 0
    assert "layers: tools and integrations above backends" in res.stdout, res.stdout
    assert "only the command imports the tools BROKEN" in res.stdout, res.stdout


def test_an_import_circle_in_the_core_breaks_the_check(tmp_path: Path) -> None:
    view = _view(tmp_path)
    spec = view / "attnreg" / "spec.py"
    spec.write_text(spec.read_text() + "\nfrom . import session  # noqa\n")   # session -> spec
    res = _lint(view)
    assert res.returncode != 0
    assert "no import circle among the modules of a package BROKEN" in res.stdout, res.stdout


def test_a_type_checking_import_circle_breaks_the_check(tmp_path: Path) -> None:
    """Imports made only for type checking count: a DeviceTensor typed by the Session that
    makes it would be a circle (session -> device_tensor -> session)."""
    view = _view(tmp_path)
    dt = view / "attnreg" / "device_tensor.py"
    dt.write_text(dt.read_text() + "\nfrom typing import TYPE_CHECKING  # noqa\n\n"
                  "if TYPE_CHECKING:\n    from .session import Session  # noqa\n")
    res = _lint(view)
    assert res.returncode != 0
    assert "no import circle among the modules of a package BROKEN" in res.stdout, res.stdout
