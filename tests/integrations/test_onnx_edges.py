"""attnreg.integrations.onnx's edges against onnxruntime's CPU EP or the contract: windows,
padded rows, left padding as kv_start, cross-attention causality, position ids, short masks,
and the refusals (a SpecError naming the field, the value and what was expected)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import attnreg  # noqa: E402
from attnreg.integrations.onnx import run_node, spec_from_node  # noqa: E402
from tests.onnx_attention_cases import attention_case, mha_case  # noqa: E402
from tests.onnx_cases import (  # noqa: E402
    ELEM,
    N_MODEL_CASES,
    assert_close,
    gqa_padded_case,
    rnd,
    run_both,
)


def test_model_cases_cover_the_new_mappings() -> None:
    """The random cases (tests/onnx_cases.py) exercise what they claim (counted on the specs,
    no ORT)."""
    def spec_of(op: str, feeds: list[tuple[str, Any]], attrs: dict[str, Any]) -> Any:
        node = helper.make_node(op, [n if v is not None else "" for n, v in feeds], ["o"],
                                domain="" if op == "Attention" else "com.microsoft", **attrs)
        return spec_from_node(node, {n: v for n, v in feeds if v is not None})

    count: dict[str, int] = {}

    def add(key: str, yes: bool) -> None:
        count[key] = count.get(key, 0) + bool(yes)

    for seed in range(N_MODEL_CASES):
        feeds, attrs, _, _, _ = gqa_padded_case(seed)
        spec, how = spec_of("GroupQueryAttention", feeds, attrs)
        chunk = dict(feeds)["query_seqlens"] is not None
        add("gqa seqlens_q, first prompt", spec.seqlens_q and not chunk)
        add("gqa seqlens_q, query_seqlens", spec.seqlens_q and chunk)
        add("gqa idle entry", bool(how.idle))
        add("gqa position_ids", dict(feeds)["position_ids"] is not None)
        feeds, attrs, *_ = attention_case(seed, model=True)
        spec, how = spec_of("Attention", feeds, attrs)
        add("attention v_head_size", spec.v_head_size is not None)
        add("attention kv_start", spec.kv_start)
        add("attention mask kept as a bias",
            not spec.kv_start and spec.bias and dict(feeds)["attn_mask"] is not None)
        feeds, _, attrs, *_ = mha_case(seed, model=True)
        spec, how = spec_of("MultiHeadAttention", feeds, attrs)
        add("mha v_head_size", spec.v_head_size is not None)
        add("mha kv_start", spec.kv_start)
    low = {k: n for k, n in count.items() if n < 2}
    assert not low, count


# -- documented semantics and differences ----------------------------------------------------
def test_gqa_local_window_keeps_w_keys() -> None:
    """ORT 1.32's local_window_size=W is attnreg's local_window=W (W keys ending at p)."""
    rng = np.random.default_rng(7)
    b, s, nq, nkv, h, past, w = 1, 6, 2, 1, 32, 9, 4
    feeds = [("query", rnd(rng, "float32", b, s, nq * h)), ("key", rnd(rng, "float32", b, s, nkv * h)),
             ("value", rnd(rng, "float32", b, s, nkv * h)),
             ("past_key", rnd(rng, "float32", b, nkv, past, h)),
             ("past_value", rnd(rng, "float32", b, nkv, past, h)),
             ("seqlens_k", np.array([past + s - 1], np.int32)),
             ("total_sequence_length", np.array(past + s, np.int32))]
    attrs = {"num_heads": nq, "kv_num_heads": nkv, "local_window_size": w}
    got, want, node = run_both("GroupQueryAttention", feeds, attrs, 3)
    spec, _ = spec_from_node(node, dict(feeds))
    assert spec.local_window == w and spec.causal
    assert_close(got[0], want[0], "float32", "window")
    wider = attnreg.run(spec.replace(local_window=w + 1), spec_from_node(node, dict(feeds))[1].tensors,
                        backend="reference")
    assert np.abs(wider.reshape(want[0].shape) - want[0]).max() > 1e-3   # W+1 keys would differ


def test_mha_fully_padded_row_is_zero_not_ort_value() -> None:
    """ORT's MHA adds mask_filter_value (-10000) for padding, so a row whose keys are all
    padding gets the softmax over them; attnreg masks with -inf and returns 0 there."""
    rng = np.random.default_rng(8)
    b, s, n, h = 2, 3, 2, 32
    q, k, v = (rnd(rng, "float32", b, s, n * h) for _ in range(3))
    kpm = np.ones((b, s), np.int32)
    kpm[1] = 0
    feeds = [("query", q), ("key", k), ("value", v), ("bias", None), ("key_padding_mask", kpm)]
    got, want, _ = run_both("MultiHeadAttention", feeds, {"num_heads": n}, 1)
    assert_close(got[0][0], want[0][0], "float32", "unpadded batch entry")
    assert np.all(got[0][1] == 0)
    # ORT: the softmax over the padded keys, as if unmasked (scores - 10000, rounded in f32)
    qh, kh, vh = (x[1].reshape(s, n, h).transpose(1, 0, 2).astype(np.float64) for x in (q, k, v))
    p = np.exp(qh @ kh.transpose(0, 2, 1) / np.sqrt(h))
    unmasked = ((p / p.sum(-1, keepdims=True)) @ vh).transpose(1, 0, 2).reshape(s, n * h)
    np.testing.assert_allclose(want[0][1], unmasked, atol=5e-3)
    assert np.abs(want[0][1]).max() > 0.05
    # ... and an all -inf attention_bias row: ORT gives NaN, attnreg 0.
    ab = np.zeros((1, 1, s, s), np.float32)
    ab[..., 1, :] = -np.inf
    feeds = [("query", q), ("key", k), ("value", v), ("bias", None), ("key_padding_mask", None),
             ("attention_bias", ab)]
    got, want, _ = run_both("MultiHeadAttention", feeds, {"num_heads": n}, 1)
    assert np.isnan(want[0][:, 1]).all() and np.all(got[0][:, 1] == 0)
    assert_close(got[0][:, [0, 2]], want[0][:, [0, 2]], "float32", "other rows")


@pytest.mark.parametrize("attrs", [{}, {"local_window_size": 3}, {"causal": 0, "softcap": 5.0}])
def test_gqa_right_padded_prompt_rows(attrs: dict[str, Any]) -> None:
    """A right-padded first prompt (seqlens_k + 1 < S = total_sequence_length) maps to
    seqlens_q = seqlens_k = seqlens_k + 1; attnreg's padding rows (i >= S_b) and present rows
    are 0. ORT's CPU EP computes a padding row as an ordinary row at position i over the L_b
    valid keys (its causal frontier and window included), checked here against attnreg's
    float64 reference of exactly that (a -inf bias on keys j >= L_b), and its present holds
    the padding rows' K/V."""
    rng = np.random.default_rng(11)
    b, s, nq, nkv, h = 3, 8, 4, 2, 32
    lengths = np.array([8, 3, 1])
    q, k, v = rnd(rng, "float32", b, s, nq * h), rnd(rng, "float32", b, s, nkv * h), \
        rnd(rng, "float32", b, s, nkv * h)
    feeds = [("query", q), ("key", k), ("value", v), ("past_key", None), ("past_value", None),
             ("seqlens_k", (lengths - 1).astype(np.int32)),
             ("total_sequence_length", np.array(s, np.int32))]
    attrs = {"num_heads": nq, "kv_num_heads": nkv, **attrs}
    got, want, node = run_both("GroupQueryAttention", feeds, attrs, 3)
    spec, how = spec_from_node(node, {n: x for n, x in feeds if x is not None})
    assert spec.seqlens_q and spec.seqlens_k and not spec.bias
    assert how.tensors["seqlens_q"].tolist() == how.tensors["seqlens_k"].tolist() == [8, 3, 1]
    assert spec.causal == bool(attrs.get("causal", 1))
    for bi, n in enumerate(lengths):
        assert_close(got[0][bi, :n], want[0][bi, :n], "float32", f"valid rows b{bi}")
        assert not got[0][bi, n:].any() and not got[1][bi, :, n:].any()
        np.testing.assert_array_equal(want[1][bi, :, n:],
                                      k[bi, n:].reshape(s - n, nkv, h).transpose(1, 0, 2))
    ort_rows = attnreg.AttentionSpec(
        batch=b, seq_len=s, num_heads=nq, kv_num_heads=nkv, head_size=h, q_layout="BSNH",
        kv_layout="BSNH", causal=spec.causal, local_window=spec.local_window,
        softcap=spec.softcap, bias=True)
    bias = np.where(np.arange(s) < lengths[:, None], 0, -np.inf).astype(np.float32)
    ref = attnreg.run(ort_rows, {"q": q.reshape(b, s, nq, h), "k": k.reshape(b, s, nkv, h),
                                 "v": v.reshape(b, s, nkv, h), "bias": bias.reshape(b, 1, 1, s)},
                      backend="reference")
    assert_close(ref.reshape(want[0].shape), want[0], "float32", "ORT's padding rows")
    assert np.abs(want[0][1, 3:]).max() > 0.1                # ... which are not 0


