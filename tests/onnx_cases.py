"""Single-node runs for attnreg.integrations.onnx's tests (tests/integrations/test_onnx*.py):
onnxruntime's CPU EP output of a node beside attnreg's through run_node, the contract
tolerance of the dtype, the random draws, and the com.microsoft GroupQueryAttention cases
(Attention and MultiHeadAttention: tests/onnx_attention_cases.py). Imported only after the
test modules' importorskip of onnx and onnxruntime."""

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


def _draw_rotary(rng: np.random.Generator, dtype: str, h: int, rows: int,
                 attrs: dict[str, Any], extra: list[tuple[str, Any]]) -> None:
    """GQA's do_rotary with a random interleave and cos / sin caches of ``rows`` positions
    (half or a quarter of the head rotated) into attrs and extra[0:2] (the same draws, in the
    same order, for both case builders)."""
    attrs["do_rotary"] = 1
    attrs["rotary_interleaved"] = int(rng.integers(0, 2))
    half = pick(rng, (h // 2, h // 4))
    ang = rng.uniform(0, 6, (rows, half))
    extra[0] = ("cos_cache", np.cos(ang).astype(dtype))
    extra[1] = ("sin_cache", np.sin(ang).astype(dtype))


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
        _draw_rotary(rng, dtype, h, 64, attrs, extra)
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
        _draw_rotary(rng, dtype, h, 96, attrs, extra)
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
