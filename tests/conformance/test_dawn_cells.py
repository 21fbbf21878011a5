"""Dawn's conformance cells (attnreg.tools.cases, lavapipe through attnreg's Vulkan shim in CI)
against the float64 reference, in a module of their own (tests.support.CELL_MODULES)."""

from __future__ import annotations

import attnreg
from attnreg.tools.cases import Case
from tests.support import CellRunner, module_cells, parametrize_cells, require_devices

CELLS = module_cells("test_dawn_cells")


def test_every_dawn_kernel_has_cells() -> None:
    require_devices("dawn")
    ids = {k.id for k in attnreg.kernels() if k.backend == "dawn"}
    covered = {c.kernel for c in CELLS}
    assert ids and ids <= covered, sorted(ids - covered)


@parametrize_cells(CELLS)
def test_cell(runner: CellRunner, case: Case) -> None:
    runner.check(case)