def test_gqa_query_seqlens_idle_entry() -> None:
    """query_seqlens 0 marks an idle entry: ORT keeps its cache and its output rows are
    unspecified; attnreg keeps the cache too and gives 0."""
    rng = np.random.default_rng(12)
    b, s, nq, nkv, h, pbuf = 2, 3, 2, 1, 32, 9
    qs, lengths = np.array([0, 2]), np.array([5, 9])
    feeds = [("query", rnd(rng, "float32", b, s, nq * h)), ("key", rnd(rng, "float32", b, s, nkv * h)),
             ("value", rnd(rng, "float32", b, s, nkv * h)),
             ("past_key", rnd(rng, "float32", b, nkv, pbuf, h)),
             ("past_value", rnd(rng, "float32", b, nkv, pbuf, h)),
             ("seqlens_k", (lengths - 1).astype(np.int32)),
             ("total_sequence_length", np.array(12, np.int32))] + [(f"x{i}", None) for i in range(9)] \
        + [("query_seqlens", qs.astype(np.int32))]
    got, want, node = run_both("GroupQueryAttention", feeds, {"num_heads": nq, "kv_num_heads": nkv}, 3)
    spec, how = spec_from_node(node, {n: x for n, x in feeds if x is not None})
    assert spec.seqlens_q and how.idle == (0,) and spec.kv_capacity == 12
    assert not got[0][0].any()
    assert_close(got[0][1, :2], want[0][1, :2], "float32", "valid rows")
    assert not got[0][1, 2:].any()
    for i in (1, 2):                        # rows beyond T_b are unspecified in ORT
        np.testing.assert_array_equal(got[i][0, :, :5], feeds[2 + i][1][0, :, :5])
        np.testing.assert_array_equal(got[i][0, :, :5], want[i][0, :, :5])
        np.testing.assert_array_equal(got[i][1, :, :9], want[i][1, :, :9])


