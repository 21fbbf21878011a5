"""attnreg.integrations.onnx against onnxruntime's CPU EP: single-node models of the standard
Attention op and com.microsoft GroupQueryAttention / MultiHeadAttention, random cases from a
seeded RNG, compared within the contract tolerance of the dtype (never attnreg with itself)."""

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
from attnreg.kernel import TOLERANCE  # noqa: E402
from tests.support import require_devices  # noqa: E402

N_CASES = 110
N_MODEL_CASES = 40          # random cases per op for the mappings onto the model fields
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int32": TensorProto.INT32,
        "int64": TensorProto.INT64, "bool": TensorProto.BOOL}
_SESSIONS: dict[Any, Any] = {}


def ort_node(op: str, feeds: list[tuple[str, np.ndarray | None]], attrs: dict[str, Any],
             n_out: int, opset: int = 23) -> tuple[Any, Any]:
    """(node, session): one session per distinct attribute set, input presence and dtypes
    (dims are left free, so every shape reuses it)."""
    while feeds and feeds[-1][1] is None:
        feeds = feeds[:-1]
    domain = "" if op == "Attention" else "com.microsoft"
    sig = tuple((n, v.dtype.name, v.ndim) if v is not None else None for n, v in feeds)
    key = (op, sig, tuple(sorted(attrs.items())), n_out, opset)
    if key not in _SESSIONS:
        node = helper.make_node(op, [n if v is not None else "" for n, v in feeds],
                                [f"out{i}" for i in range(n_out)], domain=domain or None, **attrs)
        ins = [helper.make_tensor_value_info(n, ELEM[v.dtype.name], [None] * v.ndim)
               for n, v in feeds if v is not None]
        outs = [helper.make_value_info(o, onnx.TypeProto()) for o in node.output]
        opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
        model = helper.make_model(helper.make_graph([node], "g", ins, outs), opset_imports=opsets)
        model.ir_version = 10
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        _SESSIONS[key] = node, ort.InferenceSession(model.SerializeToString(), so,
                                                   providers=["CPUExecutionProvider"])
    return _SESSIONS[key]


def run_both(op: str, feeds: list[tuple[str, np.ndarray | None]], attrs: dict[str, Any],
             n_out: int, opset: int = 23, backend: str = "reference",
             ort_feeds: list[tuple[str, np.ndarray | None]] | None = None
             ) -> tuple[list[Any], list[Any], Any]:
    """attnreg's and ORT's outputs of one node; ``ort_feeds``: the same problem in a form ORT's
    CPU EP implements (MHA's packed QKV / KV are not, so ORT gets them unpacked)."""
    node, sess = ort_node(op, ort_feeds or feeds, attrs, n_out, opset)
    want = sess.run(None, {n: v for n, v in ort_feeds or feeds if v is not None})
    if ort_feeds is not None:
        node = helper.make_node(op, [n if v is not None else "" for n, v in feeds],
                                list(node.output), domain=node.domain, **attrs)
    got = run_node(node, {n: v for n, v in feeds if v is not None}, backend=backend)
    return got, want, node


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    atol, rtol = TOLERANCE[dtype]
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=atol,
                               rtol=rtol, err_msg=what)


