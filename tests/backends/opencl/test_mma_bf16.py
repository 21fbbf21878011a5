"""What only the bfloat16 twins of the OpenCL tensor-core kernels have
(opencl.prefill.bf16.mma, opencl.decode_partial.bf16.mma, opencl.decode_fused.bf16.mma: the
f16 kernels' sources built with -D IS_BF16=1, so the fragments hold bf16 bits, mma.sync
multiplies .bf16 and P is rounded to bf16): values beyond f16's range stay finite (the
non-finite tests read bf16's exponent), against the float64 reference; the declarations as
the f16 kernels' twins and a selection the f16 kernels' own.

The tests the twins share with the f16 kernels (the primitive and P's rounding, the lazy max,
non-finite v, paged caches, the declared local memory, matrix_units) run over both dtypes in
test_mma.py (prefill) and test_mma_decode.py (decodes); the generated conformance cells of
tests/conformance/test_opencl_cells.py cover the contract features.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import mma as omma
from attnreg.backends.opencl import mma_probe
from attnreg.spec import AttentionSpec
from tests.backends.opencl.mma_support import BUILDS, HUGE, IDS, nvidia_like, run
from tests.support import check_close, make_tensors

BF16 = ml_dtypes.bfloat16
PREFILL, PARTIAL, FUSED = ("opencl.prefill.bf16.mma", "opencl.decode_partial.bf16.mma",
                           "opencl.decode_fused.bf16.mma")
TWINS = {PREFILL: "opencl.prefill.f16.mma", PARTIAL: "opencl.decode_partial.f16.mma",
         FUSED: "opencl.decode_fused.f16.mma"}
TWINS_OF = {f16: bf16 for bf16, f16 in TWINS.items()}


# -- the kernels -------------------------------------------------------------------------
def _spec(kernel: str, **kw: Any) -> AttentionSpec:
    f: dict[str, Any] = dict(batch=2, num_heads=8, kv_num_heads=2, head_size=64,
                             dtype="bfloat16", causal=True, return_lse=True,
                             q_layout="BSNH", kv_layout="BSNH")
    f.update(dict(seq_len=40, past_len=60) if kernel == PREFILL else
             dict(seq_len=4, past_len=196))
    f.update(kw)
    return AttentionSpec(**f)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kernel", list(TWINS), ids=["prefill", "partial", "fused"])
def test_values_beyond_f16_range_are_finite(dev, build, kernel):
    """q and v far beyond f16's 65504 (finite bf16): the products, the staging and the
    non-finite tests read bf16, so the output is the reference's, never NaN."""
    spec = _spec(kernel)
    t = make_tensors(spec, seed=5)
    t["q"][:] = (t["q"].astype(np.float32) * 1e5).astype(BF16)
    t["k"][:] = (t["k"].astype(np.float32) * 1e-5).astype(BF16)
    j = spec.capacity - spec.seq_len + 2          # rows i >= 2 see it
    t["v"][0, j, 1, 3] = HUGE
    t["v"][1, 5, 0, 8] = -HUGE                    # every row
    t["v"][1, j, 0, 9] = 1e6
    got, plan = run(dev, build, kernel, spec, t)
    assert plan.stages[0].kernel == kernel
    out = np.asarray(got[0] if isinstance(got, tuple) else got).astype(np.float32)
    assert np.isfinite(out).all()
    check_close(spec, got, t, what=f"{kernel} {build}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kernel", list(TWINS), ids=["prefill", "partial", "fused"])