@pytest.mark.parametrize("op", ["Attention", "MultiHeadAttention"])
@pytest.mark.parametrize("flip", [None, (1, 2, 1), (0, 0, 4)])
def test_left_padding_mask_is_kv_start_only_when_exact(op: str, flip: Any) -> None:
    """A mask hiding keys j < start[b] from every row is kv_start without a bias; the same
    mask with one element flipped (a key hidden from one row; one row seeing a pad key)
    stays a -inf bias. Both match ORT."""
    rng = np.random.default_rng(13)
    b, s, n, h, t = 2, 4, 2, 32, 7
    start = np.array([3, 0])
    keep = np.broadcast_to(np.arange(t) >= start[:, None, None], (b, s, t)).copy()
    if flip is not None:
        keep[flip] = not keep[flip]
    q, k, v = rnd(rng, "float32", b, s, n * h), rnd(rng, "float32", b, t, n * h), \
        rnd(rng, "float32", b, t, n * h)
    if op == "Attention":
        feeds = [("Q", q), ("K", k), ("V", v), ("attn_mask", keep[:, None])]
        attrs: dict[str, Any] = {"q_num_heads": n, "kv_num_heads": n}
    else:
        feeds = [("query", q), ("key", k), ("value", v), ("bias", None),
                 ("key_padding_mask", keep.astype(np.int32))]
        attrs = {"num_heads": n}
    got, want, node = run_both(op, feeds, attrs, 1)
    spec, how = spec_from_node(node, {m: x for m, x in feeds if x is not None})
    if flip is None:
        assert spec.kv_start and not spec.bias
        assert how.tensors["kv_start"].tolist() == start.tolist()
    else:
        assert spec.bias and not spec.kv_start
    assert_close(got[0], want[0], "float32", f"{op} flip {flip}")


