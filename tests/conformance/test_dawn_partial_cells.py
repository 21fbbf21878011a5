"""Dawn's decode_partial cells (lavapipe through attnreg's Vulkan shim in CI) against the float64 reference: a
module of their own, so that pytest-xdist's loadfile mode can give the matrix to both workers
(tests.support.CELL_MODULES)."""

from tests.support import cell_test

test_cell = cell_test("test_dawn_partial_cells")