def test_q_k_past_float32_with_scores_within_are_right(dev, build, kernel):
    """q = k = 5e18 in batch 1 (bf16 holds them): q.k = 64 * 2.5e37 = 1.6e39 is beyond float32,
    the logit scale * q.k = 2e38 is not (docs/contract.md "Overflow"). The bf16 builds scale q
    by the scale's power of two as they load it (mma_tile.cl qk_pow2), so the scores stay in
    range: out is the reference's (uniform weights), never NaN. Batch 0 is ordinary. lse, about
    2e38, carries float32's rounding of ~1e31, so out is compared, and the decodes run one
    split (splits merged by such lse lose their key counts: the contract's "Overflow")."""
    spec = _spec(kernel)
    t = make_tensors(spec, seed=6)
    t["q"][1] = BF16(5e18)
    t["k"][1] = BF16(5e18)
    got, plan = run(dev, build, kernel, spec, t, split_size=256)
    assert plan.stages[0].kernel == kernel
    out = np.asarray(got[0]).astype(np.float32)
    assert np.isfinite(out).all()
    check_close(spec.replace(return_lse=False), got[0], t, what=f"{kernel} {build}")


# -- declaration and selection ----------------------------------------------------------
def test_declared_as_the_f16_kernels_bf16_twins():
    reg = attnreg.registry.get()
    for kid, twin in TWINS.items():
        k, f16 = reg.kernel(kid), reg.kernel(twin)
        assert k.dtypes == {"bfloat16"} and k.family == f16.family
        assert k.matrix == omma.PTX_MMA_BF16 and k.matrix.text() == "ptx_mma bf16 16x8x16->f32"
        assert mma_probe.FEATURE in k.features and k.emulation == {"mma": "emulate"}
        assert (k.head_sizes, k.defaults, k.choices, k.priority, k.kv_layouts) == \
            (f16.head_sizes, f16.defaults, f16.choices, f16.priority, f16.kv_layouts)
        assert k.kv_dtypes == f16.kv_dtypes == {"int8", "int4"}    # test_mma_quant.py


def test_quantized_kv_in_bf16_selects_the_twins_as_the_f16_kernels(pocl):
    """int8 / int4 K/V (test_mma_quant.py) in bf16: the same choice and tiles as the f16
    kernels (the quantized decode's tiles rule included)."""
    nv = nvidia_like(pocl)
    nv = nv.model_copy(update={"features": nv.features | {"subgroups"}})
    for kv, seq_len, past_len in (("int8", 1, 8191), ("int4", 1, 8191), ("int8", 512, 0)):
        spec = AttentionSpec(seq_len=seq_len, past_len=past_len, num_heads=32, kv_num_heads=8,
                             head_size=128, dtype="bfloat16", kv_dtype=kv, causal=True)
        plan = attnreg.explain(spec, caps=nv)
        twin = attnreg.explain(spec.model_copy(update={"dtype": "float16"}), caps=nv)
        assert [s.kernel for s in plan.stages] == [TWINS_OF[s.kernel] for s in twin.stages]
        assert plan.stages[0].kernel in TWINS
        assert plan.stages[0].params == twin.stages[0].params


def test_auto_picks_them_on_nvidia_as_the_f16_kernels(pocl):
    nv = nvidia_like(pocl)
    nv = nv.model_copy(update={"features": nv.features | {"subgroups"}})
    prefill = AttentionSpec(seq_len=2048, num_heads=32, kv_num_heads=8, head_size=128,
                            dtype="bfloat16", causal=True)
    decode = AttentionSpec(seq_len=1, past_len=8191, num_heads=32, kv_num_heads=8,
                           head_size=128, dtype="bfloat16", causal=True)
    for spec, kid, rule in ((prefill, PREFILL, "opencl_mma_prefill_nvidia"),
                            (decode, FUSED, "opencl_mma_decode_nvidia")):
        plan = attnreg.explain(spec, caps=nv)
        twin = attnreg.explain(spec.model_copy(update={"dtype": "float16"}), caps=nv)
        assert [s.kernel for s in plan.stages] == [kid]
        assert [s.kernel for s in twin.stages] == [TWINS[kid]]
        assert plan.stages[0].params == twin.stages[0].params
        assert plan.stages[0].params["mma"] == "hardware"
        assert any(r.startswith(rule) for r in plan.rules)
        off = attnreg.explain(spec, caps=nv, flags={"matrix_units": "off"})
        assert kid not in [s.kernel for s in off.stages]