def test_attention_cross_causal_is_top_left_like_ort() -> None:
    """Without a cache ORT's is_causal is top-left (offset 0) even when K is longer than Q:
    attnreg gets it as a -inf bias, not its bottom-right causal."""
    rng = np.random.default_rng(9)
    q = rnd(rng, "float32", 1, 2, 3, 32)
    k, v = rnd(rng, "float32", 1, 2, 7, 32), rnd(rng, "float32", 1, 2, 7, 32)
    feeds = [("Q", q), ("K", k), ("V", v)]
    got, want, node = run_both("Attention", feeds, {"is_causal": 1}, 1)
    spec, how = spec_from_node(node, dict(feeds))
    assert not spec.causal and spec.bias and any("frontier" in r for r in how.rules)
    assert_close(got[0], want[0], "float32", "cross causal")


# -- refusals ----------------------------------------------------------------------------------
def _gqa_node(**attrs: Any) -> Any:
    return helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tot"],
                            ["o"], domain="com.microsoft", **{"num_heads": 2, "kv_num_heads": 1, **attrs})


def _gqa_qs_node(**attrs: Any) -> Any:
    """A GQA node with query_seqlens (input 16) named "qs"."""
    return helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tot"]
                            + [""] * 9 + ["qs"], ["o"], domain="com.microsoft",
                            **{"num_heads": 2, "kv_num_heads": 1, **attrs})


