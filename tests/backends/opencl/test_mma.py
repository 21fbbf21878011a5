"""The OpenCL tensor-core prefill (opencl.prefill.f16.mma and its bfloat16 twin
opencl.prefill.bf16.mma, kernels_cl/flash_prefill_mma.cl; the twin is the same source built
with -D IS_BF16=1: its fragments hold bf16 bits, mma.sync multiplies .bf16, P is rounded to bf16).

Its primitive (kernels_cl/mma_sync.cl, both element types) against numpy; the kernel's lazy
max (logits that grow by more than TAU across tiles) and non-finite v path, paged caches,
head sizes and tile choices (which the generated cells of conformance/test_opencl_cells.py do
not all reach) against the float64 reference; and how the flag matrix_units selects it. PoCL
runs the emulated build; a device where the probe found mma.sync (the H100) runs the hardware
build too. What only the bfloat16 twins have: test_mma_bf16.py.
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
from tests.backends.opencl.mma_support import (
    BUILDS,
    HUGE,
    IDS,
    TAU,
    cache_inputs,
    check_declared_local_memory,
    check_non_finite_v,
    growing_logits,
    nvidia_like,
    run,
)
from tests.support import check_close, make_tensors

KERNEL = "opencl.prefill.f16.mma"
PREFILL = {"float16": KERNEL, "bfloat16": "opencl.prefill.bf16.mma"}
ELEMENT = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TAGS = {"float16": "f16", "bfloat16": "bf16"}


# -- the primitive -----------------------------------------------------------------------
CHECK_SOURCE = r"""
// Two warps, each its own 16x16 A (row-major f16 as uint pairs), 16x8 B (column-major) and
// 16x8 C (f32): D = A B + C through MMA_SYNC, fragments as mma_sync.cl lays them out.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void mma_check(__global const uint* a, __global const uint* b, __global const float* c,
               __global float* d) {
  MMA_SCRATCH_DECL
  const int lid = get_local_id(0), w = lid / 32, g = (lid & 31) >> 2, t = lid & 3;
  a += 128 * w;
  b += 64 * w;
  c += 128 * w;
  d += 128 * w;
  const uint4 af = (uint4)(a[8 * g + t], a[8 * (g + 8) + t], a[8 * g + 4 + t],
                           a[8 * (g + 8) + 4 + t]);
  const uint2 bf = (uint2)(b[8 * g + t], b[8 * g + 4 + t]);
  float acc[4] = {c[8 * g + 2 * t], c[8 * g + 2 * t + 1], c[8 * (g + 8) + 2 * t],
                  c[8 * (g + 8) + 2 * t + 1]};
  MMA_SYNC(acc, af, bf);
  d[8 * g + 2 * t] = acc[0];
  d[8 * g + 2 * t + 1] = acc[1];
  d[8 * (g + 8) + 2 * t] = acc[2];
  d[8 * (g + 8) + 2 * t + 1] = acc[3];
}

__kernel void pack_check(__global const float* x, __global uint* y) {
  const int i = get_global_id(0);
  y[i] = mma_pack_h2(x[2 * i], x[2 * i + 1]);
}
"""


def _program(dev: attnreg.DeviceCaps, build: str, dtype: str) -> tuple[Any, Any, Any]:
    import pyopencl as cl

    ctx, _ = odevice.context(dev)
    hw = build == "hardware"
    opts = ["-cl-std=CL1.2", "-DWG=64", *(["-DIS_BF16=1"] if dtype == "bfloat16" else []),
            f"-DMMA={omma.MMA_IMPLS[build]}", f"-DCVT_PTX={int(hw)}"]
    prog = cl.Program(ctx, program.read_file("mma_sync.cl") + CHECK_SOURCE).build(options=opts)
    return cl, ctx, prog


def _product(dev: attnreg.DeviceCaps, build: str, a: np.ndarray, b: np.ndarray,
             c: np.ndarray) -> np.ndarray:
    """D = A B + C for two warps' problems (a [2,16,16], b [2,16,8] f16 or bf16, the
    program's element type that of a; c [2,16,8] f32)."""
    dtype = "bfloat16" if a.dtype == ELEMENT["bfloat16"] else "float16"
    cl, ctx, prog = _program(dev, build, dtype)
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


