"""The unified conformance generator's WebGPU cells (attnreg.tools.cases; every kernel against
the float64 reference, lavapipe in CI) of the prefill and the reduce, and the whole device's
axis coverage; the decodes' cells run in modules of their own (tests.support.CELL_MODULES)."""

from __future__ import annotations

import attnreg
from attnreg.tools import cases
from tests.support import assert_covering, cell_test, require_devices

test_cell = cell_test("test_webgpu_cells")


def test_cells_cover_every_axis_value() -> None:
    """What CI runs (the quick matrix) on the WebGPU device: every head size 32..256, seq_len,
    GQA ratio, layout pair, tile-edge and > 1000 total, contract feature per (kernel, dtype),
    page size and document mask (tests.support.assert_covering)."""
    devs = require_devices("webgpu")[:1]
    cells = cases.cases(devs, quick=True)
    kernels = [k for k in attnreg.kernels("webgpu") if k.features <= devs[0].features]
    assert_covering(cells, kernels)
    ids = {c.id for c in cells}
    assert f"webgpu-{devs[0].slug}-decode_partial-f16-m4-gqa4-h32-gqa4" in ids