def _gqa_inputs(s: int = 4, lengths: tuple[int, ...] = (4,), past: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    b = len(lengths)
    return {"q": rnd(rng, "float32", b, s, 64), "k": rnd(rng, "float32", b, s, 32),
            "v": rnd(rng, "float32", b, s, 32), "pk": rnd(rng, "float32", b, 1, past, 32),
            "pv": rnd(rng, "float32", b, 1, past, 32), "sk": np.array(lengths, np.int32) - 1,
            "tot": np.array(max(lengths), np.int32)}


@pytest.mark.parametrize("node, inputs, field, words", [
    (_gqa_node(), {**_gqa_inputs(4, (4, 2)), "sk": np.array([3, 4], np.int32)}, "seqlens_k",
     "[0, 3]"),
    (_gqa_node(), {**_gqa_inputs(), "v": np.zeros((1, 4, 64), np.float32)}, "value",
     "one head size"),
    (_gqa_qs_node(), {**_gqa_inputs(4, (6, 5), past=3), "qs": np.array([3, 2], np.int32)},
     "query_seqlens", "ORT's query_seqlens rules"),      # P + S = 7 > capacity 6
    (_gqa_qs_node(), {**_gqa_inputs(4, (6, 5), past=6), "tot": np.array(10, np.int32),
                      "qs": np.array([3, 5], np.int32)}, "'query_seqlens'][1]", "min(S=4, T)"),
    (_gqa_qs_node(causal=0), {**_gqa_inputs(4, (6, 5), past=6), "qs": np.array([3, 2], np.int32)},
     "query_seqlens", "causal=1"),
    (_gqa_qs_node(), {**_gqa_inputs(4, (4, 3)), "pk": None, "pv": None,
                      "qs": np.array([3, 2], np.int32)}, "query_seqlens", "past_key"),
    (_gqa_node(qk_output=1), _gqa_inputs(), "qk_output", "0"),
    (_gqa_node(k_quant_type="PER_TENSOR"), _gqa_inputs(), "k_quant_type", "NONE"),
    (_gqa_node(sliding_window_cache=1, local_window_size=4), _gqa_inputs(), "sliding_window_cache", "0"),
    (_gqa_node(some_new_attr=1), _gqa_inputs(), "some_new_attr", "unknown attribute"),
    (_gqa_node(local_window_size=3, causal=0), _gqa_inputs(), "local_window_size", "causal=1"),
    (_gqa_node(), _gqa_inputs(1, (9,), past=3), "seqlens_k", "past_key's length 3"),
    (_gqa_node(kv_num_heads=3), _gqa_inputs(), "kv_num_heads", "divisor"),
    (helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tot"], ["o", "", "", "qk"],
                      domain="com.microsoft", num_heads=2, kv_num_heads=1), _gqa_inputs(), "output[3]",
     "score matrix"),
    (helper.make_node("Attention", ["q", "k", "v"], ["y"], qk_matmul_output_mode=4),
     {"q": np.zeros((1, 2, 3, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 3, 8), np.float32)}, "qk_matmul_output_mode", "one of 0..3"),
    (helper.make_node("Attention", ["q", "k", "v"], ["y"]),
     {"q": np.zeros((1, 2, 3, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 4, 16), np.float32)}, "'V'", "(1, 2, 3, 16)"),
    (helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "", "pk", "pv"], ["o"],
                      domain="com.microsoft", num_heads=2),
     {"q": np.zeros((1, 3, 16), np.float32), "k": np.zeros((1, 3, 16), np.float32),
      "v": np.zeros((1, 3, 32), np.float32), "pk": np.zeros((1, 2, 2, 8), np.float32),
      "pv": np.zeros((1, 2, 2, 16), np.float32)}, "value", "past_key/past_value"),
    (helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft",
                      num_heads=2),
     {"q": np.zeros((1, 3, 16), np.float32), "k": np.zeros((1, 2, 5, 8), np.float32),
      "v": np.zeros((1, 2, 5, 16), np.float32)}, "value", "4-D (BNSH)"),
    (helper.make_node("Attention", ["q", "k", "v", "m"], ["y"]),
     {"q": np.zeros((1, 2, 3, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 3, 8), np.float32), "m": np.zeros((3, 3), np.int32)}, "attn_mask", "bool"),
    (helper.make_node("Attention", ["q", "k", "v", "m"], ["y"]),     # all True: still checked
     {"q": np.zeros((1, 2, 3, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 3, 8), np.float32), "m": np.ones((5, 3, 3), bool)}, "mask", "broadcastable"),
    (helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y"], is_causal=1),
     {"q": np.zeros((1, 2, 1, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 3, 8), np.float32), "pk": np.zeros((1, 2, 4, 8), np.float32),
      "pv": np.zeros((1, 2, 4, 8), np.float32)}, "is_causal", "ambiguous"),
    (helper.make_node("Attention", ["q", "k", "v"], ["y"]),
     {"q": np.zeros((1, 3, 16), np.float32), "k": np.zeros((1, 3, 16), np.float32),
      "v": np.zeros((1, 3, 16), np.float32)}, "q_num_heads", "3-D"),
    (helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft",
                      num_heads=2, unidirectional=1),
     {"q": np.zeros((1, 3, 16), np.float32), "k": np.zeros((1, 5, 16), np.float32),
      "v": np.zeros((1, 5, 16), np.float32)}, "unidirectional", "neither top-left"),
    (helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=2),
     {"q": np.zeros((1, 3, 16), np.float32), "k": np.zeros((1, 5, 16), np.float16),
      "v": np.zeros((1, 5, 16), np.float16)}, "key", "never casts"),
    (helper.make_node("Attention", ["q", "k", "v"], ["y"], domain="com.microsoft"),
     {}, "op_type", "GroupQueryAttention"),
    ("not a node", {}, "node", "NodeProto"),
])
def test_refusals_name_field_value_and_expectation(node: Any, inputs: dict[str, Any], field: str,
                                                   words: str) -> None:
    with pytest.raises(attnreg.SpecError) as info:
        spec_from_node(node, inputs)
    assert field in info.value.field and words in str(info.value), str(info.value)