# (dtype, seed); per dtype the scales of A and B and the atol: bf16's magnitudes lie far beyond
# f16's range, so only a bf16 reading of the bits gets them right.
PRODUCTS = [("float16", s) for s in range(4)] + [("bfloat16", s) for s in range(3)]
SCALES = {"float16": (1.0, 1.0, 1e-4), "bfloat16": (1e6, 1e-3, 1e-3)}


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("dtype", "seed"), PRODUCTS, ids=[f"{TAGS[d]}-{s}" for d, s in PRODUCTS])
def test_primitive_is_the_matrix_product(dev, build, dtype, seed):
    rng = np.random.default_rng(seed)
    sa, sb, atol = SCALES[dtype]
    a = (rng.standard_normal((2, 16, 16)) * sa).astype(ELEMENT[dtype])
    b = (rng.standard_normal((2, 16, 8)) * sb).astype(ELEMENT[dtype])
    c = (rng.standard_normal((2, 16, 8)) * (seed % 2)).astype(np.float32)
    got = _product(dev, build, a, b, c)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("dtype", list(ELEMENT), ids=list(TAGS.values()))
def test_primitive_keeps_non_finite_values_in_their_row_and_column(dev, build, dtype):
    """The kernel relies on it: a NaN / inf in q (a row of A) or k (a column of B) reaches
    only that row or column of S."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(ELEMENT[dtype])
    b = rng.standard_normal((2, 16, 8)).astype(ELEMENT[dtype])
    a[0, 3, 5], a[1, 12, 0] = np.nan, np.inf
    b[0, 7, 6], b[1, 2, 1] = -np.inf, np.nan
    got = _product(dev, build, a, b, np.zeros((2, 16, 8), np.float32))
    bad = np.zeros((2, 16, 8), bool)
    bad[0, 3, :] = bad[0, :, 6] = bad[1, 12, :] = bad[1, :, 1] = True
    assert np.array_equal(~np.isfinite(got), bad)


# P's rounding per element type: (edge values, the decades of the random ones, a tail that
# makes the count even). bf16's edges: halfway cases, values beyond f16's range (HUGE), its
# largest finite values, subnormals.
PACK = {
    "float16": ([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, 6.1e-5,
                 6.0e-5, 3e-8, 2.98e-8, 1e-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2980.96],
                (-8, 5), [np.nan, 1.0]),
    "bfloat16": ([0.0, -0.0, 1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20,
                  65504.0, 65520.0, 1e9, -1e9, HUGE, 3.3895314e38, 3.3961776e38,
                  float(np.finfo(np.float32).max), np.inf, -np.inf, 1.2e-38, 1e-40, -3e-42,
                  1e-45, 2980.96, 0.5], (-40, 38), [np.nan, 1.0, -np.nan, 2.0]),
}


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("dtype", list(ELEMENT), ids=list(TAGS.values()))
def test_pack_rounds_to_nearest_even(dev, build, dtype):
    cl, ctx, prog = _program(dev, build, dtype)
    rng = np.random.default_rng(3)
    edges, (lo, hi), tail = PACK[dtype]
    x = np.concatenate([np.array(edges, np.float32),
                        (rng.standard_normal(2000) * 10.0 ** rng.integers(lo, hi, 2000))
                        .astype(np.float32), tail]).astype(np.float32)
    queue = cl.CommandQueue(ctx)
    mf = cl.mem_flags
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    y = np.zeros(x.size // 2, np.uint32)
    yb = cl.Buffer(ctx, mf.WRITE_ONLY, y.nbytes)
    prog.pack_check(queue, (y.size,), None, xb, yb)
    cl.enqueue_copy(queue, y, yb)
    queue.finish()
    got = y.view(np.uint16).view(ELEMENT[dtype])    # little-endian: lo, hi in order
    with np.errstate(over="ignore"):
        want = x.astype(ELEMENT[dtype])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


# -- the kernel --------------------------------------------------------------------------
LAZY = [("float16", "up"), ("float16", "down"), ("float16", "saw"), ("bfloat16", "up"),
        ("bfloat16", "saw")]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("dtype", "shape"), LAZY, ids=[f"{TAGS[d]}-{s}" for d, s in LAZY])
def test_lazy_max_rescales_when_the_logits_grow_past_tau(dev, build, dtype, shape):
    spec, t, logits = growing_logits(48, 208, dtype, shape)
    ref, moves = -np.inf, 0          # the last row's reference max, as the kernel keeps it
    for top in logits[-1, :256].reshape(-1, 32).max(axis=1):
        if top > ref + TAU:
            ref, moves = top, moves + 1
    assert moves == {"up": 8, "down": 1, "saw": 3}[shape]
    got, plan = run(dev, build, PREFILL[dtype], spec, t, kv_tile=32)
    check_close(spec, got, t, what=f"{plan.kernel} {shape}")


# (head size, dtype, the first row that sees the NaN / inf, their columns, params)
NON_FINITE_V = {
    "f16-prefetch0": (32, "float16", 10, (3, 17, 30), dict(kv_tile=16, prefetch=0)),
    "f16-prefetch2": (32, "float16", 10, (3, 17, 30), dict(kv_tile=16, prefetch=2)),
    "bf16": (64, "bfloat16", 2, (3, 40, 63), {}),
}


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("case", list(NON_FINITE_V))
def test_non_finite_v_poisons_only_the_columns_of_rows_that_see_it(dev, build, case):
    h, dtype, first_row, cols, params = NON_FINITE_V[case]
    spec = AttentionSpec(batch=2, seq_len=40, past_len=60, num_heads=4, kv_num_heads=2,
                         head_size=h, dtype=dtype, causal=True, return_lse=True,
                         q_layout="BSNH", kv_layout="BSNH")
    check_non_finite_v(dev, build, PREFILL[dtype], spec, first_row, cols, **params)


# Shapes the generated cells leave to this file: paged caches (page sizes 1, 5, 16, 32),
# every head size the kernel takes, GQA groups packing several heads into one work-group,
# each tile choice and both prefetch settings, with the features mixed in.
COVER = [
    (dict(head_size=128, num_heads=8, kv_num_heads=2, kv_layout="paged", page_size=16,
          seqlens_k=True, bias=True, return_lse=True), dict(q_tile=64, kv_tile=32)),
    (dict(head_size=96, num_heads=7, kv_num_heads=1, kv_layout="paged", page_size=5,
          seqlens_k=True, local_window=20, head_sink=True), dict(q_tile=32, kv_tile=64)),
    (dict(head_size=80, num_heads=4, kv_num_heads=4, kv_layout="paged", page_size=1,
          seqlens_k=True, alibi_max_bias=8.0, return_lse=True), dict(q_tile=128, kv_tile=16,
                                                                    prefetch=1)),
    (dict(head_size=256, num_heads=4, kv_num_heads=1, kv_layout="paged", page_size=32,
          seqlens_k=True, softcap=5.0, q_layout="BNSH"), dict(q_tile=32, kv_tile=16)),
    (dict(head_size=16, num_heads=8, kv_num_heads=1, kv_layout="BNSH", bias=True,
          head_sink=True, return_lse=True), dict(q_tile=16, kv_tile=64, prefetch=1)),
    (dict(head_size=48, num_heads=14, kv_num_heads=2, q_layout="BNSH", local_window=7,
          alibi_max_bias=4.0, softcap=5.0), dict(q_tile=128, kv_tile=32, prefetch=1)),
    # prefetch 2's asynchronous tiles: Q in registers (head size <= 128) or in local memory
    (dict(head_size=112, num_heads=6, kv_num_heads=2, kv_layout="paged", page_size=5,
          seqlens_k=True, bias=True, softcap=5.0), dict(q_tile=32, kv_tile=32, prefetch=2)),
    (dict(head_size=192, num_heads=4, kv_num_heads=2, kv_layout="BNSH", local_window=30,
          head_sink=True, return_lse=True), dict(q_tile=16, kv_tile=16, prefetch=2)),
    # the bfloat16 twin: a paged cache that fits 48 KiB emulated, and head size 256
    (dict(head_size=128, num_heads=8, kv_num_heads=2, kv_layout="paged", page_size=16,
          seqlens_k=True, bias=True, head_sink=True, return_lse=True, dtype="bfloat16"),
     dict(q_tile=64, kv_tile=32, prefetch=1)),
    (dict(head_size=256, num_heads=8, kv_num_heads=2, q_layout="BNSH", kv_layout="BNSH",
          local_window=20, alibi_max_bias=8.0, softcap=5.0, return_lse=True, dtype="bfloat16"),
     dict(q_tile=32, kv_tile=16)),
]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("fields", "params"), COVER,
                         ids=[f"{TAGS[f.get('dtype', 'float16')]}-h{f['head_size']}"
                              f"-{f.get('kv_layout', 'BSNH')}" for f, _ in COVER])
def test_contract_on_paged_caches_head_sizes_and_tiles(dev, build, fields, params):
    spec, t = cache_inputs(dict(batch=2, seq_len=37, past_len=90, dtype="float16", causal=True),
                           fields, 140, 61)
    got, plan = run(dev, build, PREFILL[spec.dtype], spec, t, **params)
    assert {k: plan.stages[0].params[k] for k in params} == params
    check_close(spec, got, t, what=f"{plan.kernel} {params}")


# (head size, v's, q_tile, kv_tile, prefetch) per dtype; prefetch 2: two buffers of K and
# row-major V, Q's words shared up to head size 128
LOCAL_MEMORY = {
    "float16": [(64, 64, 64, 32, None), (256, 256, 32, 16, None), (80, 80, 128, 64, None),
                (128, 128, 64, 32, 2), (64, 64, 128, 16, 2), (192, 96, 16, 16, 2)],
    "bfloat16": [(64, 64, 64, 32, None), (256, 256, 32, 16, None)],
}


@pytest.mark.parametrize("dtype", list(LOCAL_MEMORY), ids=list(TAGS.values()))
def test_declared_local_memory_is_what_the_build_uses(pocl, dtype):
    check_declared_local_memory(pocl, PREFILL[dtype], [
        (AttentionSpec(seq_len=33, past_len=70, num_heads=4, kv_num_heads=2, head_size=h,
                       **({} if p is None else {"v_head_size": hv}), dtype=dtype),
         {"q_tile": q, "kv_tile": kv, **({} if p is None else {"prefetch": p})})
        for h, hv, q, kv, p in LOCAL_MEMORY[dtype]])


# -- declaration and selection ----------------------------------------------------------
def test_declared_as_a_matrix_unit_kernel():
    k = attnreg.registry.get().kernel(KERNEL)
    assert k.dtypes == {"float16"} and k.family == "prefill"
    assert k.matrix == omma.PTX_MMA and k.matrix.text() == "ptx_mma f16 16x8x16->f32"
    assert mma_probe.FEATURE in k.features and k.emulation == {"mma": "emulate"}
    assert k.defaults["mma"] == "hardware"
    assert all(k.head_size_ok(h) for h in (16, 32, 80, 128, 256))
    assert all(k.head_size_ok(h) for h in (320, 512, 528, 576)) and \
        not any(k.head_size_ok(h) for h in (8, 24, 520, 592))
    # v's rows stop at 512 (q/k 576, v 512: MLA)
    assert k.v_head_size_ok(512) and not any(k.v_head_size_ok(h) for h in (8, 528, 576))
    others = [o for o in attnreg.kernels("opencl") if o.family == "prefill" and o.matrix is None]
    assert all(k.priority > o.priority for o in others)


def test_tiles_shrink_to_fit_local_memory(pocl):
    """NVIDIA's 48 KiB: head size 256 halves kv_tile, then q_tile; 128 keeps the defaults."""
    nv = pocl.model_copy(update={"limits": {**pocl.limits, "workgroup_storage": 48 * 1024}})
    got = {}
    for h in (128, 256):
        spec = AttentionSpec(seq_len=512, num_heads=32, kv_num_heads=8, head_size=h,
                             dtype="float16", causal=True)
        plan = attnreg.explain(spec, caps=nv, kernel=KERNEL, params={"mma": "emulate"})
        got[h] = (plan.stages[0].params["q_tile"], plan.stages[0].params["kv_tile"])
        assert attnreg.registry.get().kernel(KERNEL).storage_need(
            spec, plan.stages[0].params) <= 48 * 1024
    assert got == {128: (64, 32), 256: (32, 16)}


