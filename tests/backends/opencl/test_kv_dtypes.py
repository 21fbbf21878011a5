"""bfloat16 and quantized (int8 / int4) K/V in every OpenCL K/V reader, against the float64
reference: each kernel family (tiled and sub-group prefill and decode, block skipping, the
unfused pair, paged pools, head size 256 where V is read from global memory unstaged) x
{bf16, f16+int8, f16+int4, f32+int8, bf16+int4}, forced, on inputs whose keys past each
sequence's length are poison (NaN K/V, or NaN scales for quantized K/V). Plus the storage
conversions of kernels_cl/common.cl on their own: bfloat16 rounding of every special case
and the dequantizing loads against attnreg.dequantize_kv.

The sub-group kernels run with their shuffles emulated (sg_impl=emu) where the device has
none (PoCL); the device is tests.support.opencl_device() ($ATTNREG_OPENCL_DEVICE).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import attnreg
from attnreg.quant import dequantize_kv, quantize_kv
from attnreg.spec import AttentionSpec
from tests.support import check_close, make_tensors

TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
COMBOS = [("bfloat16", None), ("float16", "int8"), ("float16", "int4"), ("float32", "int8"),
          ("bfloat16", "int4")]
EMU = {"sg_impl": "emu"}
BASE: dict[str, Any] = dict(batch=2, num_heads=8, kv_num_heads=2, head_size=64, past_len=70,
                            seqlens_k=True, causal=True)
# name -> (kernel id with {t} for the dtype tag, spec fields, params). S > 1 rows in the
# decode families too (m_tile 4 over 3 rows: a partial row tile, causal edges per row).
# Every family of the brief runs all of COMBOS; the extras (other tilings of the same code)
# run the combos in EXTRA_COMBOS, which between them take every load path once (builds
# dominate the time on PoCL: a cold run of these cells compiles ~60 programs).
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "prefill.wgmem": ("prefill.{t}.wgmem", dict(seq_len=9, kv_layout="BNSH"), {}),
    "prefill.sg": ("prefill.{t}.sg", dict(seq_len=9, return_lse=True), EMU),
    "prefill.wgmem.bs": ("prefill.{t}.wgmem.bs", dict(seq_len=17, bias=True), {}),
    "decode_partial.m1": ("decode_partial.{t}.m1", dict(seq_len=1, head_sink=True),
                          {"split_size": 32}),
    "decode_partial.m4": ("decode_partial.{t}.m4", dict(seq_len=3, kv_layout="BNSH"),
                          {"split_size": 32}),
    "decode_partial.sg.m1": ("decode_partial.{t}.sg.m1", dict(seq_len=1), EMU),
    "decode_fused.m1": ("decode_fused.{t}.m1", dict(seq_len=1, return_lse=True),
                        {"split_size": 32}),
    "decode_qk.m1": ("decode_qk.{t}.m1", dict(seq_len=1, kv_layout="BNSH"), {"split_size": 32}),
    "paged.decode_fused.sg.m1": ("decode_fused.{t}.sg.m1", dict(
        seq_len=1, kv_layout="paged", page_size=16, num_pages=12), EMU),
}
EXTRAS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "decode_partial.m1.bs": ("decode_partial.{t}.m1.bs", dict(seq_len=1, bias=True),
                             {"split_size": 32}),
    "decode_fused.sg.m4": ("decode_fused.{t}.sg.m4", dict(seq_len=3, head_sink=True), EMU),
    "decode_qk.m4": ("decode_qk.{t}.m4", dict(seq_len=2), {"split_size": 32}),
    "paged.prefill.wgmem": ("prefill.{t}.wgmem", dict(
        seq_len=5, kv_layout="paged", page_size=16, num_pages=12), {}),
    # head size 256: the tiles leave no room to stage V (48 KiB), so P.V reads V straight
    # from global memory (KV_LD4 in the tiled kernels, KV_LD1 per value in the sg prefill)
    "h256.prefill.sg": ("prefill.{t}.sg", dict(seq_len=4, head_size=256), EMU),
    "h256.decode_partial.m1": ("decode_partial.{t}.m1", dict(seq_len=1, head_size=256),
                               {"split_size": 64, "kv_tile": 64}),
}
EXTRA_COMBOS = [("bfloat16", None), ("float16", "int8"), ("bfloat16", "int4")]
# The tensor-core decodes dequantize into their f16 fragments; their emulated build
# (mma=emulate) runs the same indexing on any device. (The tensor-core prefills and the bf16
# decodes: tests/backends/opencl/test_mma_quant.py.)
MMA = {"mma": "emulate", "split_size": 32}
MMA_FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "mma.decode_fused": ("decode_fused.{t}.mma", dict(seq_len=1, return_lse=True), MMA),
    "mma.paged.decode_partial": ("decode_partial.{t}.mma", dict(
        seq_len=3, kv_layout="paged", page_size=16, num_pages=12), MMA),
}
MMA_COMBOS = [("float16", "int8"), ("float16", "int4")]
# Every head size the tensor-core decode reads quantized K/V at (kernels_cl/mma_kvq.cl maps a
# lane's fragment slots to dims per head size), with softcap, ALiBi and a window so that edge
# chunks and the per-key scales meet the logit path; int4 has no head size 192 there.
MMA_HEADS = [(h, q) for h in (64, 128, 192, 256) for q in ("int8", "int4")
             if (h, q) != (192, "int4")]
CELLS = [(f, d, q) for f in FAMILIES for d, q in COMBOS] + \
    [(f, d, q) for f in EXTRAS for d, q in EXTRA_COMBOS] + \
    [(f, d, q) for f in MMA_FAMILIES for d, q in MMA_COMBOS]
ALL = {**FAMILIES, **EXTRAS, **MMA_FAMILIES}


def _spec(dtype: str, kv_dtype: str | None, fields: dict[str, Any]) -> AttentionSpec:
    return AttentionSpec(**{**BASE, **fields}, dtype=dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize("family,dtype,kv_dtype", CELLS,
                         ids=[f"{f}-{TAGS[d]}-{q or 'plain'}" for f, d, q in CELLS])
def test_family_matches_reference(session, family, dtype, kv_dtype):
    template, fields, params = ALL[family]
    kid = "opencl." + template.format(t=TAGS[dtype])
    spec = _spec(dtype, kv_dtype, fields)
    s = spec.seq_len
    # one full sequence, one shorter: its keys past the length are poison
    t = make_tensors(spec, seed=len(family), lengths=[spec.capacity, 33 + s],
                     mask_frac=0.2 if spec.bias else 0.0)
    if kv_dtype is not None:
        assert np.isnan(t["k_scale"]).any() and t["k"].dtype == spec.kv_code_dtype \
            and t["k"].shape == spec.kv_code_shape
    got = session.run(spec, t, kernel=kid, params=params)
    check_close(spec, got, t, what=f"{kid} {kv_dtype}")


@pytest.mark.parametrize("head_size,kv_dtype", MMA_HEADS,
                         ids=[f"h{h}-{q}" for h, q in MMA_HEADS])
def test_mma_decode_reads_quantized_kv_at_every_head_size(session, head_size, kv_dtype):
    spec = AttentionSpec(batch=2, seq_len=2, past_len=61, num_heads=8, kv_num_heads=2,
                         head_size=head_size, dtype="float16", kv_dtype=kv_dtype, causal=True,
                         seqlens_k=True, local_window=40, softcap=20.0, alibi_max_bias=8.0)
    t = make_tensors(spec, seed=head_size, lengths=[spec.capacity, 37])
    got = session.run(spec, t, kernel="opencl.decode_partial.f16.mma", params=MMA)
    check_close(spec, got, t, what=f"mma h{head_size} {kv_dtype}")


NAN_CELLS = [("decode_partial.m4", "int8"), ("decode_fused.sg.m4", "int4"),
             ("prefill.wgmem", "int4"), ("decode_qk.m4", "int8"),
             ("mma.paged.decode_partial", "int4"), ("mma.paged.decode_partial", "int8")]


@pytest.mark.parametrize("family,kv_dtype", NAN_CELLS, ids=[f"{f}-{q}" for f, q in NAN_CELLS])
def test_nan_scale_of_a_visible_key_reaches_the_rows_that_see_it(session, family, kv_dtype):
    """A NaN v scale on a key inside the causal diagonal: the rows that see that key are NaN,
    the earlier rows are not (the kernels select, never multiply, what a row cannot see)."""
    template, fields, params = ALL[family]
    dtype = "float16"
    spec = _spec(dtype, kv_dtype, fields)
    kid = "opencl." + template.format(t=TAGS[dtype])
    t = make_tensors(spec, seed=7, lengths=[spec.capacity, 33 + spec.seq_len])
    j = spec.capacity - 2                     # seen by the last two query rows only
    if spec.kv_layout == "paged":
        page, slot = t["block_table"][0, j // spec.page_size], j % spec.page_size
        t["v_scale"][page, slot, 1] = np.nan
    elif spec.kv_layout == "BNSH":
        t["v_scale"][0, 1, j] = np.nan
    else:
        t["v_scale"][0, j, 1] = np.nan
    got = session.run(spec, t, kernel=kid, params=params)
    check_close(spec, got, t, what=f"{kid} {kv_dtype}")
    out = got[0] if spec.return_lse else got
    assert np.isnan(out.astype(np.float32)).any()


def test_head_size_256_reads_v_unstaged(dev):
    """What the h256 cases are for: the device-dependent geometry leaves V unstaged there."""
    from attnreg.backends.opencl import tiles

    for name, variant in (("h256.prefill.sg", "sg"), ("h256.decode_partial.m1", "")):
        template, fields, params = EXTRAS[name]
        kernel = next(k for k in attnreg.kernels("opencl")
                      if k.id == "opencl." + template.format(t="bf16"))
        spec = _spec("bfloat16", "int4", fields)
        p = {**kernel.defaults, **params, **kernel.params}
        assert not tiles.geometry(kernel.family, variant, spec, p, dev).stage_v, name


def test_declarations():
    """Every K/V reader reads int8 and int4 in every dtype, the tensor-core kernels too; the
    tensor-core kernels compute in f16, or in bf16 (their bf16 twins)."""
    ks = attnreg.kernels("opencl")
    readers = [k for k in ks if k.family != "reduce"]
    assert readers and all(k.kv_dtypes == {"int8", "int4"} for k in readers)
    assert {k.id for k in ks if "bfloat16" in k.dtypes} >= {
        "opencl.prefill.bf16.sg", "opencl.decode_fused.bf16.m4", "opencl.reduce.bf16",
        "opencl.decode_pv.bf16", "opencl.decode_partial.bf16.m1.bs", "opencl.prefill.bf16.mma",
        "opencl.decode_partial.bf16.mma", "opencl.decode_fused.bf16.mma"}
    assert all(k.dtypes in ({"float16"}, {"bfloat16"}) for k in ks if k.matrix is not None)


# -- the conversions of common.cl on their own -----------------------------------------
_PROBE = """
#if IS_BF16
__kernel void bf16_store(const __global float* x, __global ushort* y) {
  const int i = get_global_id(0);
  ST1(x[i], y, i);
}
__kernel void bf16_load(const __global ushort* x, __global float* y) {
  const int i = get_global_id(0);
  vstore4(cvt4(LDRAW(x, 4 * i)), i, y);
}
#else
__kernel void kv_load(const __global kv_t* k, const __global scale_t* s, __global float* y) {
  const int i = get_global_id(0), r = i / HD4, g = i % HD4;
  const float4 a = KV_LD4(KV_AT(k, 0), SC_AT(s, 0), (size_t)r * HD, 4 * g);
  const float b = KV_LD1(k, s, (size_t)r * HD, 4 * g + 3);
  vstore4(a, i, y);
  y[get_global_size(0) * 4 + i] = b;
}
#endif
"""


def _program(dev: attnreg.DeviceCaps, **defines: int) -> Any:
    import pyopencl as cl

    from attnreg.backends.opencl import device, program

    ctx, d = device.context(dev)
    src = program.read_file("common.cl") + _PROBE
    opts = {"IS_F16": 0, "IS_BF16": 0, "BIAS_F16": 0, "FAST_EXP": 0, "KV_Q": 0, **defines}
    prog = cl.Program(ctx, src).build(options=[f"-D{k}={v}" for k, v in opts.items()],
                                      devices=[d])
    return ctx, cl.CommandQueue(ctx), prog


def _run(ctx: Any, queue: Any, kernel: Any, n: int, out: np.ndarray, *arrays: np.ndarray
         ) -> np.ndarray:
    import pyopencl as cl

    mf = cl.mem_flags
    bufs = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a.reshape(-1).view(np.uint8))
            for a in arrays]
    ob = cl.Buffer(ctx, mf.WRITE_ONLY, out.nbytes)
    kernel(queue, (n,), None, *bufs, ob)
    cl.enqueue_copy(queue, out.reshape(-1).view(np.uint8), ob)
    return out


def test_bf16_store_rounds_to_nearest_even(dev):
    """out's bfloat16 stores round like ml_dtypes (ties to even, overflow to inf, subnormals
    kept) and keep NaN a quiet NaN (0x7fc0: rounding a NaN's bits could make inf)."""
    rng = np.random.default_rng(0)
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    special = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 3.0e38, big,
                        np.float32(big) * np.float32(1.003), 1e-40, -1e-45, 1.00390625,
                        1.01171875, 1.0 + 2.0**-8 + 2.0**-20], np.float32)
    # every tie and near-tie: random floats with the low 16 bits 0x8000 and 0x7fff / 0x8001
    bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    ties = np.concatenate([(bits & 0xffff0000) | lo for lo in (0x8000, 0x7fff, 0x8001)])
    x = np.concatenate([special, ties.view(np.float32)])
    x = x[~np.isnan(x) | (np.arange(x.size) < special.size)]
    ctx, queue, prog = _program(dev, IS_BF16=1, HD=4)
    got = _run(ctx, queue, prog.bf16_store, x.size, np.empty(x.size, np.uint16), x)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert (got[nan] == 0x7fc0).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # and back: the widening is exact
    back = _run(ctx, queue, prog.bf16_load, got.size // 4, np.empty(got.size // 4 * 4,
                                                                     np.float32), got)
    np.testing.assert_array_equal(back.view(np.uint32), got[:back.size].astype(np.uint32) << 16)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_dequantizing_loads_match_the_reference(dev, kv_dtype):
    """KV_LD4 (raw codes and scale bits, then kv_cvt4) and KV_LD1 give exactly
    dequantize_kv's values for every code (all 16 nibbles in both halves of a byte)."""
    rng = np.random.default_rng(1)
    h, rows = 64, 40
    x = rng.standard_normal((rows, h)).astype(np.float32) * rng.uniform(0.01, 30, (rows, 1))
    x[0, :32] = np.arange(-8, 24) * 0.5                  # every int4 code in a block
    codes, scales = quantize_kv(x, kv_dtype)
    scales[3] = np.nan                                   # poison: NaN out, not a number
    want = dequantize_kv(codes, scales, kv_dtype)
    ctx, queue, prog = _program(dev, HD=h, KV_Q={"int8": 1, "int4": 2}[kv_dtype])
    n = rows * h // 4
    got = _run(ctx, queue, prog.kv_load, n, np.empty(n * 5, np.float32), codes, scales)
    np.testing.assert_array_equal(got[:n * 4].reshape(rows, h), want)
    np.testing.assert_array_equal(got[n * 4:].reshape(rows, h // 4), want[:, 3::4])
