"""The bfloat16 twins of the OpenCL tensor-core kernels (opencl.prefill.bf16.mma,
opencl.decode_partial.bf16.mma, opencl.decode_fused.bf16.mma): the f16 kernels' sources built
with -D IS_BF16=1, so the fragments hold bf16 bits, mma.sync multiplies .bf16 and P is rounded
to bf16.

The primitive (kernels_cl/mma_sync.cl) and P's rounding against numpy / ml_dtypes; the kernels
against the float64 reference where bf16 differs from f16 (values beyond f16's range are
finite, the non-finite tests read bf16's exponent), the lazy max and the non-finite v paths;
the declarations and the selection. PoCL runs the emulated build; a device where the probe
found mma.sync (the H100) runs the hardware build too. The generated conformance cells of
tests/conformance/test_opencl_cells.py cover the contract features.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import mma as omma
from attnreg.backends.opencl import mma_probe, program
from attnreg.spec import AttentionSpec
from tests.backends.opencl.test_mma import (
    BUILDS,
    CHECK_SOURCE,
    IDS,
    TAU,
    _growing,
    _nvidia_like,
    check_declared_local_memory,
    pocl,  # noqa: F401  (the fixture)
)
from tests.support import check_close, make_tensors

BF16 = ml_dtypes.bfloat16
PREFILL, PARTIAL, FUSED = ("opencl.prefill.bf16.mma", "opencl.decode_partial.bf16.mma",
                           "opencl.decode_fused.bf16.mma")
TWINS = {PREFILL: "opencl.prefill.f16.mma", PARTIAL: "opencl.decode_partial.f16.mma",
         FUSED: "opencl.decode_fused.f16.mma"}
TWINS_OF = {f16: bf16 for bf16, f16 in TWINS.items()}
ROUTE = {PREFILL: "prefill", PARTIAL: "split_kv", FUSED: "split_kv_fused"}
# A bf16 value whose exponent has f16's exponent bits (0x7c00) all set: finite, but an f16
# non-finite test on its bits would call it inf / NaN.
HUGE = float(np.float32(1.5 * 2.0**121))


# -- the primitive -----------------------------------------------------------------------
def _program(dev: attnreg.DeviceCaps, build: str) -> tuple[Any, Any, Any]:
    import pyopencl as cl

    ctx, _ = odevice.context(dev)
    hw = build == "hardware"
    opts = ["-cl-std=CL1.2", "-DWG=64", "-DIS_BF16=1", f"-DMMA={omma.MMA_IMPLS[build]}",
            f"-DCVT_PTX={int(hw)}"]
    prog = cl.Program(ctx, program.read_file("mma_sync.cl") + CHECK_SOURCE).build(options=opts)
    return cl, ctx, prog


def _product(dev: attnreg.DeviceCaps, build: str, a: np.ndarray, b: np.ndarray,
             c: np.ndarray) -> np.ndarray:
    """D = A B + C for two warps' problems (a [2,16,16], b [2,16,8] bf16; c [2,16,8] f32)."""
    cl, ctx, prog = _program(dev, build)
    queue = cl.CommandQueue(ctx)
    mf = cl.mem_flags
    bt = np.ascontiguousarray(b.transpose(0, 2, 1))           # column-major: k runs fastest
    bufs = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x))
            for x in (a.view(np.uint16), bt.view(np.uint16), c.astype(np.float32))]
    d = np.zeros((2, 16, 8), np.float32)
    dd = cl.Buffer(ctx, mf.WRITE_ONLY, d.nbytes)
    prog.mma_check(queue, (64,), (64,), *bufs, dd)
    cl.enqueue_copy(queue, d, dd)
    queue.finish()
    return d


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("seed", range(3))
def test_primitive_is_the_bf16_matrix_product(dev, build, seed):
    rng = np.random.default_rng(seed)
    # magnitudes far beyond f16's range: only a bf16 reading of the bits gets them right
    a = (rng.standard_normal((2, 16, 16)) * 1e6).astype(BF16)
    b = (rng.standard_normal((2, 16, 8)) * 1e-3).astype(BF16)
    c = (rng.standard_normal((2, 16, 8)) * (seed % 2)).astype(np.float32)
    got = _product(dev, build, a, b, c)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
def test_primitive_keeps_non_finite_values_in_their_row_and_column(dev, build):
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(BF16)
    b = rng.standard_normal((2, 16, 8)).astype(BF16)
    a[0, 3, 5], a[1, 12, 0] = np.nan, np.inf
    b[0, 7, 6], b[1, 2, 1] = -np.inf, np.nan
    got = _product(dev, build, a, b, np.zeros((2, 16, 8), np.float32))
    bad = np.zeros((2, 16, 8), bool)
    bad[0, 3, :] = bad[0, :, 6] = bad[1, 12, :] = bad[1, :, 1] = True
    assert np.array_equal(~np.isfinite(got), bad)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
