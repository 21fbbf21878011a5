"""Storage dtypes (docs/contract.md "Storage dtypes and quantized K/V"): attnreg.quantize_kv /
dequantize_kv, the reference quantizer of int8 and int4 K/V, checked element by element
against the contract's words (the int4 nibble layout is decoded here by a plain loop,
independently); spec.kv_dtype and dtype="bfloat16" through the tensor checks and the
reference, against attention computed by loops."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import testing


def test_int8_per_vector_scale_and_error_bound() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 64)).astype(np.float32) * 3
    x[1, 2, 0] = 0.0                                   # an all-zero vector: scale 0, codes 0
    codes, scale = attnreg.quantize_kv(x, "int8")
    assert codes.dtype == np.int8 and codes.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(scale, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    assert scale[1, 2, 0] == 0 and not codes[1, 2, 0].any()
    assert codes.min() >= -127 and codes.max() <= 127
    # the element of largest magnitude maps to +-127
    top = np.abs(x).argmax(axis=-1)[..., None]
    live = scale > 0
    assert (np.abs(np.take_along_axis(codes, top, -1)[..., 0])[live] == 127).all()
    back = attnreg.dequantize_kv(codes, scale, "int8")
    assert (np.abs(back - x) <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_int8_rounds_half_to_even() -> None:
    x = np.array([[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5]], np.float32)   # scale exactly 1
    codes, scale = attnreg.quantize_kv(x, "int8")
    assert scale[0] == 1.0
    assert codes[0].tolist() == [127, 2, 4, -2, 0, 0, 2]


def _int4_by_the_words(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantize one [H/2] row by a loop over the contract's byte/nibble description."""
    h = codes.shape[-1] * 2
    out = np.zeros(h, np.float64)
    for j in range(h // 32):
        for i in range(16):
            byte = int(codes[16 * j + i])
            out[32 * j + i] = ((byte & 0xF) - 8) * float(scales[j])
            out[32 * j + i + 16] = ((byte >> 4) - 8) * float(scales[j])
    return out


def test_int4_block_layout_and_signed_scale() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[0, 5] = -9.0                   # block 0's largest magnitude, negative: scale > 0
    x[1, 40] = 7.0                   # block 1's, positive: scale < 0
    x[2, 64:96] = 0.0                # an all-zero block: scale 0, every value 0
    codes, scales = attnreg.quantize_kv(x, "int4")
    assert codes.dtype == np.uint8 and codes.shape == (3, 48)
    assert scales.dtype == np.float16 and scales.shape == (3, 3)
    assert scales[0, 0] == np.float16(-9.0 / -8) and scales[1, 1] == np.float16(7.0 / -8)
    assert scales[2, 2] == 0
    back = attnreg.dequantize_kv(codes, scales, "int4")
    for r in range(3):
        np.testing.assert_array_equal(back[r], _int4_by_the_words(codes[r], scales[r]))
    # the extreme element is exact; the others are within one step (the clamp at 15 can
    # cost a whole step on the side opposite the extreme, as in q4_0)
    assert back[0, 5] == np.float32(np.float16(9 / 8)) * -8 and back[1, 40] == pytest.approx(7.0, abs=1e-2)
    step = np.abs(np.repeat(scales.astype(np.float32), 32, axis=-1))
    assert (np.abs(back - x) <= step * (1 + 1e-3)).all()
    assert not back[2, 64:].any()


def test_int4_rounds_half_to_even_and_clamps() -> None:
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = -8.0                   # scale = 1: codes are round(x) + 8
    x[0, 1:5] = [2.5, -2.5, 3.5, 8.0]
    codes, scales = attnreg.quantize_kv(x, "int4")
    assert scales[0, 0] == 1.0
    nib = [int(codes[0, i] & 0xF) for i in range(5)]
    assert nib == [0, 10, 6, 12, 15]          # 8 + 8 = 16 clamps to 15


@pytest.mark.parametrize("case,field", [
    ("nan", "x"), ("inf", "x"), ("int", "x"), ("list", "x"), ("h48", "x"), ("kind", "kv_dtype")])
def test_bad_inputs_name_the_field(case: str, field: str) -> None:
    x = np.ones((2, 64), np.float32)
    kv = "int4"
    if case == "nan":
        x[1, 3] = np.nan
    elif case == "inf":
        x[0, 0] = -np.inf
    elif case == "int":
        x = np.ones((2, 64), np.int32)  # type: ignore[assignment]
    elif case == "list":
        x = [[1.0] * 64]  # type: ignore[assignment]
    elif case == "h48":
        x = np.ones((2, 48), np.float32)
    else:
        kv = "int2"
    with pytest.raises(attnreg.SpecError) as err:
        attnreg.quantize_kv(x, kv)
    assert err.value.field == field
    if case == "nan":
        assert "x[1, 3]" in str(err.value)


def test_dequantize_checks_its_inputs() -> None:
    codes, scales = attnreg.quantize_kv(np.ones((4, 64), np.float32), "int4")
    with pytest.raises(attnreg.SpecError, match="scales"):
        attnreg.dequantize_kv(codes, scales.astype(np.float32), "int4")
    with pytest.raises(attnreg.SpecError, match="codes"):
        attnreg.dequantize_kv(codes.astype(np.int8), scales, "int4")
    with pytest.raises(attnreg.SpecError, match="scales"):
        attnreg.dequantize_kv(codes, scales[:, :1], "int4")


# -- quantized K/V in the spec, the tensor checks and the reference -------------------------
Q8 = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=40, num_heads=4, kv_num_heads=2,
                           head_size=64, dtype="float16", causal=True, return_lse=True,
                           kv_dtype="int8")


