"""After the README's set-up, the CI devices exist: lavapipe for WebGPU, PoCL for OpenCL.

These talk to wgpu and pyopencl directly (not through attnreg), so a broken install is
told apart from a broken backend. Outside CI a missing device skips; in CI it fails.
"""

from __future__ import annotations

import os

import pytest

from tests.support import IN_CI


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} missing in CI: the README's set-up did not provide it")
    pytest.skip(f"{what} missing on this machine")


def test_wgpu_finds_lavapipe() -> None:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu
        adapters = wgpu.gpu.enumerate_adapters_sync()
    except Exception as exc:          # ImportError or no Vulkan loader
        _missing(f"wgpu/Vulkan ({exc!r})")
        return
    names = [a.info.get("device", "") for a in adapters]
    if not any("llvmpipe" in n for n in names):
        _missing(f"the lavapipe adapter (found {names})")


def test_pyopencl_finds_pocl() -> None:
    try:
        import pyopencl as cl
        platforms = cl.get_platforms()
    except Exception as exc:
        _missing(f"pyopencl/OpenCL ICD ({exc!r})")
        return
    if not any("Portable Computing Language" in p.name for p in platforms):
        _missing(f"the PoCL platform (found {[p.name for p in platforms]})")


def test_attnreg_sees_builtin_backends() -> None:
    import attnreg
    backends = {d.backend for d in attnreg.devices()}
    assert {"reference", "webgpu", "opencl"} <= backends
