"""OpenCL conformance on the local device (PoCL in CI): every variant x dtype x contract
feature against the float64 reference, over a covering subset of the issue's axes.

The device is the first available OpenCL device, or the one whose id or name contains
$ATTNREG_OPENCL_DEVICE (e.g. ``ATTNREG_OPENCL_DEVICE=H100`` on the GPU machine).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import cases as ocases
from attnreg.tools import testing
from tests.support import require_devices

DEVICE_ENV = "ATTNREG_OPENCL_DEVICE"


def _device() -> attnreg.DeviceCaps | None:
    try:
        devs = [d for d in attnreg.devices("opencl") if d.available]
    except Exception:
        return None
    want = os.environ.get(DEVICE_ENV, "").lower()
    if want:
        devs = [d for d in devs if want in d.id.lower() or want in d.name.lower()]
    return devs[0] if devs else None


DEV = _device()
SLUG = DEV.slug if DEV is not None else "nodevice"
CASES = ocases.for_device(DEV) if DEV is not None else ocases.build()


@pytest.fixture(scope="module")
def session():
    require_devices("opencl")
    if DEV is None:
        pytest.fail(f"no OpenCL device matches ${DEVICE_ENV}={os.environ.get(DEVICE_ENV)!r}")
    with attnreg.Session(backend="opencl", device=DEV.id) as s:
        yield s


@pytest.mark.parametrize("case", CASES, ids=[f"opencl-{SLUG}-{c.name}" for c in CASES])
def test_conformance(session, case):
    err, why = ocases.run_case(session, case)
    assert not why, f"{case.name}: {why}\nspec={case.spec!r}"
    assert np.isfinite(err)


def test_every_axis_value_in_every_variant():
    allcases = ocases.build()
    for var in ocases.VARIANTS:
        seen = ocases.axis_values([c for c in allcases if c.variant == var])
        assert seen["dtype"] == {"float32", "float16"}, var
        assert seen["gqa"] == {1, 4, 7}, var
        layouts = {(a, b) for a in ("BSNH", "BNSH") for b in ("BSNH", "BNSH")}
        if var.endswith("-paged"):
            layouts = {(a, "paged") for a in ("BSNH", "BNSH")}
            pages = {c.spec.page_size for c in allcases if c.variant == var}
            assert pages == set(ocases.PAGE_SIZES), var
        assert seen["layouts"] == layouts, var
        feats = ocases.skip_features if "-bs" in var else testing.contract_features
        assert seen["feature"] == {f[0] for f in feats(1, 1, 1, 1)}, var
        if "-emu" in var or "-bs" in var:
            continue       # small shapes (emulated shuffles), or fewer slots (bias features)
        assert seen["head_size"] == set(ocases.HEADS), var
        assert seen["seq_len"] == set(ocases.SEQ), var
        totals = seen["total_len"]
        assert 1 in totals and any(t > 1000 for t in totals), (var, totals)
        # both sides of a tile boundary
        assert any(t % 32 in (31, 0, 1) and t > 1 for t in totals), (var, totals)
    totals = ocases.axis_values(allcases)["total_len"]
    assert {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129} <= totals


def test_block_skip_cases_skip_blocks():
    """The document-mask cases really leave whole blocks out (and mark zero blocks)."""
    from attnreg import blocks
    docs = [c for c in ocases.build(("prefill-wgmem-bs",)) if c.feature.startswith("docs")]
    assert docs
    skipped = zero = 0
    for c in docs:
        bl = blocks.build(c.spec, ocases.tensors_for(c)["bias"], 16, 16)
        skipped += bl.density < 1.0
        zero += int(bl.zero.sum()) > 0
    assert skipped >= 2 and zero >= 1


def test_case_ids_read_like_sentences():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert any(n.startswith("decode_partial-f16-m4-gqa4") for n in names)
    assert all(" " not in n for n in names)