def _softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                       lengths: np.ndarray, past: int) -> np.ndarray:
    """Causal GQA attention by loops over (batch, head, row), q [B,S,Nq,H], k/v [B,C,Nkv,H]."""
    b_, s_, nq, _ = q.shape
    g = nq // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(b_):
        for h in range(nq):
            for i in range(s_):
                pos = int(lengths[b]) - s_ + i
                keys = np.arange(pos + 1)
                x = k[b, keys, h // g] @ q[b, i, h] * scale
                w = np.exp(x - x.max())
                out[b, i, h] = (w / w.sum()) @ v[b, keys, h // g]
    return out


def _keys_bsnh(spec: attnreg.AttentionSpec, t: dict[str, np.ndarray], name: str) -> np.ndarray:
    """k or v dequantized by the contract's formula and laid out [B, C, Nkv, H] by hand."""
    assert spec.kv_dtype is not None
    x = attnreg.dequantize_kv(t[name], t[f"{name}_scale"], spec.kv_dtype).astype(np.float64)
    if spec.kv_layout == "BNSH":
        return x.transpose(0, 2, 1, 3)
    if spec.kv_layout == "paged":
        assert spec.page_size is not None
        out = np.zeros((spec.batch, spec.capacity, spec.kv_num_heads, spec.head_size))
        for b in range(spec.batch):
            for j in range(spec.capacity):
                page = t["block_table"][b, j // spec.page_size]
                if page >= 0:
                    out[b, j] = x[page, j % spec.page_size]
        return out
    return x


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["BSNH", "BNSH", "paged"])
def test_reference_reads_the_stored_codes(kv_dtype: str, layout: str) -> None:
    """The reference on quantized K/V equals plain attention over the dequantized values
    (computed here by loops), and never reads what lies past a sequence's length (its
    scales are NaN there)."""
    paged = dict(kv_layout="paged", page_size=8, num_pages=16) if layout == "paged" else \
        dict(kv_layout=layout)
    spec = Q8.replace(kv_dtype=kv_dtype, seqlens_k=True, kv_capacity=56, **paged)
    t = testing.make_tensors(spec, 3, lengths=[43, 30])
    assert t["k"].dtype == (np.int8 if kv_dtype == "int8" else np.uint8)
    out, lse = attnreg.run(spec, t, backend="reference")
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    want = _softmax_attention(t["q"].astype(np.float64), _keys_bsnh(spec, t, "k"),
                              _keys_bsnh(spec, t, "v"), spec.effective_scale,
                              np.array([43, 30]), spec.past_len)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=2e-3, rtol=2e-3)


def test_tensor_checks_for_quantized_kv() -> None:
    t = testing.make_tensors(Q8, 0)
    attnreg.run(Q8, t, backend="reference")
    for name, bad, field in (
            ("k", t["k"].astype(np.float16), "tensors['k'].dtype"),
            ("k_scale", t["k_scale"].astype(np.float16), "tensors['k_scale'].dtype"),
            ("v_scale", t["v_scale"][..., :1], "tensors['v_scale'].shape")):
        with pytest.raises(attnreg.SpecError) as err:
            attnreg.run(Q8, {**t, name: bad}, backend="reference")
        assert err.value.field == field, (name, err.value)
    with pytest.raises(attnreg.SpecError, match=r"because spec\.kv_dtype is 'int8'"):
        attnreg.run(Q8, {n: a for n, a in t.items() if n != "k_scale"}, backend="reference")
    plain = Q8.replace(kv_dtype=None)
    with pytest.raises(attnreg.SpecError, match=r"kv_dtype is None"):
        attnreg.run(plain, {**testing.make_tensors(plain, 0), "k_scale": t["k_scale"]},
                    backend="reference")
    with pytest.raises(attnreg.SpecError) as err:
        attnreg.AttentionSpec(head_size=48, kv_dtype="int4")
    assert err.value.field == "kv_dtype"
    with pytest.raises(attnreg.SpecError) as err:
        attnreg.AttentionSpec(kv_dtype="fp8")
    assert err.value.field == "kv_dtype"


def test_kernels_without_quantized_reads_say_so() -> None:
    """The GPU backends plan quantized K/V with readers that declare it; every kernel that
    does not read it names kv_dtype in its rejection."""
    plan = attnreg.Session(backend="reference").plan(Q8)
    assert plan.kernels[0] == "reference.decode_partial"
    reg = attnreg.registry.get()
    for backend in ("webgpu", "opencl"):
        with attnreg.Session(backend=backend) as s:
            plan = s.plan(Q8)
            first = next(k for k in reg.kernels() if k.id == plan.kernels[0])
            assert "int8" in first.kv_dtypes, plan.kernels
            caps = plan.caps
        for k in reg.kernels():
            if k.backend == backend and k.family != "reduce" and "int8" not in k.kv_dtypes \
                    and Q8.dtype in k.dtypes:
                why = k.not_supported_reasons(Q8, caps)
                assert any("kv_dtype int8: reads" in w for w in why), (k.id, why)


# -- bfloat16 ---------------------------------------------------------------------------------
BF = Q8.replace(dtype="bfloat16", kv_dtype=None)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_bfloat16_on_the_reference(kv_dtype: str | None) -> None:
    import ml_dtypes

    spec = BF.replace(kv_dtype=kv_dtype)
    t = testing.make_tensors(spec, 4)
    assert t["q"].dtype == np.dtype(ml_dtypes.bfloat16)
    out, lse = attnreg.run(spec, t, backend="reference")
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and lse.dtype == np.float32
    k = _keys_bsnh(spec, t, "k") if kv_dtype else t["k"].astype(np.float64).transpose(0, 2, 1, 3)
    v = _keys_bsnh(spec, t, "v") if kv_dtype else t["v"].astype(np.float64).transpose(0, 2, 1, 3)
    want = _softmax_attention(t["q"].astype(np.float64), k, v, spec.effective_scale,
                              np.full(2, spec.total_len), spec.past_len)
    # the contract's bfloat16 tolerance (the output is rounded to bf16: 8 mantissa bits)
    np.testing.assert_allclose(out.astype(np.float64), want, atol=1.6e-2, rtol=1.6e-2)
    assert np.abs(out.astype(np.float64) - want).max() > 0      # really rounded to bf16


def test_bfloat16_tensor_checks_and_gpu_plans() -> None:
    t = testing.make_tensors(BF, 0)
    with pytest.raises(attnreg.SpecError) as err:
        attnreg.run(BF, {**t, "q": t["q"].astype(np.float16)}, backend="reference")
    assert err.value.field == "tensors['q'].dtype" and "bfloat16" in str(err.value)
    for backend in ("webgpu", "opencl"):
        plan = attnreg.Session(backend=backend).plan(BF)
        assert all(".bf16" in k for k in plan.kernels), plan.kernels


def test_explain_shows_kv_bytes_and_the_dequantization_path() -> None:
    h, nkv = 128, 8
    spec = attnreg.AttentionSpec(seq_len=1, past_len=2047, num_heads=32, kv_num_heads=nkv,
                                 head_size=h, dtype="float16")
    for kv_dtype, per_vector in ((None, 2 * h), ("int8", h + 4), ("int4", h // 2 + 2 * h // 32)):
        text = attnreg.Session(backend="reference").plan(spec.replace(kv_dtype=kv_dtype)).explain()
        line = next(ln for ln in text.splitlines() if ln.startswith("kv:"))
        assert f"{2 * nkv * per_vector} B per token" in line, line
        assert ("dequantized on the host" in line) == (kv_dtype is not None), line
