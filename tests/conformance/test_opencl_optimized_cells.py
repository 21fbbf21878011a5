"""The float16 OpenCL kernels' non-finite cells, built with PoCL's optimizer on.

The rest of the suite builds OpenCL programs without it (tests/conftest.py: most of CI's
cold compile time). An optimizer that assumed finite floats, or folded -inf and NaN the
contract keeps apart, shows in these cells first; the probe's compiler check covers the
optimizer on every device as well (backends/opencl/compiler_check.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attnreg.backends.opencl import program
from tests.support import OPTIMIZED_MODULE, backend_cells, cell_test, module_cells

test_cell = cell_test(OPTIMIZED_MODULE)


@pytest.fixture(scope="module", autouse=True)
def _optimizer_on() -> Iterator[None]:
    """Every build of this module without ATTNREG_OPENCL_BUILD_OPTIONS' -cl-opt-disable (each
    build reads the variable again; programs are cached by their options)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(program.EXTRA_ENV, " ".join(
            o for o in program.env_options() if o != "-cl-opt-disable"))
        yield


def test_builds_here_are_optimized() -> None:
    assert "-cl-opt-disable" not in program.env_options()


def test_module_holds_every_float16_kernels_nonfinite_cells() -> None:
    want = {c.id for c in backend_cells("opencl")
            if c.kind == "nonfinite" and c.spec.dtype == "float16"}
    assert len(want) >= 20 and {c.id for c in module_cells(OPTIMIZED_MODULE)} == want