def test_async_tiles_where_they_fit_and_wide_rows_on_short_nvidia_grids(pocl):
    """prefetch 2 for float16 K/V at head sizes <= 128 unless the caller's tiles leave it no
    room in 48 KiB; on NVIDIA 128-row work-groups where 64-row ones give fewer than two per
    compute unit (S=512 on 132 units), 64 rows beyond."""
    nv = nvidia_like(pocl)
    got = {}
    for h, s, kvd, fixed in ((128, 512, None, {}), (128, 2048, None, {}), (64, 2048, None, {}),
                             (256, 2048, None, {}), (128, 2048, "int8", {}),
                             (96, 2048, None, {"q_tile": 32, "kv_tile": 64}),
                             (128, 512, None, {"prefetch": 1})):
        spec = AttentionSpec(seq_len=s, num_heads=32, kv_num_heads=8, head_size=h,
                             dtype="float16", kv_dtype=kvd, causal=True)
        plan = attnreg.explain(spec, caps=nv, kernel=KERNEL, params=fixed)
        p = plan.stages[0].params
        got[(h, s, kvd, tuple(fixed))] = (p["prefetch"], p["q_tile"], p["kv_tile"])
        assert attnreg.registry.get().kernel(KERNEL).storage_need(spec, p) <= 48 * 1024
    assert got == {(128, 512, None, ()): (2, 128, 32), (128, 2048, None, ()): (2, 64, 32),
                   (64, 2048, None, ()): (2, 64, 32), (256, 2048, None, ()): (0, 32, 16),
                   (128, 2048, "int8", ()): (0, 64, 32),
                   (96, 2048, None, ("q_tile", "kv_tile")): (0, 32, 64),
                   (128, 512, None, ("prefetch",)): (1, 64, 32)}
    with pytest.raises(attnreg.NoKernelError, match="prefetch=2 with kv_dtype 'int4'"):
        attnreg.explain(AttentionSpec(seq_len=64, num_heads=4, kv_num_heads=2, head_size=64,
                                      dtype="float16", kv_dtype="int4"),
                        caps=pocl, kernel=KERNEL, params={"mma": "emulate", "prefetch": 2})


