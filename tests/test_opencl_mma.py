"""The OpenCL tensor-core prefill (opencl.prefill.f16.mma, kernels_cl/flash_prefill_mma.cl).

Its primitive (kernels_cl/mma_sync.cl) against numpy; the kernel's lazy max (logits that
grow by more than TAU across tiles) and non-finite v path, paged caches, head sizes and tile
choices (which the generated cells of test_opencl.py do not all reach) against the float64
reference; and how the flag matrix_units selects it. PoCL runs the emulated build; a device
where the probe found mma.sync (the H100) runs the hardware build too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import mma as omma
from attnreg.backends.opencl import mma_probe, program
from attnreg.backends.opencl import tiles as otiles
from attnreg.spec import AttentionSpec
from tests.support import check_close, make_tensors, missing, require_devices

KERNEL = "opencl.prefill.f16.mma"
TAU = 8.0                      # flash_prefill_mma.cl's lazy-max threshold


def _devices() -> list[attnreg.DeviceCaps]:
    try:
        return [d for d in attnreg.devices("opencl") if d.available]
    except Exception:
        return []


# (device, build): every device runs the emulation; the probed ones the hardware build too.
BUILDS = [(d, "emulate") for d in _devices()] + \
    [(d, "hardware") for d in _devices() if mma_probe.FEATURE in d.features]
IDS = [f"{d.slug}-{b}" for d, b in BUILDS]


def _nvidia_like(pocl: attnreg.DeviceCaps) -> attnreg.DeviceCaps:
    """PoCL's caps dressed as the H100's OpenCL: vendor, the probed mma.sync, 132 units."""
    return pocl.model_copy(update={
        "vendor": "nvidia", "device_type": "gpu", "compute_units": 132,
        "features": pocl.features | {mma_probe.FEATURE, otiles.NV_SHUFFLE},
        "limits": {**pocl.limits, "workgroup_storage": 48 * 1024}})


@pytest.fixture(scope="module")
def pocl() -> attnreg.DeviceCaps:
    for d in require_devices("opencl"):
        if d.vendor == "pocl":
            return d
    missing("no PoCL device")


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


def _program(dev: attnreg.DeviceCaps, build: str) -> tuple[Any, Any, Any]:
    import pyopencl as cl

    ctx, _ = odevice.context(dev)
    hw = build == "hardware"
    opts = ["-cl-std=CL1.2", "-DWG=64", f"-DMMA={omma.MMA_IMPLS[build]}",
            f"-DCVT_PTX={int(hw)}"]
    prog = cl.Program(ctx, program.read_file("mma_sync.cl") + CHECK_SOURCE).build(options=opts)
    return cl, ctx, prog


def _product(dev: attnreg.DeviceCaps, build: str, a: np.ndarray, b: np.ndarray,
             c: np.ndarray) -> np.ndarray:
    """D = A B + C for two warps' problems (a [2,16,16], b [2,16,8] f16; c [2,16,8] f32)."""
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
@pytest.mark.parametrize("seed", range(4))
def test_primitive_is_the_matrix_product(dev, build, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((2, 16, 16)).astype(np.float16)
    b = rng.standard_normal((2, 16, 8)).astype(np.float16)
    c = (rng.standard_normal((2, 16, 8)) * (seed % 2)).astype(np.float32)
    got = _product(dev, build, a, b, c)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
def test_primitive_keeps_non_finite_values_in_their_row_and_column(dev, build):
    """The kernel relies on it: a NaN / inf in q (a row of A) or k (a column of B) reaches
    only that row or column of S."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 16, 16)).astype(np.float16)
    b = rng.standard_normal((2, 16, 8)).astype(np.float16)
    a[0, 3, 5], a[1, 12, 0] = np.nan, np.inf
    b[0, 7, 6], b[1, 2, 1] = -np.inf, np.nan
    got = _product(dev, build, a, b, np.zeros((2, 16, 8), np.float32))
    bad = np.zeros((2, 16, 8), bool)
    bad[0, 3, :] = bad[0, :, 6] = bad[1, 12, :] = bad[1, :, 1] = True
    assert np.array_equal(~np.isfinite(got), bad)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
def test_pack_rounds_to_nearest_even_f16(dev, build):
    cl, ctx, prog = _program(dev, build)
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, 6.1e-5,
             6.0e-5, 3e-8, 2.98e-8, 1e-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2980.96]
    x = np.concatenate([np.array(edges, np.float32),
                        (rng.standard_normal(2000) * 10.0 ** rng.integers(-8, 5, 2000))
                        .astype(np.float32), [np.nan, 1.0]]).astype(np.float32)
    queue = cl.CommandQueue(ctx)
    mf = cl.mem_flags
    xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    y = np.zeros(x.size // 2, np.uint32)
    yb = cl.Buffer(ctx, mf.WRITE_ONLY, y.nbytes)
    prog.pack_check(queue, (y.size,), None, xb, yb)
    cl.enqueue_copy(queue, y, yb)
    queue.finish()
    got = y.view(np.uint16).view(np.float16)        # little-endian: lo, hi in order
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


# -- the kernel --------------------------------------------------------------------------
def _run(dev: attnreg.DeviceCaps, build: str, spec: AttentionSpec, t: dict[str, np.ndarray],
         **params: Any) -> tuple[Any, attnreg.Plan]:
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        return s.run_with_plan(spec, t, kernel=KERNEL, params={"mma": build, **params})


def _growing(spec: AttentionSpec, seed: int, shape: str) -> dict[str, np.ndarray]:
    """q and k along one direction, k scaled by a profile over the key position: logits of
    about 0.4 per key step, so a 32-key tile's max moves by ~13 > TAU ("up": every tile of a
    row rescales), or down from the start ("down": none after the first), or up in steps
    with dips between ("saw": some tiles rescale, others stay within TAU)."""
    t = make_tensors(spec, seed=seed)
    rng = np.random.default_rng(seed)
    h, c = spec.head_size, spec.capacity
    u = rng.choice([-1.0, 1.0], h)
    j = np.arange(c, dtype=np.float64)
    prof = {"up": j, "down": c - 1 - j, "saw": np.abs((j % 96) - 48.0) + j / 2}[shape]
    k = 0.05 * prof[:, None] * u + 0.05 * rng.standard_normal((c, h))
    q = u + 0.1 * rng.standard_normal((spec.seq_len, h))
    t["k"][:] = k[None, :, None, :].astype(np.float16)           # BSNH [B, C, Nkv, H]
    t["q"][:] = q[None, :, None, :].astype(np.float16)           # BSNH [B, S, N, H]
    return t


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("shape", ["up", "down", "saw"])
def test_lazy_max_rescales_when_the_logits_grow_past_tau(dev, build, shape):
    spec = AttentionSpec(batch=1, seq_len=48, past_len=208, num_heads=2, kv_num_heads=1,
                         head_size=64, dtype="float16", causal=True, return_lse=True,
                         q_layout="BSNH", kv_layout="BSNH")
    t = _growing(spec, 11, shape)
    logits = (t["q"][0, :, 0].astype(np.float64) @ t["k"][0, :, 0].astype(np.float64).T) \
        * spec.effective_scale
    ref, moves = -np.inf, 0          # the last row's reference max, as the kernel keeps it
    for top in logits[-1, :256].reshape(-1, 32).max(axis=1):
        if top > ref + TAU:
            ref, moves = top, moves + 1
    assert moves == {"up": 8, "down": 1, "saw": 3}[shape]
    got, plan = _run(dev, build, spec, t, kv_tile=32)
    check_close(spec, got, t, what=f"{plan.kernel} {shape}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_non_finite_v_poisons_only_the_columns_of_rows_that_see_it(dev, build, prefetch):
    spec = AttentionSpec(batch=2, seq_len=40, past_len=60, num_heads=4, kv_num_heads=2,
                         head_size=32, dtype="float16", causal=True, return_lse=True,
                         q_layout="BSNH", kv_layout="BSNH")
    t = make_tensors(spec, seed=4)
    t["v"][0, 70, 1, 3] = np.nan           # rows i >= 10 of kv head 1 see it
    t["v"][0, 70, 1, 17] = np.inf
    t["v"][1, 99, 0, 30] = -np.inf         # the last row only
    t["v"][1, 5, 0, 8] = np.nan            # every row
    got, plan = _run(dev, build, spec, t, kv_tile=16, prefetch=prefetch)
    out = got[0]
    assert np.isnan(out[0, 10:, 2:4, 3]).all() and not np.isnan(out[0, :10, 2:4, 3]).any()
    assert np.isnan(out[1, -1, 0:2, 30]).all() and not np.isnan(out[1, :-1, 0:2, 30]).any()
    check_close(spec, got, t, what=plan.kernel)


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
]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("fields", "params"), COVER,
                         ids=[f"h{f['head_size']}-{f.get('kv_layout', 'BSNH')}" for f, _ in COVER])
def test_contract_on_paged_caches_head_sizes_and_tiles(dev, build, fields, params):
    f: dict[str, Any] = dict(batch=2, seq_len=37, past_len=90, dtype="float16", causal=True,
                             **fields)
    if f.get("seqlens_k"):
        f["kv_capacity"] = 140
    if f.get("kv_layout") == "paged":
        f["num_pages"] = 2 * -(-140 // f["page_size"]) + 3
    spec = AttentionSpec(**f)
    t = make_tensors(spec, seed=len(fields), mask_frac=0.1 if spec.bias else 0.0,
                     lengths=(140, 61) if spec.seqlens_k else None)
    got, plan = _run(dev, build, spec, t, **params)
    assert {k: plan.stages[0].params[k] for k in params} == params
    check_close(spec, got, t, what=f"{plan.kernel} {params}")


def check_declared_local_memory(dev: attnreg.DeviceCaps, kernel_id: str,
                                cases: list[tuple[AttentionSpec, dict[str, Any]]]) -> None:
    """Build the emulated program of ``kernel_id`` for each (spec, params) on ``dev``: the
    local memory the build uses is what the kernel declares."""
    import pyopencl as cl

    k = attnreg.registry.get().kernel(kernel_id)
    ctx, cdev = odevice.context(dev)
    used, declared = [], []
    for spec, params in cases:
        params = {"mma": "emulate", **params}
        g = otiles.geometry(k.family, "mma", spec, params)
        opts = program.options(program.defines(spec, g, None, params))
        prog = cl.Program(ctx, program.source(k.family, "mma")).build(options=list(opts))
        used.append(cl.Kernel(prog, program.ENTRY[k.family]).get_work_group_info(
            cl.kernel_work_group_info.LOCAL_MEM_SIZE, cdev))
        declared.append(k.storage_need(spec, params))
    if not any(used):          # PoCL's "cpu" driver (the GPU machine's) reports 0
        missing(f"{dev.name} does not report the local memory a kernel uses")
    assert used == declared


def test_declared_local_memory_is_what_the_build_uses(pocl):
    check_declared_local_memory(pocl, KERNEL, [
        (AttentionSpec(seq_len=33, past_len=70, num_heads=4, kv_num_heads=2, head_size=h,
                       dtype="float16"), {"q_tile": q, "kv_tile": kv})
        for h, q, kv in ((64, 64, 32), (256, 32, 16), (80, 128, 64))] + [
        # prefetch 2: two buffers of K and row-major V; Q's words shared up to head size 128
        (AttentionSpec(seq_len=33, past_len=70, num_heads=4, kv_num_heads=2, head_size=h,
                       v_head_size=hv, dtype="float16"), {"q_tile": q, "kv_tile": kv,
                                                          "prefetch": 2})
        for h, hv, q, kv in ((128, 128, 64, 32), (64, 64, 128, 16), (192, 96, 16, 16))])


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
    nv = _nvidia_like(pocl)
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


def _plan(dev: attnreg.DeviceCaps, matrix_units: str) -> attnreg.Plan:
    # route=prefill: PoCL has no sub-groups, so its rules would start with split-KV
    flags = {"matrix_units": matrix_units, "route": "prefill"}
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        return s.plan(SPEC)


def test_matrix_units_emulate_picks_the_emulated_build(pocl):
    plan = _plan(pocl, "emulate")
    assert plan.kernel == KERNEL and plan.stages[0].params["mma"] == "emulate"
    t = make_tensors(SPEC, seed=2)
    with attnreg.Session(backend="opencl", device=pocl.id,
                         flags={"matrix_units": "emulate", "route": "prefill"}) as s:
        got, ran = s.run_with_plan(SPEC, t)
    assert ran.kernel == KERNEL
    check_close(SPEC, got, t, what=ran.kernel)


def test_matrix_units_off_rejects_it_naming_the_flag(pocl):
    plan = _plan(pocl, "off")
    assert plan.kernel != KERNEL
    assert any("matrix_units=off" in r for r in plan.rejected[KERNEL])


def test_matrix_units_auto_does_not_choose_it_on_pocl(pocl):
    plan = _plan(pocl, "auto")
    assert plan.kernel != KERNEL and plan.kernel.startswith("opencl.prefill.")
    assert any("matrix_units=auto" in r for r in plan.rejected[KERNEL])
