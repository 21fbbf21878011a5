"""Random single-node cases for attnreg.integrations.onnx and the onnxruntime runs they are
compared with (tests/test_integrations_onnx*.py): the CPU EP's output of a node, attnreg's
through run_node, and the contract tolerance of the dtype. Imported only after the test
modules' importorskip of onnx and onnxruntime."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from attnreg.integrations.onnx import run_node, spec_from_node
from attnreg.kernel import TOLERANCE

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
