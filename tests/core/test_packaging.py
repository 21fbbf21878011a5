"""The built wheel has one top-level import package, attnreg, with the backends, the WGSL
and the OpenCL C under it; installed on its own it loads every built-in plugin from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of what the sdist holds, so the build leaves nothing in the checkout.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for d in ("attnreg", "backends", "shaders", "kernels_cl"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                          "--outdir", str(out), str(src)], capture_output=True, text=True,
                         timeout=600, cwd=src)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (whl,) = out.glob("attnreg-*.whl")
    return whl


def test_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"attnreg"}, tops
    for must in ("attnreg/backends/webgpu/program.py", "attnreg/backends/opencl/program.py",
                 "attnreg/backends/browser/page.js", "attnreg/shaders/attn_common.wgsl",
                 "attnreg/kernels_cl/decode_core.cl", "attnreg/tools/cli.py",
                 "attnreg/data/profiles.json", "attnreg/data/vkshim.c", "attnreg/py.typed",
                 "attnreg/backends/dawn/plugin.py", "attnreg/distributed/attention.py"):
        assert must in names, must
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    eps = zipfile.ZipFile(wheel).read(meta).decode()
    assert "attnreg = attnreg.tools.cli:main" in eps
    for backend in ("reference", "webgpu", "opencl", "browser", "dawn"):
        assert f"{backend} = attnreg.backends.{backend}.plugin" in eps, eps


def test_installed_wheel_loads_its_plugins(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, timeout=300)
    probe = (
        "import attnreg, attnreg.backends.webgpu.program as p, importlib.resources as r\n"
        "from attnreg import registry\n"
        "print(attnreg.__file__); print(p.__file__)\n"
        "print(sorted(f.name for f in r.files('attnreg.kernels_cl').iterdir()"
        " if f.name.endswith('.cl'))[:1])\n"
        "print(sorted(registry.get().backends()))\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith(str(site)) and lines[1].startswith(str(site)), lines
    assert lines[2] == "['common.cl']", lines
    assert lines[3] == "['browser', 'dawn', 'opencl', 'reference', 'webgpu']", lines
