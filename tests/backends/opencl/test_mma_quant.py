"""Quantized K/V (int8, int4) in the OpenCL tensor-core kernels beyond the f16 decodes
(those: tests/backends/opencl/test_kv_dtypes.py): the prefills (opencl.prefill.f16.mma,
opencl.prefill.bf16.mma: kernels_cl/flash_prefill_mma.cl with mma_tile.cl's kvq_h8), which
dequantize each granule of 8 values as they stage the K and V tiles in local memory, and the
bf16 decodes (opencl.decode_partial.bf16.mma, opencl.decode_fused.bf16.mma: mma_kvq.cl's
fragments made bf16).

The conversions on their own, bit for bit: the prefill's staging against the reference
quantizer's values rounded to f16 / bf16 (every code, both nibbles, subnormal, huge and
non-finite scales), the decodes' fragment pairs (f16 and bf16) likewise. Then the kernels
against the float64 reference on the same codes and scales: layouts (BSNH, BNSH, paged),
v_head_size != head_size, seqlens_k with NaN-scaled vectors past the lengths, kv_start,
seqlens_q, the tile choices and prefetch, and NaN scales on keys that only some rows see.
PoCL runs the emulated build; a device where the probe found mma.sync (the H100) runs the
hardware build too. (The quick conformance matrix runs emulated kernels' covering cells
only, so on PoCL the quantized cells of the full matrix are these here.)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import program
from attnreg.backends.opencl import tiles as otiles
from attnreg.quant import dequantize_kv, quantize_kv
from attnreg.spec import AttentionSpec
from tests.backends.opencl.mma_support import BUILDS, IDS
from tests.support import check_close, make_tensors

PREFILL = {"float16": "opencl.prefill.f16.mma", "bfloat16": "opencl.prefill.bf16.mma"}
PARTIAL, FUSED = "opencl.decode_partial.bf16.mma", "opencl.decode_fused.bf16.mma"
ROUTE = {PARTIAL: "split_kv", FUSED: "split_kv_fused"}
TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# -- the staging conversion on its own --------------------------------------------------
_PROBE = """
// Granule g of row r (8 values from dim 8 (g % (HD / 8))) through KVQ_CODES / KVQ_SCALE and
// kvq_h8, as the prefill stages it; and V_BAD of each value.
__kernel void stage(const __global kv_t* k, const __global scale_t* s, __global uint* y,
                    __global int* bad) {
  const int i = get_global_id(0), r = i / (HD / 8), d = 8 * (i % (HD / 8));
  const uint4 x = kvq_h8(KVQ_CODES(k, r * HD, d), KVQ_SCALE(s, r * HD, d, HD), d);
  vstore4(x, i, y);
  for (int e = 0; e < 8; ++e) bad[8 * i + e] = V_BAD(k, s, r * HD, d + e);
}
"""


def _build(dev: attnreg.DeviceCaps, dtype: str, kv_dtype: str, hd: int, files: tuple[str, ...],
           probe: str) -> tuple[Any, Any, Any]:
    """The emulated build's helpers (files after common.cl) with a probe kernel."""
    import pyopencl as cl

    ctx, d = odevice.context(dev)
    src = "".join(program.read_file(f) for f in ("common.cl", *files))
    opts = {"IS_F16": int(dtype == "float16"), "IS_BF16": int(dtype == "bfloat16"), "HD": hd,
            "BIAS_F16": 0, "FAST_EXP": 0, "KV_Q": {"int8": 1, "int4": 2}[kv_dtype], "MMA": 2,
            "WG": 32}
    prog = cl.Program(ctx, src + probe).build(options=[f"-D{k}={v}" for k, v in opts.items()],
                                              devices=[d])
    return cl, ctx, prog


def _call(cl: Any, ctx: Any, kernel: Any, n: int, inputs: tuple[np.ndarray, ...],
          outputs: tuple[np.ndarray, ...]) -> None:
    queue, mf = cl.CommandQueue(ctx), cl.mem_flags
    bufs = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a.reshape(-1).view(np.uint8))
            for a in inputs]
    obufs = [cl.Buffer(ctx, mf.WRITE_ONLY, o.nbytes) for o in outputs]
    kernel(queue, (n,), None, *bufs, *obufs)
    for o, b in zip(outputs, obufs):
        cl.enqueue_copy(queue, o, b)


