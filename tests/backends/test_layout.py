"""Every backend folder uses the design's file names: one module per concern (plugin, probe,
kernels, rules, program, device, runtime, memory), the same name for the same concern in every
backend, and beyond those only the extras declared here, each under the concern it serves. The
backend's name is ``NAME`` in its probe module (in its plugin where it has no probe)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from attnreg.hookspecs import BackendInfo

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "backends"
# The design's modules, one per concern (docs/architecture.md "backends/: one plugin each").
CONCERNS = ("plugin", "probe", "kernels", "rules", "program", "device", "runtime", "memory")
# Files beyond the design's names, by the concern they belong to. A new file takes a design
# name, or a name here (the one every backend uses for that thing), or joins this list.
EXTRAS: dict[str, tuple[str, ...]] = {
    "probe": ("compiler_check.py", "mma_probe.py",          # checks a probe runs on the device
              "gemm_probe.py", "gemm_wgsl.py"),             # the matrix units' rate, its WGSL
    "kernels": ("tiles.py", "mma.py"),                      # tile geometry, matrix-unit variants
    "program": ("wgsl_io.py",                               # WGSL loads and stores per storage
                "unroll.py"),                               # loops written out at build time
    "device": ("toggles.py",                                # Dawn's device toggles
               "interop.py"),                               # devices the caller opened
    "runtime": ("quantize.py",                              # KV cache appends on the device
                "timing.py",                                # the runtime's launch timings
                "copy_probe.py",                            # the copy roof the bench uses
                "chromium.py", "server.py", "host.py", "wire.py",   # the browser's host side
                "page.html", "page.js", "wire.js"),                 # and its page
    "plugin": ("export.py", "export_runtime.js", "check.html", "check.js"),   # export-wgsl
}
# Names that hold the backend's name in any other module than the probe.
NAME_HOLDERS = ("NAME", "BACKEND")


def _folders() -> list[Path]:
    return sorted(p for p in BACKENDS.iterdir() if (p / "__init__.py").is_file())


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix != ".pyc")


def _allowed() -> set[str]:
    return {"__init__.py", *(f"{c}.py" for c in CONCERNS), *(f for fs in EXTRAS.values() for f in fs)}


def test_extras_are_declared_under_design_concerns_once() -> None:
    assert set(EXTRAS) <= set(CONCERNS)
    names = [f for fs in EXTRAS.values() for f in fs]
    assert len(names) == len(set(names)), "an extra listed under two concerns"
    assert not {f"{c}.py" for c in CONCERNS} & set(names)


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_backend_files_have_the_design_names(folder: Path) -> None:
    stray = [f for f in _files(folder) if f not in _allowed()]
    assert not stray, (f"backends/{folder.name}: {stray} are not the design's names "
                       f"({', '.join(CONCERNS)}) or a declared extra; rename, or declare the "
                       "concern's extra in tests/backends/test_layout.py")
    assert "plugin.py" in _files(folder)


def test_every_extra_is_used() -> None:
    used = {f for folder in _folders() for f in _files(folder)}
    assert not [f for fs in EXTRAS.values() for f in fs if f not in used]


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: p.name)
def test_the_backend_name_is_probe_name(folder: Path) -> None:
    """One place for the name: probe.NAME (plugin.NAME without a probe module); the plugin's
    BackendInfo reports it, and no other module defines a name of its own."""
    home = "probe" if (folder / "probe.py").is_file() else "plugin"
    module = importlib.import_module(f"attnreg.backends.{folder.name}.{home}")
    assert folder.name == module.NAME
    for path in folder.glob("*.py"):
        if path.stem == home:
            continue
        tree = ast.parse(path.read_text())
        defined = [t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                   for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                   if isinstance(t, ast.Name) and t.id in NAME_HOLDERS]
        assert not defined, f"backends/{folder.name}/{path.name} defines {defined}"
    plugin = importlib.import_module(f"attnreg.backends.{folder.name}.plugin")
    backends = [v for v in vars(plugin).values() if isinstance(v, BackendInfo)]
    assert [b.name for b in backends] == [folder.name]
