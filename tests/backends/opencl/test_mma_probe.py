"""The tensor-core probe of the OpenCL backend (backends/opencl/mma_probe.py): tried only on
NVIDIA sm_80+, never raises, and its answer is cached per device and driver. The kernel
itself ran right on the H100 (NVIDIA OpenCL 3.0, sm_90; a deliberately wrong fragment layout
gave max error 9.9 and was reported, a bad PTX opcode a build failure); here PoCL shows the
failure path on a real device."""

from __future__ import annotations

import json
import types

import pytest

from attnreg.backends.opencl import mma_probe
from tests.support import pocl_cl_device, require_devices


def test_only_nvidia_sm80_and_later_are_tried() -> None:
    assert "not NVIDIA" in (mma_probe.applies("Portable Computing Language", "") or "")
    assert "sm_75 < sm_80" in (mma_probe.applies("NVIDIA CUDA", "sm_75") or "")
    assert "unknown" in (mma_probe.applies("NVIDIA CUDA", "") or "")
    assert mma_probe.applies("NVIDIA CUDA", "sm_90") is None


_pocl = pocl_cl_device


def test_probe_devices_say_why_there_is_no_mma() -> None:
    for d in require_devices("opencl"):
        if "nvidia" not in d.extra["platform"].lower():
            assert mma_probe.FEATURE not in d.features
            assert "not NVIDIA" in d.extra["ptx_mma"]


def test_a_device_that_cannot_run_the_kernel_is_a_reason_not_an_error() -> None:
    cl, dev = _pocl()
    why = mma_probe.run_probe(cl, dev)            # PoCL has no PTX: the build fails
    assert why is not None and "probe kernel failed" in why


def test_the_answer_is_cached_per_device_and_driver(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path) -> None:
    cl, dev = _pocl()
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    nvidia_like = types.SimpleNamespace(name="NVIDIA CUDA", version="OpenCL 3.0 CUDA 13.0")
    ok, why = mma_probe.check(cl, dev, nvidia_like, "sm_90")
    assert not ok and "failed" in why and "cached" not in why
    stored = json.loads((tmp_path / mma_probe.CACHE_FILE).read_text())
    key = mma_probe.cache_key(str(dev.name), str(dev.driver_version), nvidia_like.version)
    assert stored[key]["error"] is None and stored[key]["failure"]   # measured, not judged
    calls = []
    monkeypatch.setattr(mma_probe, "measure",
                        lambda *a: calls.append(a) or mma_probe.Measured(error=0.0))
    ok2, why2 = mma_probe.check(cl, dev, nvidia_like, "sm_90")
    assert (ok2, calls) == (False, []) and why2.endswith("(cached)")
    other = types.SimpleNamespace(name="NVIDIA CUDA", version="OpenCL 3.0 CUDA 13.1")
    assert mma_probe.check(cl, dev, other, "sm_90")[0] is True and len(calls) == 1  # new driver
