"""The unified conformance generator's Dawn cells (attnreg.tools.cases; every kernel against the
float64 reference, lavapipe through attnreg's Vulkan shim in CI). A module of their own, so
pytest-xdist's loadfile mode keeps them on one worker (tests.support.CELL_MODULES)."""

from __future__ import annotations

import attnreg
from attnreg.tools import cases
from tests.support import CellRunner, module_cells, parametrize_cells, require_devices

CELLS = module_cells("test_dawn_cells")


@parametrize_cells(CELLS)
def test_cell(runner: CellRunner, case: cases.Case) -> None:
    runner.check(case)


def test_every_dawn_kernel_has_cells() -> None:
    require_devices("dawn")
    ids = {k.id for k in attnreg.kernels() if k.backend == "dawn"}
    covered = {c.kernel for c in CELLS}
    assert ids and ids <= covered, sorted(ids - covered)