def rnd(rng: np.random.Generator, dtype: str, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def pick(rng: np.random.Generator, seq: Any) -> Any:
    return seq[int(rng.integers(len(seq)))]


# -- GroupQueryAttention ---------------------------------------------------------------------
def _gqa_feeds(rng: np.random.Generator, dtype: str, attrs: dict[str, Any],
               shape: tuple[int, int, int, int, int], pbuf: int, with_past: bool,
               lengths: np.ndarray, total: int) -> list[tuple[str, Any]]:
    """What both GQA case builders draw alike, in this order: softcap, scale and
    smooth_softmax into attrs; q, k, v (packed or not); a past of pbuf keys (when with_past,
    else half the time); seqlens_k and total_sequence_length."""
    b, s, nq, nkv, h = shape
    if rng.random() < 0.25:
        attrs["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.25:
        attrs["scale"] = float(rng.uniform(0.02, 0.3))
    if rng.random() < 0.2:
        attrs["smooth_softmax"] = 1
    packed = rng.random() < 0.2
    q, k, v = rnd(rng, dtype, b, s, nq * h), rnd(rng, dtype, b, s, nkv * h), rnd(rng, dtype, b, s, nkv * h)
    feeds: list[tuple[str, Any]] = [("query", np.concatenate([q, k, v], -1) if packed else q),
                                    ("key", None if packed else k), ("value", None if packed else v)]
    if with_past or rng.random() < 0.5:
        feeds += [("past_key", rnd(rng, dtype, b, nkv, pbuf, h)),
                  ("past_value", rnd(rng, dtype, b, nkv, pbuf, h))]
    else:
        feeds += [("past_key", None), ("past_value", None)]
    feeds += [("seqlens_k", (lengths - 1).astype(np.int32)),
              ("total_sequence_length", np.array(total, np.int32))]
    return feeds


def gqa_case(seed: int) -> tuple[list[tuple[str, Any]], dict[str, Any], np.ndarray, str]:
    rng = np.random.default_rng(1000 + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, nkv = pick(rng, (32, 64)), pick(rng, (1, 2))
    nq = nkv * pick(rng, (1, 2, 4))
    mode = pick(rng, ("prompt", "decode", "decode", "chunk"))
    if mode == "prompt":
        b, s = int(rng.integers(1, 4)), int(rng.integers(1, 18))
        lengths = np.full(b, s)
    elif mode == "decode":
        b, s = int(rng.integers(1, 4)), 1
        lengths = rng.integers(1, 42, b)
    else:                                   # a later prompt chunk (ORT: batch 1 only)
        b, s = 1, int(rng.integers(2, 18))
        lengths = np.array([s + int(rng.integers(1, 41))])
    total = int(lengths.max())
    first = s == total
    shared = rng.random() < 0.3             # past/present with the maximum length
    pbuf = total + int(rng.integers(0, 8)) if shared else (0 if first else total - s)
    attrs: dict[str, Any] = {"num_heads": nq, "kv_num_heads": nkv}
    causal = rng.random() > 0.1
    if not causal:
        attrs["causal"] = 0
    elif rng.random() < 0.35:
        attrs["local_window_size"] = int(rng.integers(1, 21))
    feeds = _gqa_feeds(rng, dtype, attrs, (b, s, nq, nkv, h), pbuf, bool(pbuf), lengths, total)
    extra: list[tuple[str, Any]] = [("cos_cache", None), ("sin_cache", None), ("position_ids", None),
                                    ("attention_bias", None), ("head_sink", None)]
    if rng.random() < 0.25:
        attrs["do_rotary"] = 1
        attrs["rotary_interleaved"] = int(rng.integers(0, 2))
        half = pick(rng, (h // 2, h // 4))
        ang = rng.uniform(0, 6, (64, half))
        extra[0] = ("cos_cache", np.cos(ang).astype(dtype))
        extra[1] = ("sin_cache", np.sin(ang).astype(dtype))
    if rng.random() < 0.2:
        extra[3] = ("attention_bias", rnd(rng, dtype, pick(rng, (1, b)), pick(rng, (1, nq)), s, total))
    if rng.random() < 0.15:
        extra[4] = ("head_sink", rnd(rng, dtype, nq))
    return feeds + extra, attrs, lengths, dtype


def check_gqa(seed: int, backend: str = "reference") -> None:
    feeds, attrs, lengths, dtype = gqa_case(seed)
    got, want, _ = run_both("GroupQueryAttention", feeds, attrs, 3, backend=backend)
    what = f"seed {seed}: {attrs}"
    assert_close(got[0], want[0], dtype, what + " output")
    for i in (1, 2):                        # present rows beyond each L_b are unspecified
        assert got[i].shape == want[i].shape, what
        for b, n in enumerate(lengths):
            assert_close(got[i][b, :, :n], want[i][b, :, :n], dtype, f"{what} present {i} b{b}")


@pytest.mark.parametrize("seed", range(N_CASES))
def test_gqa_matches_onnxruntime(seed: int) -> None:
    check_gqa(seed)


def gqa_padded_case(seed: int) -> tuple[list[tuple[str, Any]], dict[str, Any], np.ndarray,
                                         np.ndarray, str]:
    """A random GQA node with right-padded query rows: a first prompt with seqlens_k + 1 < S
    (row i at position i), or ORT's query_seqlens chunk (Q_b valid rows after P_b cached
    ones; Q_b = 0 is an idle entry). Returns feeds, attrs, T_b (valid keys after the step),
    the valid row counts Q_b and the dtype."""
    rng = np.random.default_rng(5000 + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, nkv = pick(rng, (32, 64)), pick(rng, (1, 2))
    nq = nkv * pick(rng, (1, 2, 4))
    b, s = int(rng.integers(1, 4)), int(rng.integers(2, 18))
    chunk = rng.random() < 0.5
    attrs: dict[str, Any] = {"num_heads": nq, "kv_num_heads": nkv}
    if chunk:
        rows = rng.integers(0 if rng.random() < 0.3 else 1, s + 1, b)
        past = rng.integers(0, 30, b)
        past[rows + past == 0] = 1
        lengths = past + rows
        # ORT: P_b <= past_key's length and P_b + S <= capacity = max(total, past length);
        # total_sequence_length is only an upper bound of T_b here
        room = int((past + s).max())
        if rng.random() < 0.5:
            pbuf, total = room + int(rng.integers(0, 4)), max(int(lengths.max()), s)
        else:
            pbuf, total = int(past.max()), room + int(rng.integers(0, 4))
    else:
        lengths = rng.integers(1, s + 1, b)
        if np.all(lengths == s):
            lengths[int(rng.integers(b))] = int(rng.integers(1, s))
        rows, past, total = lengths, np.zeros(b, np.int64), s
        pbuf = pick(rng, (0, 0, s + int(rng.integers(0, 6))))
        if rng.random() < 0.15:
            attrs["causal"] = 0
    if attrs.get("causal", 1) and rng.random() < 0.35:
        attrs["local_window_size"] = int(rng.integers(1, 21))
    feeds = _gqa_feeds(rng, dtype, attrs, (b, s, nq, nkv, h), pbuf, chunk or bool(pbuf), lengths,
                       total)
    extra: list[tuple[str, Any]] = [("cos_cache", None), ("sin_cache", None), ("position_ids", None),
                                    ("attention_bias", None), ("head_sink", None),
                                    ("k_scale", None), ("v_scale", None), ("q_norm_weight", None),
                                    ("k_norm_weight", None), ("query_seqlens", None)]
    if rng.random() < 0.3:
        attrs["do_rotary"] = 1
        attrs["rotary_interleaved"] = int(rng.integers(0, 2))
        half = pick(rng, (h // 2, h // 4))
        ang = rng.uniform(0, 6, (96, half))
        extra[0] = ("cos_cache", np.cos(ang).astype(dtype))
        extra[1] = ("sin_cache", np.sin(ang).astype(dtype))
        if chunk and rng.random() < 0.5:
            shift = rng.integers(0, 20, (b, 1))
            extra[2] = ("position_ids", (past[:, None] + np.arange(s) + shift).astype(np.int64))
    if rng.random() < 0.2:
        extra[3] = ("attention_bias", rnd(rng, dtype, pick(rng, (1, b)), pick(rng, (1, nq)), s, total))
    if rng.random() < 0.15:
        extra[4] = ("head_sink", rnd(rng, dtype, nq))
    if chunk:
        extra[9] = ("query_seqlens", rows.astype(np.int32))
    return feeds + extra, attrs, lengths, rows, dtype


def check_gqa_padded(seed: int, backend: str = "reference") -> None:
    """Valid rows match ORT; padding rows and idle entries are 0 in attnreg (ORT: its
    padding rows are unspecified with query_seqlens, see test_gqa_right_padded_prompt_rows)."""
    feeds, attrs, lengths, rows, dtype = gqa_padded_case(seed)
    got, want, node = run_both("GroupQueryAttention", feeds, attrs, 3, backend=backend)
    spec, _ = spec_from_node(node, {n: v for n, v in feeds if v is not None})
    what = f"seed {seed}: {attrs} rows {rows.tolist()} lengths {lengths.tolist()}"
    assert spec.seqlens_q == bool(np.any(rows < feeds[0][1].shape[1])), what
    assert got[0].shape == want[0].shape, what
    for b, (n, t) in enumerate(zip(rows, lengths)):
        assert_close(got[0][b, :n], want[0][b, :n], dtype, f"{what} output b{b}")
        assert not np.any(got[0][b, n:]), f"{what}: padding rows of b{b} are not 0"
        for i in (1, 2):                    # present rows beyond each T_b are unspecified
            assert got[i].shape == want[i].shape, what
            assert_close(got[i][b, :, :t], want[i][b, :, :t], dtype, f"{what} present {i} b{b}")


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_gqa_right_padded_matches_onnxruntime(seed: int) -> None:
    check_gqa_padded(seed)


# -- Attention (ai.onnx, opset 23/24) --------------------------------------------------------
def attention_case(seed: int, model: bool = False
                   ) -> tuple[list[tuple[str, Any]], dict[str, Any], int, int, str]:
    """A random Attention node; ``model``: other seeds, V head sizes != K's (v_head_size) and
    bool masks that left-pad (kv_start), some with one element off (must stay a bias)."""
    rng = np.random.default_rng((2500 if model else 2000) + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, nkv = pick(rng, (32, 64)), pick(rng, (1, 2))
    hv = pick(rng, tuple(x for x in (16, 48, 64, 96) if x != h)) if model and rng.random() < 0.6 \
        else h
    nq = nkv * pick(rng, (1, 2, 4))
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 18))
    mode = pick(rng, ("self", "past", "cross", "nonpad"))
    t = s if mode == "self" else int(rng.integers(1, 21)) if mode == "cross" else \
        pick(rng, (s, s, int(rng.integers(1, 18)))) if mode == "past" else s + int(rng.integers(0, 30))
    past = int(rng.integers(1, 41)) if mode == "past" else 0
    total = past + t
    three_d = rng.random() < 0.5
    attrs: dict[str, Any] = {}
    if three_d:
        attrs.update(q_num_heads=nq, kv_num_heads=nkv)
        q, k, v = rnd(rng, dtype, b, s, nq * h), rnd(rng, dtype, b, t, nkv * h), \
            rnd(rng, dtype, b, t, nkv * hv)
    else:
        q, k, v = rnd(rng, dtype, b, nq, s, h), rnd(rng, dtype, b, nkv, t, h), rnd(rng, dtype, b, nkv, t, hv)
    if rng.random() < 0.5 and not (mode == "past" and s == 1 and t > 1):   # refused: see below
        attrs["is_causal"] = 1
    if rng.random() < 0.25:
        attrs["softcap"] = float(rng.uniform(1, 30))
    if rng.random() < 0.25:
        attrs["scale"] = float(rng.uniform(0.02, 0.3))
    mask = None
    kind = pick(rng, ("none", "bool", "float"))
    if model and rng.random() < 0.6:
        mask = left_pad_mask(rng, b, nq, s, total)
    elif kind != "none":
        shape = pick(rng, ((s, total), (pick(rng, (1, b)), pick(rng, (1, nq)), s, total),
                           (pick(rng, (1, nq)), s, total)))
        mask = rng.random(shape) < 0.75 if kind == "bool" else \
            rnd(rng, pick(rng, (dtype, "float32")), *shape)
    feeds = [("Q", q), ("K", k), ("V", v), ("attn_mask", mask)]
    n_out, opset = 1, pick(rng, (23, 24))
    if mode == "past":
        feeds += [("past_key", rnd(rng, dtype, b, nkv, past, h)),
                  ("past_value", rnd(rng, dtype, b, nkv, past, hv))]
        n_out = 3
    if mode == "nonpad":
        feeds += [("past_key", None), ("past_value", None),
                  ("nonpad_kv_seqlen", rng.integers(0 if rng.random() < 0.2 else s, t + 1, b))]
        opset = 24
    return feeds, attrs, n_out, opset, dtype


def left_pad_mask(rng: np.random.Generator, b: int, nq: int, s: int, total: int) -> np.ndarray:
    """A bool mask hiding keys j < start[b] from every row and head (left padding), in one of
    the shapes ONNX broadcasts; a quarter of them have one element flipped (not a prefix)."""
    start = rng.integers(0, total, b)
    shape = pick(rng, ((b, 1, s, total), (b, nq, s, total), (s, total)))   # ORT: S in the mask
    if len(shape) == 2:
        start = start[:1]
    mask = np.arange(total) >= start.reshape(-1, *[1] * (len(shape) - 1))
    mask = np.ascontiguousarray(np.broadcast_to(mask, shape))
    if rng.random() < 0.25:
        idx = tuple(int(rng.integers(d)) for d in shape)
        mask[idx] = not mask[idx]
    return mask


def check_attention(seed: int, backend: str = "reference", model: bool = False) -> None:
    feeds, attrs, n_out, opset, dtype = attention_case(seed, model)
    got, want, _ = run_both("Attention", feeds, attrs, n_out, opset, backend=backend)
    what = f"seed {seed}: {attrs} {[(n, None if v is None else v.shape) for n, v in feeds]}"
    # Fully masked rows are 0 in both (ONNX 1.23 errata; attnreg's contract).
    assert_close(got[0], want[0], dtype, what + " Y")
    for i in range(1, n_out):
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"{what} present {i}")


@pytest.mark.parametrize("seed", range(N_CASES))
def test_attention_matches_onnxruntime(seed: int) -> None:
    check_attention(seed)


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_attention_v_head_size_and_left_padding_match_onnxruntime(seed: int) -> None:
    check_attention(seed, model=True)


# -- MultiHeadAttention ----------------------------------------------------------------------
def mha_case(seed: int, model: bool = False
             ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]] | None, dict[str, Any], int, str]:
    """A random MultiHeadAttention node; ``model``: other seeds, a V hidden size != K's
    (v_head_size; 3-D value without a past, as ORT defines it) and left-padding
    key_padding_masks (kv_start), some with one element off (must stay a bias)."""
    rng = np.random.default_rng((3500 if model else 3000) + seed)
    dtype = pick(rng, ("float32", "float32", "float16"))
    h, n = pick(rng, (32, 64)), pick(rng, (1, 2, 4))
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 18))
    form = pick(rng, ("self", "self", "cross", "packed_qkv", "packed_kv", "bnsh"))
    hv = h
    if model:
        form = pick(rng, ("self", "cross"))
        if rng.random() < 0.6:
            hv = pick(rng, tuple(x for x in (16, 48, 64, 96) if x != h))
    t = s if form in ("self", "packed_qkv") else int(rng.integers(1, 21))
    past = int(rng.integers(0, 41)) if form == "self" and hv == h else 0
    total = past + t
    attrs: dict[str, Any] = {"num_heads": n}
    if t == s and form != "bnsh" and rng.random() < 0.5:
        attrs["unidirectional"] = 1
    if rng.random() < 0.25:
        attrs["scale"] = float(rng.uniform(0.02, 0.3))
    q = rnd(rng, dtype, b, s, n * h)
    key = value = proj = None
    if form == "packed_qkv":
        q = rnd(rng, dtype, b, s, n, 3, h)
    elif form == "packed_kv":
        key = rnd(rng, dtype, b, t, n, 2, h)
    elif form == "bnsh":
        key, value = rnd(rng, dtype, b, n, t, h), rnd(rng, dtype, b, n, t, h)
    else:
        key, value = rnd(rng, dtype, b, t, n * h), rnd(rng, dtype, b, t, n * hv)
        if rng.random() < 0.25:
            proj = rnd(rng, dtype, 2 * n * h + n * hv)
    kpm = None
    kind = pick(rng, ("none", "none", "lengths", "2d", "3d"))
    if model and rng.random() < 0.6:
        # left padding; with unidirectional every row keeps a visible key (start <= past),
        # since ORT's MHA gives fully padded rows the softmax over them (see below)
        hi = past + 1 if "unidirectional" in attrs else total
        start = rng.integers(0, hi, b)
        kpm = (np.arange(total) >= start[:, None]).astype(np.int32)
        if rng.random() < 0.5:
            kpm = np.ascontiguousarray(np.broadcast_to(kpm[:, None], (b, s, total)))
        if rng.random() < 0.25:                      # not a prefix: stays a bias
            i = tuple(int(rng.integers(d)) for d in kpm.shape[:-1]) + (int(rng.integers(hi)),)
            kpm[i] = 1 - kpm[i]
            kpm[..., hi - 1] = 1
    elif kind == "lengths":
        kpm = rng.integers(1, total + 1, b).astype(np.int32)
    elif kind != "none":
        kpm = (rng.random((b, total) if kind == "2d" else (b, s, total)) < 0.7).astype(np.int32)
        kpm[..., 0] = 1                      # every row keeps a visible key (see the test below)
    ab = rnd(rng, dtype, pick(rng, (1, b)), pick(rng, (1, n)), s, total) if rng.random() < 0.3 else None
    feeds: list[tuple[str, Any]] = [("query", q), ("key", key), ("value", value), ("bias", proj),
                                    ("key_padding_mask", kpm), ("attention_bias", ab)]
    n_out = 1
    if form == "self" and hv == h and (past or rng.random() < 0.3):
        feeds += [("past_key", rnd(rng, dtype, b, n, past, h)),
                  ("past_value", rnd(rng, dtype, b, n, past, h))]
        n_out = 3
    elif hv != h and rng.random() < 0.4:
        n_out = 3                            # present_value [B, N, T, Hv] without a past
    ort_feeds = None                         # ORT's CPU EP has no packed forms: unpack for it
    if form == "packed_qkv":
        ort_feeds = [("query", q[:, :, :, 0].reshape(b, s, n * h)),
                     ("key", q[:, :, :, 1].reshape(b, s, n * h)),
                     ("value", q[:, :, :, 2].reshape(b, s, n * h)), *feeds[3:]]
    elif form == "packed_kv":
        assert key is not None
        ort_feeds = [feeds[0], ("key", key[:, :, :, 0].reshape(b, t, n * h)),
                     ("value", key[:, :, :, 1].reshape(b, t, n * h)), *feeds[3:]]
    return feeds, ort_feeds, attrs, n_out, dtype


def check_mha(seed: int, backend: str = "reference", model: bool = False) -> None:
    feeds, ort_feeds, attrs, n_out, dtype = mha_case(seed, model)
    got, want, _ = run_both("MultiHeadAttention", feeds, attrs, n_out, backend=backend,
                            ort_feeds=ort_feeds)
    what = f"seed {seed}: {attrs} {[(n, None if v is None else v.shape) for n, v in feeds]}"
    assert_close(got[0], want[0], dtype, what + " output")
    for i in range(1, n_out):
        assert_close(got[i], want[i], dtype, f"{what} present {i}")


@pytest.mark.parametrize("seed", range(N_CASES))
def test_mha_matches_onnxruntime(seed: int) -> None:
    check_mha(seed)


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_mha_v_head_size_and_left_padding_match_onnxruntime(seed: int) -> None:
    check_mha(seed, model=True)


# -- GPU backends (lavapipe, PoCL in CI) -----------------------------------------------------
@pytest.mark.parametrize("backend", ["webgpu", "opencl"])
def test_gpu_backends_match_onnxruntime(backend: str) -> None:
    require_devices(backend)
    # chosen to cover seqlens_k, kv_capacity (shared buffers), windows, sinks, rotary, softcap,
    # masks as biases, both q layouts, causal frontiers, float16 and a KV cache
    for seed in (0, 1, 3, 19):
        check_gqa(seed, backend)
    for seed in (3, 4, 5, 11):
        check_attention(seed, backend)
    for seed in (0, 3, 11, 22):
        check_mha(seed, backend)


@pytest.mark.parametrize("backend", ["webgpu", "opencl"])
def test_gpu_backends_model_fields_match_onnxruntime(backend: str) -> None:
    """The mappings onto seqlens_q, v_head_size and kv_start on a GPU backend."""
    require_devices(backend)
    # right-padded first prompts (window, f16), query_seqlens chunks (an idle entry; sinks,
    # softcap, f16); Attention / MHA with V head sizes != K's and left-padding masks
    for seed in (5, 18, 31):
        check_gqa_padded(seed, backend)
    for seed in (6, 14):
        check_attention(seed, backend, model=True)
    for seed in (4, 25):
        check_mha(seed, backend, model=True)


def test_model_cases_cover_the_new_mappings() -> None:
    """The random cases above exercise what they claim (counted on the specs, no ORT)."""
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
    (helper.make_node("Attention", ["q", "k", "v"], ["y"], qk_matmul_output_mode=1),
     {"q": np.zeros((1, 2, 3, 8), np.float32), "k": np.zeros((1, 2, 3, 8), np.float32),
      "v": np.zeros((1, 2, 3, 8), np.float32)}, "qk_matmul_output_mode", "0"),
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
