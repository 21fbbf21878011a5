"""The unified conformance generator's OpenCL cells (attnreg.tools.cases; every kernel against
the float64 reference, PoCL in CI) of the prefill, the reduce and the unfused decode (the
decode_partial and decode_fused cells run in modules of their own: tests.support.CELL_MODULES),
the whole device's axis coverage, the sub-group kernels' emulation on
a device without sub-groups, and document masks that really skip blocks.

The device is tests.support.opencl_device(): the first available OpenCL device, or the one whose
id or name contains $ATTNREG_OPENCL_DEVICE (e.g. ``ATTNREG_OPENCL_DEVICE=H100`` on the GPU machine).
"""

from __future__ import annotations

import pytest

import attnreg
from attnreg import blocks
from attnreg.tools import cases, conformance
from tests.support import (
    assert_covering,
    cell_test,
    require_opencl_device,
)

test_cell = cell_test("test_opencl_cells")


@pytest.fixture(scope="module")
def dev() -> attnreg.DeviceCaps:
    return require_opencl_device()


@pytest.fixture(scope="module")
def cells(dev: attnreg.DeviceCaps) -> list[cases.Case]:
    return cases.cases([dev], quick=True)      # what CI runs on this device


def test_cells_cover_every_axis_value(dev, cells):
    """What CI runs (the quick matrix): every head size 32..256, seq_len, GQA ratio, layout
    pair, tile-edge and > 1000 total, contract feature per (kernel, dtype), page size and
    document mask; every kernel, the sub-group ones emulated where the device has none."""
    assert_covering(cells, attnreg.kernels("opencl"))
    totals = {c.spec.total_len for c in cells}
    assert {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129} <= totals


def test_sub_group_kernels_run_emulated_without_sub_groups(dev, cells):
    """A device without sub-groups runs the sg kernels' own code with the shuffles emulated
    (KernelInfo.emulation), as ordinary forced kernels; the registry still refuses them
    without those params."""
    sg = [k for k in attnreg.kernels("opencl") if "subgroups" in k.features]
    assert sg and all(k.emulation == {"sg_impl": "emu"} for k in sg)
    spec = attnreg.AttentionSpec(seq_len=1, past_len=40, head_size=32)
    for k in sg:
        mine = [c for c in cells if c.kernel == k.id]
        assert mine, k.id
        if "subgroups" in dev.features:
            assert not any(c.emulated for c in mine)
            continue
        assert all(c.emulated and dict(c.params)["sg_impl"] == "emu" and "-emu-" in c.id
                   for c in mine), k.id
        assert "device lacks feature(s) subgroups" in " ".join(k.not_supported_reasons(
            spec.replace(dtype=sorted(k.dtypes)[0]), dev))


def test_emulated_cell_runs_through_session_run(dev, cells):
    cell = next(c for c in cells if c.emulated and c.family == "decode_fused"
                and c.kind == "covering")
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        r = conformance.run_case(cell, s)
    assert r.status == "pass", r.message


def test_block_skip_cells_skip_blocks(cells):
    """The document-mask cells really leave whole blocks out (and mark zero blocks)."""
    docs = [c for c in cells if c.docs and c.kernel.endswith(".bs") and c.family == "prefill"]
    assert docs
    skipped = zero = 0
    for c in docs:
        bl = blocks.build(c.spec, conformance.inputs_for(c)["bias"], 16, 16)
        skipped += bl.density < 1.0
        zero += int(bl.zero.sum()) > 0
    assert skipped >= 2 and zero >= 1


def test_cell_ids_read_like_sentences(dev, cells):
    names = [c.id for c in cells]
    assert len(names) == len(set(names))
    assert f"opencl-{dev.slug}-decode_partial-f16-m4-gqa4-h32-gqa4" in names
    assert any(n.startswith(f"opencl-{dev.slug}-decode_partial-f32-m1-gqa") and n.endswith("-partial")
               for n in names)
    assert all(" " not in n for n in names)