def test_pack_rounds_to_nearest_even_bf16(dev, build):
    cl, ctx, prog = _program(dev, build)
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, 1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20,
             65504.0, 65520.0, 1e9, -1e9, HUGE, 3.3895314e38, 3.3961776e38,
             float(np.finfo(np.float32).max), np.inf, -np.inf, 1.2e-38, 1e-40, -3e-42, 1e-45,
             2980.96, 0.5]
    x = np.concatenate([np.array(edges, np.float32),
                        (rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 38, 2000))
                        .astype(np.float32), [np.nan, 1.0, -np.nan, 2.0]]).astype(np.float32)
    queue = cl.CommandQueue(ctx)
    mf = cl.mem_flags
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    y = np.zeros(x.size // 2, np.uint32)
    yb = cl.Buffer(ctx, mf.WRITE_ONLY, y.nbytes)
    prog.pack_check(queue, (y.size,), None, xb, yb)
    cl.enqueue_copy(queue, y, yb)
    queue.finish()
    got = y.view(np.uint16).view(BF16)              # little-endian: lo, hi in order
    want = x.astype(BF16)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


# -- the kernels -------------------------------------------------------------------------
def _run(dev: attnreg.DeviceCaps, build: str, kernel: str, spec: AttentionSpec,
         t: dict[str, np.ndarray], **params: Any) -> tuple[Any, Any]:
    flags: dict[str, Any] = {"route": ROUTE[kernel]}
    if kernel != PREFILL:
        flags["split_size"] = params.pop("split_size", 64)
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        return s.run_with_plan(spec, t, kernel=kernel, params={"mma": build, **params})


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
    got, plan = _run(dev, build, kernel, spec, t)
    assert plan.stages[0].kernel == kernel
    out = np.asarray(got[0] if isinstance(got, tuple) else got).astype(np.float32)
    assert np.isfinite(out).all()
    check_close(spec, got, t, what=f"{kernel} {build}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kernel", list(TWINS), ids=["prefill", "partial", "fused"])
def test_non_finite_v_poisons_only_the_columns_of_rows_that_see_it(dev, build, kernel):
    spec = _spec(kernel, num_heads=4)
    t = make_tensors(spec, seed=4)
    j = spec.capacity - spec.seq_len + 2          # rows i >= 2 of kv head 1 see it
    t["v"][0, j, 1, 3] = np.nan
    t["v"][0, j, 1, 40] = np.inf
    t["v"][1, spec.capacity - 1, 0, 63] = -np.inf     # the last row only
    t["v"][1, 5, 0, 8] = np.nan                       # every row
    got, plan = _run(dev, build, kernel, spec, t)
    out = got[0]
    assert np.isnan(out[0, 2:, 2:4, 3]).all() and not np.isnan(out[0, :2, 2:4, 3]).any()
    assert np.isnan(out[0, 2:, 2:4, 40]).all() and not np.isnan(out[0, :2, 2:4, 40]).any()
    assert np.isnan(out[1, -1, 0:2, 63]).all() and not np.isnan(out[1, :-1, 0:2, 63]).any()
    assert np.isnan(out[1, :, 0:2, 8]).all()
    check_close(spec, got, t, what=f"{plan.stages[0].kernel} {build}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kernel", [PREFILL, FUSED], ids=["prefill", "fused"])
@pytest.mark.parametrize("shape", ["up", "saw"])
def test_lazy_max_rescales_when_the_logits_grow_past_tau(dev, build, kernel, shape):
    prefill = kernel == PREFILL
    spec = AttentionSpec(batch=1, seq_len=48 if prefill else 1,
                         past_len=208 if prefill else 255, num_heads=2, kv_num_heads=1,
                         head_size=64, dtype="bfloat16", causal=True, return_lse=True,
                         q_layout="BSNH", kv_layout="BSNH")
    t = _growing(spec, 11, shape)
    logits = (t["q"][0, :, 0].astype(np.float64) @ t["k"][0, :, 0].astype(np.float64).T) \
        * spec.effective_scale
    assert np.ptp(logits[-1]) > 4 * TAU
    params: dict[str, Any] = dict(kv_tile=32) if prefill else dict(split_size=256, wg=32)
    got, plan = _run(dev, build, kernel, spec, t, **params)
    check_close(spec, got, t, what=f"{plan.stages[0].kernel} {shape}")


@pytest.mark.parametrize(("fields", "params"), [
    (dict(head_size=128, kv_layout="paged", page_size=16, seqlens_k=True, bias=True,
          head_sink=True), dict(q_tile=64, kv_tile=32, prefetch=1)),   # fits 48 KiB emulated
    (dict(head_size=256, q_layout="BNSH", kv_layout="BNSH", local_window=20,
          alibi_max_bias=8.0, softcap=5.0), dict(q_tile=32, kv_tile=16)),
], ids=["h128-paged", "h256-bnsh"])
@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
def test_prefill_on_paged_caches_and_large_heads(dev, build, fields, params):
    f: dict[str, Any] = dict(batch=2, seq_len=37, past_len=90, num_heads=8, kv_num_heads=2,
                             dtype="bfloat16", causal=True, return_lse=True, **fields)
    if f.get("seqlens_k"):
        f["kv_capacity"] = 140
    if f.get("kv_layout") == "paged":
        f["num_pages"] = 2 * -(-140 // f["page_size"]) + 3
    spec = AttentionSpec(**f)
    t = make_tensors(spec, seed=2, mask_frac=0.1 if spec.bias else 0.0,
                     lengths=(140, 61) if spec.seqlens_k else None)
    got, plan = _run(dev, build, PREFILL, spec, t, **params)
    assert {k: plan.stages[0].params[k] for k in params} == params
    check_close(spec, got, t, what=f"{PREFILL} {params}")


def test_declared_local_memory_is_what_the_build_uses(pocl):  # noqa: F811
    check_declared_local_memory(pocl, PREFILL, [
        (AttentionSpec(seq_len=33, past_len=70, num_heads=4, kv_num_heads=2, head_size=h,
                       dtype="bfloat16"), {"q_tile": q, "kv_tile": kv})
        for h, q, kv in ((64, 64, 32), (256, 32, 16))])
    for kid in (PARTIAL, FUSED):
        check_declared_local_memory(pocl, kid, [
            (AttentionSpec(seq_len=4, past_len=70, num_heads=8, kv_num_heads=2, head_size=128,
                           dtype="bfloat16"), {"m_tile": 4, "wg": 128, "n_splits": 2})])


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
        assert k.kv_dtypes == f16.kv_dtypes == {"int8", "int4"}    # test_opencl_mma_quant


def test_quantized_kv_in_bf16_selects_the_twins_as_the_f16_kernels(pocl):  # noqa: F811
    """int8 / int4 K/V (tests/backends/opencl/test_mma_quant.py) in bf16: the same choice and tiles as
    the f16 kernels (the quantized decode's tiles rule included)."""
    nv = _nvidia_like(pocl)
    nv = nv.model_copy(update={"features": nv.features | {"subgroups"}})
    for kv, seq_len, past_len in (("int8", 1, 8191), ("int4", 1, 8191), ("int8", 512, 0)):
        spec = AttentionSpec(seq_len=seq_len, past_len=past_len, num_heads=32, kv_num_heads=8,
                             head_size=128, dtype="bfloat16", kv_dtype=kv, causal=True)
        plan = attnreg.explain(spec, caps=nv)
        twin = attnreg.explain(spec.model_copy(update={"dtype": "float16"}), caps=nv)
        assert [s.kernel for s in plan.stages] == [TWINS_OF[s.kernel] for s in twin.stages]
        assert plan.stages[0].kernel in TWINS
        assert plan.stages[0].params == twin.stages[0].params


def test_auto_picks_them_on_nvidia_as_the_f16_kernels(pocl):  # noqa: F811
    nv = _nvidia_like(pocl)
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


def test_matrix_units_emulate_runs_them_on_pocl_and_auto_passes_them_over(pocl):  # noqa: F811
    spec = AttentionSpec(seq_len=64, num_heads=8, kv_num_heads=2, head_size=64,
                         dtype="bfloat16", causal=True)
    t = make_tensors(spec, seed=2)
    flags = {"matrix_units": "emulate", "route": "prefill"}
    with attnreg.Session(backend="opencl", device=pocl.id, flags=flags) as s:
        got, ran = s.run_with_plan(spec, t)
    assert ran.kernel == PREFILL and ran.stages[0].params["mma"] == "emulate"
    check_close(spec, got, t, what=ran.kernel)
    auto = attnreg.explain(spec, caps=pocl, flags={"route": "prefill"})
    assert auto.kernel != PREFILL
    assert any("matrix_units=auto" in r for r in auto.rejected[PREFILL])