def _stage(dev: attnreg.DeviceCaps, dtype: str, kv_dtype: str, codes: np.ndarray,
           scales: np.ndarray, hd: int) -> tuple[np.ndarray, np.ndarray]:
    cl, ctx, prog = _build(dev, dtype, kv_dtype, hd, ("mma_sync.cl", "mma_tile.cl"), _PROBE)
    n = codes.shape[0] * hd // 8
    y, bad = np.empty(n * 8, np.uint16), np.empty(n * 8, np.int32)
    _call(cl, ctx, prog.stage, n, (codes, scales), (y, bad))
    return y.reshape(-1, hd), bad.reshape(-1, hd)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"], ids=["f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_staging_rounds_the_dequantized_values(pocl, dtype, kv_dtype):
    """kvq_h8 gives exactly dequantize_kv's value rounded to the fragments' type (to nearest
    even; beyond f16's range inf, NaN scales NaN), for every code, and V_BAD says which of
    them the mma would see as non-finite."""
    rng = np.random.default_rng(3)
    hd, rows = 64, 24
    x = rng.standard_normal((rows, hd)).astype(np.float32) * rng.uniform(1e-3, 30, (rows, 1))
    x[0, :32] = np.arange(-8, 24) * 0.37                  # every int4 code in both nibbles
    x[1] = np.linspace(-1.0, 1.0, hd) * 127 * 0.01        # every int8 code (about)
    codes, scales = quantize_kv(x, kv_dtype)
    if kv_dtype == "int8":
        codes[2, :] = np.arange(-128, 128, 4)[:hd].astype(np.int8)
        scales[2] = 1000.0                                # |code * scale| past f16's max
        scales[3] = 1e-7                                  # f16 subnormal results
        scales[4], scales[5] = np.nan, np.inf
    else:
        scales[2, 0] = 65504.0                            # past f16's max
        scales[3, 1] = np.float16(2.0**-20)               # a subnormal scale
        scales[4, 0], scales[5, 1] = np.nan, np.inf
    got, bad = _stage(pocl, dtype, kv_dtype, codes, scales, hd)
    with np.errstate(over="ignore", invalid="ignore"):
        want = dequantize_kv(codes, scales, kv_dtype).astype(np.float32).astype(TYPES[dtype])
    gv = got.view(TYPES[dtype]).astype(np.float32)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(gv), nan)
    np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])
    np.testing.assert_array_equal(bad.astype(bool), ~np.isfinite(want.astype(np.float32)))
    if dtype == "float16":
        assert (bad[2] if kv_dtype == "int8" else bad[2, :32]).any()