def test_bad_tiles_are_reasons(pocl):
    spec = AttentionSpec(seq_len=64, num_heads=4, kv_num_heads=2, head_size=64, dtype="float16")
    with pytest.raises(attnreg.NoKernelError, match="q_tile=48"):
        attnreg.explain(spec, caps=pocl, kernel=KERNEL, params={"mma": "emulate", "q_tile": 48})


SPEC = AttentionSpec(seq_len=64, num_heads=8, kv_num_heads=2, head_size=64, dtype="float16",
                     causal=True)


def _plan(dev: attnreg.DeviceCaps, matrix_units: str, dtype: str = "float16") -> attnreg.Plan:
    # route=prefill: PoCL has no sub-groups, so its rules would start with split-KV
    flags = {"matrix_units": matrix_units, "route": "prefill"}
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        return s.plan(SPEC.replace(dtype=dtype))


@pytest.mark.parametrize("dtype", list(PREFILL), ids=list(TAGS.values()))
def test_matrix_units_emulate_picks_the_emulated_build(pocl, dtype):
    plan = _plan(pocl, "emulate", dtype)
    assert plan.kernel == PREFILL[dtype] and plan.stages[0].params["mma"] == "emulate"
    spec = SPEC.replace(dtype=dtype)
    t = make_tensors(spec, seed=2)
    with attnreg.Session(backend="opencl", device=pocl.id,
                         flags={"matrix_units": "emulate", "route": "prefill"}) as s:
        got, ran = s.run_with_plan(spec, t)
    assert ran.kernel == PREFILL[dtype] and ran.stages[0].params["mma"] == "emulate"
    check_close(spec, got, t, what=ran.kernel)


def test_matrix_units_off_rejects_it_naming_the_flag(pocl):
    plan = _plan(pocl, "off")
    assert plan.kernel != KERNEL
    assert any("matrix_units=off" in r for r in plan.rejected[KERNEL])


@pytest.mark.parametrize("dtype", list(PREFILL), ids=list(TAGS.values()))
def test_matrix_units_auto_does_not_choose_it_on_pocl(pocl, dtype):
    plan = _plan(pocl, "auto", dtype)
    assert plan.kernel != PREFILL[dtype] and plan.kernel.startswith("opencl.prefill.")
    assert any("matrix_units=auto" in r for r in plan.rejected[PREFILL[dtype]])
