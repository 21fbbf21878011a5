"""Dawn's conformance cells (attnreg.tools.cases, lavapipe through attnreg's Vulkan shim in CI)
against the float64 reference, but decode_partial's (tests/conformance/
test_dawn_partial_cells.py: tests.support.CELL_MODULES)."""

from __future__ import annotations

import attnreg
from tests.support import backend_cells, cell_test, require_devices

test_cell = cell_test("test_dawn_cells")


def test_every_dawn_kernel_has_cells() -> None:
    require_devices("dawn")
    ids = {k.id for k in attnreg.kernels() if k.backend == "dawn"}
    covered = {c.kernel for c in backend_cells("dawn")}
    assert ids and ids <= covered, sorted(ids - covered)