_PAIRS = """
// The decodes' fragment pairs (mma_kvq.cl): Q8_PAIR of word x[i] (int8: bytes 0 and 2), or
// Q4_PAIR of x[i] >> 4 (i odd) or x[i] with the scales of s[2 i], s[2 i + 1] (int4).
__kernel void pairs(const __global uint* x, const __global ushort* s, __global uint* y) {
  const int i = get_global_id(0);
#if KV_Q == 1
  y[i] = Q8_PAIR(x[i]);
#else
  y[i] = Q4_PAIR(x[i], 4 * (i & 1), SC2(s[2 * i], s[2 * i + 1]));
#endif
}
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"], ids=["f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_decode_fragment_pairs_are_the_rounded_values(pocl, dtype, kv_dtype):
    """The decodes' B fragment pairs from raw codes: int8 codes exactly (their scales go to
    the scores and P), int4 code * scale rounded to the fragments' type (to nearest even),
    over every byte / nibble and scales from subnormal to non-finite."""
    rng = np.random.default_rng(5)
    n = 1024
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x[:256] = np.arange(256, dtype=np.uint32) * 0x00010001 ^ 0x5a005a00   # every byte, twice
    s = rng.standard_normal(2 * n).astype(np.float16) * np.float16(0.1)
    s[:6] = [2.0**-24, -(2.0**-20), 65504.0, np.nan, np.inf, -np.inf]
    import pyopencl as cl

    # the emulated decode's whole program (mma_kvq.cl needs flash_core.cl's rows), and the probe
    spec = AttentionSpec(seq_len=1, past_len=63, num_heads=8, kv_num_heads=2, head_size=64,
                         dtype=dtype, kv_dtype=kv_dtype)
    g = otiles.mma_decode_geometry(spec, {"mma": "emulate"})
    ctx, d = odevice.context(pocl)
    prog = cl.Program(ctx, program.source("decode_partial", "mma") + _PAIRS).build(
        options=list(program.options(program.defines(spec, g, None, {}))), devices=[d])
    got = np.empty(n, np.uint32)
    _call(cl, ctx, prog.pairs, n, (x, s), (got,))
    if kv_dtype == "int8":
        want = np.stack([(x & 0xff), (x >> 16) & 0xff], -1).astype(np.uint8).view(np.int8)
        want = want.astype(np.float32)
    else:
        sh = np.where(np.arange(n) & 1, 4, 0).astype(np.uint32)
        nib = np.stack([(x >> sh) & 0xf, (x >> (sh + 16)) & 0xf], -1).astype(np.float32) - 8
        with np.errstate(invalid="ignore"):
            want = nib * s.astype(np.float32).reshape(n, 2)
    with np.errstate(over="ignore"):
        w16 = want.astype(TYPES[dtype]).view(np.uint16)
    g16 = got.view(np.uint16).reshape(n, 2)
    nan = np.isnan(want)
    assert (np.isnan(g16.view(TYPES[dtype]).astype(np.float32)) == nan).all()
    np.testing.assert_array_equal(g16[~nan], w16[~nan])


# -- the kernels against the reference --------------------------------------------------
def _run(dev: attnreg.DeviceCaps, build: str, spec: AttentionSpec, t: dict[str, np.ndarray],
         **params: Any) -> Any:
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        got, plan = s.run_with_plan(spec, t, kernel=PREFILL[spec.dtype],
                                    params={"mma": build, **params})
    assert plan.stages[0].params["mma"] == build
    assert {k: plan.stages[0].params[k] for k in params} == params
    return got


# (spec fields, make_tensors keywords, params): between them both dtypes x both storages,
# each layout, v_head_size above and below head_size, the model shapes, the tile choices.
CASES = [
    ("f16-int8-bnsh-hv128", dict(
        dtype="float16", kv_dtype="int8", head_size=64, v_head_size=128, seq_len=37,
        past_len=40, num_heads=8, kv_num_heads=2, q_layout="BNSH", kv_layout="BNSH",
        seqlens_k=True, causal=True, return_lse=True), dict(lengths=(77, 50)),
     dict(q_tile=32, kv_tile=16)),
    ("f16-int4-paged-hv64-model", dict(
        dtype="float16", kv_dtype="int4", head_size=128, v_head_size=64, seq_len=20,
        past_len=45, num_heads=4, kv_num_heads=2, kv_layout="paged", page_size=16,
        num_pages=15, seqlens_k=True, kv_start=True, seqlens_q=True, causal=True,
        head_sink=True, softcap=20.0, return_lse=True),
     dict(lengths=(65, 41), starts=(3, 0), q_lens=(20, 9)), dict(prefetch=1)),
    ("bf16-int8-paged5-bias", dict(
        dtype="bfloat16", kv_dtype="int8", head_size=96, v_head_size=32, seq_len=24,
        past_len=50, num_heads=6, kv_num_heads=3, kv_layout="paged", page_size=5,
        num_pages=33, seqlens_k=True, bias=True, alibi_max_bias=8.0, causal=True,
        local_window=30), dict(lengths=(74, 31), mask_frac=0.1), dict(kv_tile=64)),
    ("bf16-int4-bsnh-model", dict(
        dtype="bfloat16", kv_dtype="int4", head_size=64, v_head_size=96, seq_len=40,
        past_len=30, num_heads=8, kv_num_heads=1, seqlens_k=True, kv_start=True,
        seqlens_q=True, causal=True, return_lse=True),
     dict(lengths=(70, 52), starts=(0, 11), q_lens=(33, 40)), dict(q_tile=128, prefetch=1)),
]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("name", "fields", "inputs", "params"), CASES,
                         ids=[c[0] for c in CASES])
def test_prefill_reads_quantized_kv(dev, build, name, fields, inputs, params):
    spec = AttentionSpec(batch=2, **fields)
    t = make_tensors(spec, seed=len(name), **inputs)
    assert np.isnan(t["k_scale"]).any() and np.isnan(t["v_scale"]).any()   # poison past L
    got = _run(dev, build, spec, t, **params)
    check_close(spec, got, t, what=f"{PREFILL[spec.dtype]} {build} {name}")


def _vec(spec: AttentionSpec, b: int, j: int, kvh: int) -> tuple[int, ...]:
    """The index of key j's vector of kv head kvh in batch b (a scale's leading axes)."""
    return (b, kvh, j) if spec.kv_layout == "BNSH" else (b, j, kvh)


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("float16", "int4")], ids=["f16-int4"])
def test_nan_scales_reach_only_the_rows_that_see_them(dev, build, dtype, kv_dtype):
    """A NaN v scale makes the columns it scales NaN in the rows that see its key (all of a
    vector's for int8, its 32-block's for int4), a NaN k scale those rows; earlier rows (the
    causal diagonal: same tile, same work-group) stay finite."""
    spec = AttentionSpec(batch=2, seq_len=12, past_len=20, num_heads=4, kv_num_heads=2,
                         head_size=64, dtype=dtype, kv_dtype=kv_dtype, causal=True,
                         return_lse=True, q_layout="BSNH", kv_layout="BNSH")
    t = make_tensors(spec, seed=9)
    jv, jk = 26, 29                      # seen by rows i >= 6 and i >= 9
    t["v_scale"][_vec(spec, 0, jv, 1) + ((1,) if kv_dtype == "int4" else ())] = np.nan
    t["k_scale"][_vec(spec, 1, jk, 0) + ((0,) if kv_dtype == "int4" else ())] = np.nan
    got = _run(dev, build, spec, t, q_tile=16, kv_tile=16)
    check_close(spec, got, t, what=f"{PREFILL[dtype]} {build}")
    out = got[0].astype(np.float32)                          # [B, Nq, S, Hv] (q BSNH: B S N H)
    cols = slice(32, 64) if kv_dtype == "int4" else slice(0, 64)
    assert np.isnan(out[0, 6:, 2:4, cols]).all() and not np.isnan(out[0, :6, 2:4]).any()
    if kv_dtype == "int4":
        assert not np.isnan(out[0, :, 2:4, :32]).any()
    assert np.isnan(out[1, 9:, 0:2]).all() and not np.isnan(out[1, :9, 0:2]).any()
    assert not np.isnan(out[0, :, 0:2]).any() and not np.isnan(out[1, :, 2:4]).any()


# The bf16 decodes: (kernel, spec fields, make_tensors keywords, params) over several splits.
DECODES = [
    ("partial-int8-paged-hv128", PARTIAL, dict(
        kv_dtype="int8", head_size=64, v_head_size=128, seq_len=1, past_len=150,
        num_heads=8, kv_num_heads=2, kv_layout="paged", page_size=16, num_pages=24,
        seqlens_k=True, head_sink=True, return_lse=True), dict(lengths=(151, 77)),
     dict(kv_tile=32)),
    ("fused-int4-bnsh-model", FUSED, dict(
        kv_dtype="int4", head_size=128, v_head_size=64, seq_len=3, past_len=120,
        num_heads=8, kv_num_heads=2, kv_layout="BNSH", q_layout="BNSH", seqlens_k=True,
        kv_start=True, seqlens_q=True, local_window=60, softcap=20.0, return_lse=True),
     dict(lengths=(123, 70), starts=(5, 0), q_lens=(3, 2)), dict(m_tile=4, prefetch=1)),
    ("fused-int8-bsnh-alibi", FUSED, dict(
        kv_dtype="int8", head_size=128, seq_len=1, past_len=200, num_heads=32,
        kv_num_heads=1, alibi_max_bias=8.0, bias=True, seqlens_k=True),
     dict(lengths=(201, 90), mask_frac=0.1), dict(wg=64)),
    ("partial-int4-paged5-hv256", PARTIAL, dict(
        kv_dtype="int4", head_size=64, v_head_size=256, seq_len=2, past_len=90,
        num_heads=4, kv_num_heads=4, kv_layout="paged", page_size=5, num_pages=40,
        seqlens_k=True), dict(lengths=(92, 41)), dict(m_tile=2)),
]


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize(("name", "kernel", "fields", "inputs", "params"), DECODES,
                         ids=[c[0] for c in DECODES])
def test_bf16_decode_reads_quantized_kv(dev, build, name, kernel, fields, inputs, params):
    spec = AttentionSpec(batch=2, dtype="bfloat16", causal=True, **fields)
    t = make_tensors(spec, seed=len(name), **inputs)
    assert np.isnan(t["k_scale"]).any() and np.isnan(t["v_scale"]).any()
    flags = {"route": ROUTE[kernel], "split_size": 32}
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        got, plan = s.run_with_plan(spec, t, kernel=kernel, params={"mma": build, **params})
    st = plan.stages[0]
    assert st.kernel == kernel and st.params["n_splits"] > 2
    assert {k: st.params[k] for k in params} == params
    check_close(spec, got, t, what=f"{kernel} {build} {name}")


@pytest.mark.parametrize(("dev", "build"), BUILDS, ids=IDS)
@pytest.mark.parametrize("kv_dtype", ["int4"])
def test_bf16_decode_nan_scales_on_the_causal_edge(dev, build, kv_dtype):
    """NaN scales of keys on the causal edge of a multi-row tile reach only the rows (and,
    for v, the columns) that see them (int4: the bf16 build's own V_BAD; int8's path is the
    f16 decode's, tests/backends/opencl/test_kv_dtypes.py)."""
    spec = AttentionSpec(batch=2, seq_len=4, past_len=96, num_heads=4, kv_num_heads=2,
                         head_size=64, dtype="bfloat16", kv_dtype=kv_dtype, causal=True,
                         return_lse=True, q_layout="BSNH", kv_layout="BSNH")
    t = make_tensors(spec, seed=4)
    blk = (1,) if kv_dtype == "int4" else ()
    t["v_scale"][(0, 98, 1) + blk] = np.nan            # rows i >= 2 of kv head 1 see it
    t["k_scale"][(1, 99, 0) + blk] = np.nan            # the last row of kv head 0
    flags = {"route": "split_kv_fused", "split_size": 32}
    with attnreg.Session(backend="opencl", device=dev.id, flags=flags) as s:
        got = s.run(spec, t, kernel=FUSED, params={"mma": build, "m_tile": 4})
    check_close(spec, got, t, what=f"{FUSED} {build} {kv_dtype}")
    out = got[0].astype(np.float32)                          # [B, S, Nq, Hv]
    cols = slice(32, 64) if kv_dtype == "int4" else slice(0, 64)
    assert np.isnan(out[0, 2:, 2:4, cols]).all() and not np.isnan(out[0, :2]).any()
    assert not np.isnan(out[0, :, 2:4, :cols.start]).any()
    assert np.isnan(out[1, 3, 0:2]).all() and not np.isnan(out[1, :3]).any()


def test_declarations(pocl):
    """Both prefills and the bf16 decodes read int8 and int4; the prefills at any head size
    the storage allows (int4: whole 32-blocks; the decodes' narrower int4 head sizes are
    theirs alone)."""
    reg = attnreg.registry.get()
    for kid in (PARTIAL, FUSED):
        assert reg.kernel(kid).kv_dtypes == {"int8", "int4"}
    for dtype, kid in PREFILL.items():
        k = reg.kernel(kid)
        assert k.kv_dtypes == {"int8", "int4"} and "int8 / int4 K/V dequantized" in k.doc
        for kv_dtype, h, hv in (("int4", 96, 32), ("int4", 320, 64), ("int8", 48, 16)):
            spec = AttentionSpec(seq_len=64, num_heads=8, kv_num_heads=2, head_size=h,
                                 v_head_size=hv, dtype=dtype, kv_dtype=kv_dtype)
            assert not k.not_supported_reasons(spec, pocl, {"mma": "emulate"}), (kid, spec)
