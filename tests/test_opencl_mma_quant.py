"""Quantized K/V (int8, int4) in the OpenCL tensor-core prefills (opencl.prefill.f16.mma,
opencl.prefill.bf16.mma: kernels_cl/flash_prefill_mma.cl with mma_tile.cl's kvq_h8), which
dequantize each granule of 8 values as they stage the K and V tiles in local memory.

The staging conversion on its own, bit for bit against the reference quantizer's values
rounded to f16 / bf16 (every code, both nibbles, subnormal, huge and non-finite scales);
then the kernels against the float64 reference on the same codes and scales: layouts
(BSNH, BNSH, paged), v_head_size != head_size, seqlens_k with NaN-scaled vectors past the
lengths, kv_start, seqlens_q, the tile choices and prefetch, and NaN scales on keys that
only some rows see. PoCL runs the emulated build; a device where the probe found mma.sync
(the H100) runs the hardware build too. (The quick conformance matrix runs emulated kernels'
covering cells only, so the quantized cells of the full matrix are these here in CI.)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import program
from attnreg.quant import dequantize_kv, quantize_kv
from attnreg.spec import AttentionSpec
from tests.support import check_close, make_tensors
from tests.test_opencl_mma import BUILDS, IDS, pocl  # noqa: F401  (the fixture)

PREFILL = {"float16": "opencl.prefill.f16.mma", "bfloat16": "opencl.prefill.bf16.mma"}
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


def _stage(dev: attnreg.DeviceCaps, dtype: str, kv_dtype: str, codes: np.ndarray,
           scales: np.ndarray, hd: int) -> tuple[np.ndarray, np.ndarray]:
    import pyopencl as cl

    ctx, d = odevice.context(dev)
    src = "".join(program.read_file(f) for f in ("common.cl", "mma_sync.cl", "mma_tile.cl"))
    opts = {"IS_F16": int(dtype == "float16"), "IS_BF16": int(dtype == "bfloat16"), "HD": hd,
            "BIAS_F16": 0, "FAST_EXP": 0, "KV_Q": {"int8": 1, "int4": 2}[kv_dtype], "MMA": 2,
            "WG": 32}
    prog = cl.Program(ctx, src + _PROBE).build(options=[f"-D{k}={v}" for k, v in opts.items()],
                                               devices=[d])
    queue, mf = cl.CommandQueue(ctx), cl.mem_flags
    bufs = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a.reshape(-1).view(np.uint8))
            for a in (codes, scales)]
    n = codes.shape[0] * hd // 8
    y, bad = np.empty(n * 8, np.uint16), np.empty(n * 8, np.int32)
    yb, bb = cl.Buffer(ctx, mf.WRITE_ONLY, y.nbytes), cl.Buffer(ctx, mf.WRITE_ONLY, bad.nbytes)
    prog.stage(queue, (n,), None, *bufs, yb, bb)
    cl.enqueue_copy(queue, y, yb)
    cl.enqueue_copy(queue, bad, bb)
    return y.reshape(-1, hd), bad.reshape(-1, hd)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"], ids=["f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_staging_rounds_the_dequantized_values(pocl, dtype, kv_dtype):  # noqa: F811
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
@pytest.mark.parametrize(("dtype", "kv_dtype"), [("float16", "int4"), ("bfloat16", "int8")],
                         ids=["f16-int4", "bf16-int8"])
def test_nan_scales_reach_only_the_rows_that_see_them(dev, build, dtype, kv_dtype):
    """A NaN v scale makes the columns it scales NaN in the rows that see its key (all of a
    vector's for int8, its 32-block's for int4), a NaN k scale those rows; earlier rows (the
    causal diagonal: same tile, same work-group) stay finite."""
    spec = AttentionSpec(batch=2, seq_len=12, past_len=20, num_heads=4, kv_num_heads=2,
                         head_size=64, dtype=dtype, kv_dtype=kv_dtype, causal=True,
                         return_lse=True, kv_layout="BNSH")
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


def test_declared_for_both_prefills(pocl):  # noqa: F811
    """Both prefills take int8 and int4 at any head size the storage allows (int4: whole
    32-blocks; the decodes' narrower int4 head sizes are theirs alone)."""
    reg = attnreg.registry.get()
    for dtype, kid in PREFILL.items():
        k = reg.kernel(kid)
        assert k.kv_dtypes == {"int8", "int4"} and "int8 / int4 K/V dequantized" in k.doc
        for kv_dtype, h, hv in (("int4", 96, 32), ("int4", 320, 64), ("int8", 48, 16)):
            spec = AttentionSpec(seq_len=64, num_heads=8, kv_num_heads=2, head_size=h,
                                 v_head_size=hv, dtype=dtype, kv_dtype=kv_dtype)
            assert not k.not_supported_reasons(spec, pocl, {"mma": "emulate"}), (kid, spec)