def test_missing_onnx_raises_spec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    node = _gqa_node()
    monkeypatch.setitem(sys.modules, "onnx", None)      # import onnx now raises ImportError
    with pytest.raises(attnreg.SpecError, match="pip install onnx"):
        spec_from_node(node, _gqa_inputs())


def test_positional_inputs_and_views() -> None:
    """Inputs by position work like inputs by name; 3-D q is passed on as a view."""
    node = _gqa_node()
    named = _gqa_inputs()
    spec, how = spec_from_node(node, [named[n] for n in ("q", "k", "v", "pk", "pv", "sk", "tot")])
    assert spec.q_layout == "BSNH" and np.shares_memory(how.tensors["q"], named["q"])
    spec2, _ = spec_from_node(node, named)
    assert spec == spec2
    with attnreg.Session(backend="reference") as session:
        a = run_node(node, named, session=session)
    b = run_node(node, named, backend="reference")
    assert len(a) == 1 and np.array_equal(a[0], b[0])


def test_gqa_position_ids_on_decode() -> None:
    """position_ids set the rotary positions of a decode step (not the cache slots)."""
    rng = np.random.default_rng(5)
    b, nq, nkv, h, past = 2, 4, 2, 32, 7
    ang = rng.uniform(0, 6, (64, h // 2))
    feeds = [("query", rnd(rng, "float32", b, 1, nq * h)), ("key", rnd(rng, "float32", b, 1, nkv * h)),
             ("value", rnd(rng, "float32", b, 1, nkv * h)),
             ("past_key", rnd(rng, "float32", b, nkv, past, h)),
             ("past_value", rnd(rng, "float32", b, nkv, past, h)),
             ("seqlens_k", np.array([past, past - 2], np.int32)),
             ("total_sequence_length", np.array(past + 1, np.int32)),
             ("cos_cache", np.cos(ang).astype("float32")), ("sin_cache", np.sin(ang).astype("float32")),
             ("position_ids", np.array([[30], [3]], np.int64))]
    attrs = {"num_heads": nq, "kv_num_heads": nkv, "do_rotary": 1}
    got, want, _ = run_both("GroupQueryAttention", feeds, attrs, 3)
    assert_close(got[0], want[0], "float32", "output")
    for i, n in enumerate((past + 1, past - 1)):
        assert_close(got[1][i, :, :n], want[1][i, :, :n], "float32", f"present_key b{i}")
    default, _, _ = run_both("GroupQueryAttention", feeds[:-1], attrs, 3)
    assert np.abs(default[0] - want[0]).max() > 1e-2         # the positions mattered


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_attention_short_mask_is_padded_with_minus_inf(kind: str) -> None:
    """ONNX lets attn_mask's last dim be shorter than total (padded with -inf); ORT's CPU EP
    refuses it, so this compares with onnx's own reference implementation."""
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(6)
    q = rnd(rng, "float32", 1, 2, 3, 32)
    k, v = rnd(rng, "float32", 1, 2, 5, 32), rnd(rng, "float32", 1, 2, 5, 32)
    mask = rnd(rng, "float32", 3, 3) if kind == "float" else rng.random((3, 3)) < 0.7
    mask[:, 0] = True if kind == "bool" else mask[:, 0]
    node = helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"])
    elem = {"Q": TensorProto.FLOAT, "K": TensorProto.FLOAT, "V": TensorProto.FLOAT,
            "M": ELEM[mask.dtype.name]}
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, e, None)
                                            for n, e in elem.items()],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {"Q": q, "K": k, "V": v, "M": mask}
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = run_node(node, feeds, backend="reference")[0]
    assert_close(got, want, "float32", "short mask")
