"""Per-module hygiene: the process-wide default Sessions (attnreg.run(..., backend=...),
attnreg.merge_states(..., backend=...)) are closed when a module ends, so a browser or
device they opened never outlives the module that asked for it (pytest-xdist runs several
modules in one worker, and tests/backends/browser/test_engine.py checks that no browser is left running)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from attnreg import api
from attnreg.backends.opencl import program as opencl_program

# Every OpenCL program the suite builds is compiled cold in CI (PoCL on two cores), and LLVM's
# optimizer is most of that cost: without it the OpenCL tests take a third to a half of the
# time (ci/results/cpu_ci_time.txt). The kernels' math is what the suite checks, so it builds
# unoptimized by default; tests/conformance/test_opencl_optimized_cells.py runs the float16
# kernels' non-finite cells with the optimizer on, where its float assumptions would show, and
# the probe's compiler check (backends/opencl/compiler_check.py) still checks the optimizer on
# every device. ATTNREG_OPENCL_BUILD_OPTIONS= (empty) runs the whole suite optimized.
os.environ.setdefault(opencl_program.EXTRA_ENV, "-cl-opt-disable")


@pytest.fixture(scope="module", autouse=True)
def _close_default_sessions() -> Iterator[None]:
    yield
    with api._LOCK:
        sessions = list(api._DEFAULT.values())
        api._DEFAULT.clear()
    for s in sessions:
        s.close()


_LOADER_VARS = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES")


@pytest.fixture(scope="module", autouse=True)
def _vulkan_driver_list_unchanged(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that leaves the Vulkan loader's driver list changed breaks the modules after it
    in the same worker (Chromium, started later, then finds no SwiftShader): restore it and
    fail the module that leaked it."""
    before = {v: os.environ.get(v) for v in _LOADER_VARS}
    yield
    after = {v: os.environ.get(v) for v in _LOADER_VARS}
    for v, old in before.items():
        if old is None:
            os.environ.pop(v, None)
        else:
            os.environ[v] = old
    assert after == before, f"{request.module.__name__} left the Vulkan driver list changed: {after}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The quick-matrix modules first. pytest-xdist's loadfile mode hands whole modules to the
    two workers in collection order, and those are the longest (one to three minutes each,
    ci/results/cpu_ci_time.txt): run first, the short modules even out the end instead of one
    long module running alone. The sort is stable, so every other order stays as collected."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/conformance/") else 1)
