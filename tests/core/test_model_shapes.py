"""The shapes real models need (docs/contract.md "Shapes real models need"), on the host side: the
spec fields v_head_size, kv_start and seqlens_q, their tensors' checks, and the float64 reference
against the naive loop transcription (tests/naive.py) with each of them, alone and together,
through attention, partial states and the reduce."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.errors import SpecError
from attnreg.tensors import check_tensors
from attnreg.testing import plant_nonfinite
from tests.naive import naive_attention
from tests.support import make_tensors

BASE = dict(batch=3, seq_len=5, past_len=11, num_heads=4, kv_num_heads=2, head_size=16)

CASES = {
    "v-head-smaller": {"v_head_size": 8},
    "v-head-larger": {"v_head_size": 40, "q_layout": "BNSH", "kv_layout": "BSNH"},
    "kv-start": {"kv_start": True},
    "kv-start-seqlens": {"kv_start": True, "seqlens_k": True, "kv_capacity": 20},
    "seqlens-q": {"seqlens_q": True},
    "seqlens-q-sink-lse": {"seqlens_q": True, "head_sink": True, "return_lse": True},
    # ONNX's right-padded prompt batch: no past, row i at position i
    "right-padded-prompt": {"seqlens_q": True, "seqlens_k": True, "past_len": 0},
    "everything": {"kv_start": True, "seqlens_q": True, "seqlens_k": True, "kv_capacity": 21,
                   "v_head_size": 24, "bias": True, "local_window": 6, "softcap": 3.0,
                   "alibi_max_bias": 4.0, "head_sink": True, "return_lse": True,
                   "q_layout": "BNSH", "kv_layout": "BSNH"},
    "paged": {"kv_start": True, "seqlens_q": True, "seqlens_k": True, "kv_capacity": 20,
              "v_head_size": 8, "kv_layout": "paged", "page_size": 4, "num_pages": 18},
    "int4": {"kv_start": True, "seqlens_q": True, "head_size": 32, "v_head_size": 64,
             "kv_dtype": "int4"},
    # MLA's decode shape: q/k 576, v 512, one KV head for the group
    "mla": {"head_size": 576, "v_head_size": 512, "kv_num_heads": 1, "seq_len": 2,
            "seqlens_k": True, "kv_capacity": 16, "head_sink": True, "return_lse": True},
}


def _lengths(spec: attnreg.AttentionSpec) -> list[int] | None:
    if not spec.seqlens_k:
        return None
    if spec.past_len == 0:           # right-padded prompts: L_b = S_b
        return [spec.seq_len, 2, 1][: spec.batch]
    return [spec.capacity, 9, 13][: spec.batch]


def _q_lens(spec: attnreg.AttentionSpec) -> list[int] | None:
    if spec.seqlens_q and spec.past_len == 0:
        return [spec.seq_len, 2, 1][: spec.batch]
    return None


def _spec_tensors(name: str, seed: int = 0) -> tuple[attnreg.AttentionSpec, dict]:
    spec = attnreg.AttentionSpec(**{**BASE, **CASES[name]})
    t = make_tensors(spec, seed=seed, lengths=_lengths(spec), q_lens=_q_lens(spec))
    return spec, check_tensors(spec, t)


def _dequantized(spec: attnreg.AttentionSpec, t: dict) -> tuple[attnreg.AttentionSpec, dict]:
    if spec.kv_dtype is None:
        return spec, t
    t = dict(t)
    for n in ("k", "v"):
        t[n] = attnreg.dequantize_kv(t.pop(n), t.pop(f"{n}_scale"), spec.kv_dtype)
    return spec.replace(kv_dtype=None, dtype="float32"), t


def _naive(spec: attnreg.AttentionSpec, t: dict) -> tuple[np.ndarray, np.ndarray]:
    spec, t = _dequantized(spec, t)
    if spec.kv_layout == "paged":          # gather the pages (the naive loop reads BSNH)
        flat = spec.replace(kv_layout="BSNH", page_size=None, num_pages=None)
        t = dict(t)
        for n in ("k", "v"):
            t[n] = np.moveaxis(ref.kv_canonical(spec, t[n], t["block_table"]), 1, 2)
        t.pop("block_table")
        spec = flat
    return naive_attention(spec, t)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_naive_loop(name: str) -> None:
    spec, t = _spec_tensors(name, seed=len(name))
    out, lse = ref.attention(spec, t)
    n_out, n_lse = _naive(spec, t)
    assert out.shape == (spec.batch, spec.num_heads, spec.seq_len, spec.head_size_v)
    np.testing.assert_allclose(out, n_out, atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(lse, n_lse, atol=1e-12, rtol=1e-10)
    assert not np.isnan(out).any()
    if spec.seqlens_q:
        pad = np.arange(spec.seq_len)[None, :] >= t["seqlens_q"][:, None]     # [B, S]
        assert pad.any(), "the recipe must leave padding rows"
        assert (out.transpose(0, 2, 1, 3)[pad] == 0).all()
        assert np.isneginf(lse.transpose(0, 2, 1)[pad]).all()


@pytest.mark.parametrize("name", ["kv-start-seqlens", "seqlens-q-sink-lse", "everything"])
def test_partial_states_reduce_to_attention(name: str) -> None:
    spec, t = _spec_tensors(name, seed=3)
    o_p, l_p = ref.partial_states(spec, t, split_size=4)
    assert o_p.shape[-1] == spec.head_size_v
    out, lse = ref.reduce(spec, o_p, l_p, t.get("head_sink"), t.get("seqlens_q"))
    want, want_lse = ref.attention(spec, t)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("name", ["seqlens-q-sink-lse", "everything"])
def test_reduce_on_the_reference_backend_takes_seqlens_q(name: str) -> None:
    spec, t = _spec_tensors(name, seed=4)
    o_p, l_p = ref.partial_states(spec, t, split_size=4)
    got = attnreg.reduce_states(spec, o_p.astype(np.float32), l_p.astype(np.float32),
                                t.get("head_sink"), seqlens_q=t["seqlens_q"],
                                backend="reference")
    want = ref.out_layout(spec, ref.attention(spec, t)[0])
    out = got[0] if spec.return_lse else got
    np.testing.assert_allclose(out.astype(np.float64), want, atol=2e-5)
    with pytest.raises(SpecError, match="seqlens_q"):
        attnreg.reduce_states(spec, o_p.astype(np.float32), l_p.astype(np.float32),
                              t.get("head_sink"), backend="reference")


def test_nonfinite_values_before_kv_start_and_in_padding_rows_never_reach_the_output() -> None:
    spec, t = _spec_tensors("everything", seed=7)
    raw = make_tensors(spec, seed=7, lengths=_lengths(spec))
    first = raw["kv_start"]
    assert first.max() > 0
    # make_tensors poisons keys before kv_start and q rows past seqlens_q with NaN
    k = raw["k"]                                     # BSNH
    assert np.isnan(k[0, : first[0]]).all()
    plant_nonfinite(spec, raw)
    t = check_tensors(spec, raw)
    out, lse = ref.attention(spec, t)
    n_out, n_lse = _naive(spec, t)
    np.testing.assert_allclose(out, n_out, atol=1e-12, rtol=1e-10)
    np.testing.assert_allclose(lse, n_lse, atol=1e-12, rtol=1e-10)


def test_run_returns_out_with_v_head_size_in_either_layout() -> None:
    for layout in ("BSNH", "BNSH"):
        spec = attnreg.AttentionSpec(**{**BASE, "v_head_size": 24, "q_layout": layout})
        t = make_tensors(spec, seed=1)
        out = attnreg.run(spec, t, backend="reference")
        assert out.shape == spec.out_shape
        assert spec.out_shape[-1] == 24 and spec.q_shape[-1] == 16


# -- checks ----------------------------------------------------------------------------
def _bad(spec: attnreg.AttentionSpec, **changes) -> dict:
    t = make_tensors(spec, seed=0, lengths=_lengths(spec))
    t.update(changes)
    return t


@pytest.mark.parametrize(("fields", "tensor", "value", "match"), [
    ({"kv_start": True}, "kv_start", np.array([0, 16, 0], np.int32), r"kv_start'\]\[1\]"),
    ({"kv_start": True}, "kv_start", np.array([0, -1, 0], np.int32), r"kv_start'\]\[1\]"),
    ({"kv_start": True}, "kv_start", np.array([0, 1], np.int32), r"kv_start'\]\.shape"),
    ({"kv_start": True}, "kv_start", np.array([0, 1, 2], np.float32), r"kv_start'\]\.dtype"),
    ({"seqlens_q": True}, "seqlens_q", np.array([5, 0, 1], np.int32), r"seqlens_q'\]\[1\]"),
    ({"seqlens_q": True}, "seqlens_q", np.array([5, 6, 1], np.int64), r"seqlens_q'\]\[1\]"),
    # S_b may not exceed L_b
    ({"seqlens_q": True, "seqlens_k": True, "kv_capacity": 16}, "seqlens_q",
     np.array([5, 5, 3], np.int32), r"seqlens_q'\]\[1\]"),
])
def test_bad_index_tensors_are_spec_errors(fields, tensor, value, match) -> None:
    spec = attnreg.AttentionSpec(**{**BASE, **fields})
    t = _bad(spec, **{tensor: value})
    if spec.seqlens_k:
        t["seqlens_k"] = np.array([16, 4, 16], np.int32)
    with pytest.raises(SpecError, match=match):
        check_tensors(spec, t)


def test_seqlens_k_below_seq_len_only_with_seqlens_q() -> None:
    fields = {**BASE, "seqlens_k": True, "kv_capacity": 16}
    t = make_tensors(attnreg.AttentionSpec(**fields), seed=0, lengths=[16, 16, 16])
    t["seqlens_k"] = np.array([16, 2, 16], np.int32)
    with pytest.raises(SpecError, match=r"seqlens_k'\]\[1\]"):
        check_tensors(attnreg.AttentionSpec(**fields), t)
    spec = attnreg.AttentionSpec(**fields, seqlens_q=True)
    t["seqlens_q"] = np.array([5, 2, 1], np.int64)        # int64 is narrowed, values checked
    got = check_tensors(spec, t)
    assert got["seqlens_q"].dtype == np.int32


def test_missing_and_unexpected_tensors_name_the_field() -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "kv_start": True})
    t = make_tensors(spec, seed=0)
    del t["kv_start"]
    with pytest.raises(SpecError, match=r"spec\.kv_start is True"):
        check_tensors(spec, t)
    plain = attnreg.AttentionSpec(**BASE)
    t = make_tensors(plain, seed=0)
    t["seqlens_q"] = np.array([1, 1, 1], np.int32)
    with pytest.raises(SpecError, match=r"spec\.seqlens_q is False"):
        check_tensors(plain, t)


def test_v_shape_follows_v_head_size() -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "v_head_size": 24})
    t = make_tensors(spec, seed=0)
    t["v"] = t["k"].copy()                        # H = 16 instead of Hv = 24
    with pytest.raises(SpecError, match="v_head_size=24"):
        check_tensors(spec, t)
    with pytest.raises(SpecError, match="v_head_size"):
        attnreg.AttentionSpec(**{**BASE, "head_size": 32, "v_head_size": 48, "kv_dtype": "int4"})
    with pytest.raises(SpecError, match="v_head_size"):
        attnreg.AttentionSpec(**{**BASE, "v_head_size": 0})


def test_features_and_short_name() -> None:
    spec = attnreg.AttentionSpec(**{**BASE, "v_head_size": 8, "kv_start": True,
                                    "seqlens_q": True})
    assert {"v_head_size", "kv_start", "seqlens_q"} <= spec.features
    assert "d16v8" in spec.short() and "kv_start" in spec.short()
    assert "v_head_size" not in attnreg.AttentionSpec(**{**BASE, "v_head_size": 16}).features


def test_a_kernel_that_does_not_implement_them_says_so() -> None:
    k = attnreg.KernelInfo(id="toy.prefill", backend="reference", family="prefill",
                           dtypes=frozenset({"float32"}))
    spec = attnreg.AttentionSpec(**{**BASE, "kv_start": True, "v_head_size": 8})
    caps = attnreg.devices("reference")[0]
    why = " ".join(k.not_supported_reasons(spec, caps))
    assert "kv_start" in why and "v_head_size" in why


def test_head_size_ranges_are_declared_apart_and_reasons_name_which() -> None:
    """KernelInfo.head_sizes bounds q and k, v_head_sizes v (None: the same range); a
    refusal says which one is out of range."""
    caps = attnreg.devices("reference")[0]
    both = attnreg.KernelInfo(id="toy.both", backend="reference", family="prefill",
                              dtypes=frozenset({"float32"}), head_sizes=(8, 64, 8),
                              supports=attnreg.kernel.ALL_FEATURES)
    apart = dataclasses.replace(both, head_sizes=(8, 576, 8), v_head_sizes=(8, 512, 8))
    mla = attnreg.AttentionSpec(**{**BASE, "head_size": 576, "v_head_size": 512})
    assert both.not_supported_reasons(mla, caps) == [
        "head_size 576 outside 8..64 step 8 (q and k's head size)",
        "v_head_size 512 outside 8..64 step 8 (v's and out's head size)"]
    assert not apart.not_supported_reasons(mla, caps)
    assert apart.not_supported_reasons(mla.replace(v_head_size=576), caps) == [
        "v_head_size 576 outside 8..512 step 8 (v's and out's head size)"]
    assert apart.not_supported_reasons(mla.replace(head_size=580), caps) == [
        "head_size 580 outside 8..576 step 8 (q and k's head size)"]
