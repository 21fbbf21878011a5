"""com.microsoft GroupQueryAttention mapped onto attnreg (rules: attnreg.integrations.onnx):
packed or separate Q/K/V, the shared-buffer KV cache with seqlens_k, ORT's rotary and the
sink; what it does not map (ORT's quantized caches, the fused Q/K norms, the window-sized
cache) is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecError
from ..spec import AttentionSpec
from ._onnx_common import FLOATS, Inputs, Node, NodeRun, build, expect_shape, heads
from ._onnx_ops import _no_qk, _past, _scale, _softcap

GQA_IN = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale",
          "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens")


def _rotary(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray,
            interleaved: bool) -> np.ndarray:
    """ORT's rotary on [B, S, N, H] at positions [B, S]: float32 math, rounded to x's dtype."""
    y = x.astype(np.float32)
    d = cos.shape[1] * 2
    c = cos[pos][:, :, None, :].astype(np.float32)
    sn = sin[pos][:, :, None, :].astype(np.float32)
    if interleaved:
        a, b2 = y[..., 0:d:2].copy(), y[..., 1:d:2].copy()
        y[..., 0:d:2], y[..., 1:d:2] = a * c - b2 * sn, b2 * c + a * sn
    else:
        a, b2 = y[..., : d // 2].copy(), y[..., d // 2: d].copy()
        y[..., : d // 2], y[..., d // 2: d] = a * c - b2 * sn, b2 * c + a * sn
    return y.astype(x.dtype)


@dataclass
class _Rows:
    """Where each batch entry's rows and keys go: T_b = seqlens_k + 1 keys of which P_b were
    cached, ``new_rows`` valid new rows (``rows``: S_b where an entry has padding rows)."""

    lengths: np.ndarray            # T_b
    total: int                     # total_sequence_length
    cap: int                       # the present cache's capacity
    past: np.ndarray               # P_b
    new_rows: np.ndarray
    rows: np.ndarray | None = None
    idle: tuple[int, ...] = ()     # entries with no valid row (query_seqlens 0)
    first: bool = False            # a first prompt (S == total_sequence_length)


def _check_attrs(node: Node, ins: Inputs) -> tuple[int, int]:
    """Refuse what is not mapped (quantized caches, Q/K norms, the window-sized cache);
    returns (num_heads, kv_num_heads)."""
    node.check_attrs(("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size",
                      "do_rotary", "rotary_interleaved", "smooth_softmax", "qk_output", "causal",
                      "sliding_window_cache", "k_quant_type", "v_quant_type",
                      "kv_cache_bit_width", "qk_norm_epsilon", "q_norm_epsilon",
                      "k_norm_epsilon"))
    _no_qk(node, "qk_output", "output_qk")
    for name in ("k_quant_type", "v_quant_type"):
        if node.attr(name, "NONE", str) != "NONE":
            raise SpecError(f"GroupQueryAttention.attribute[{name!r}]", node.attrs[name],
                            "'NONE': quantized ORT caches are not mapped")
    if node.attr("sliding_window_cache", 0, int):
        raise SpecError("GroupQueryAttention.attribute['sliding_window_cache']", 1, "0: ORT's "
                        "window-sized, internally evicting cache layout is not mapped")
    for i, why in ((12, "absent: quantized ORT caches are not mapped"),
                   (13, "absent: quantized ORT caches are not mapped"),
                   (14, "absent: the fused Q/K RMS norm is not mapped (ORT's CPU EP refuses it too)"),
                   (15, "absent: the fused Q/K RMS norm is not mapped (ORT's CPU EP refuses it too)")):
        ins.refuse(i, why)
    nq, nkv = node.attr("num_heads", 0, int), node.attr("kv_num_heads", 0, int)
    if nq <= 0 or nkv <= 0 or nq % nkv:
        raise SpecError("GroupQueryAttention.attribute['kv_num_heads']", nkv,
                        f"a positive divisor of num_heads={nq}")
    return nq, nkv


def _qkv(ins: Inputs, query: np.ndarray, nq: int, nkv: int, rules: list[str]
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q, K and V as [B, S, N, H] (views of a packed query, or the separate inputs) and H."""
    key, value = ins.get(1, FLOATS, (3,)), ins.get(2, FLOATS, (3,))
    b, s, d = query.shape
    if key is None and value is None:
        if d % (nq + 2 * nkv):
            raise SpecError(ins.field(0) + ".shape", query.shape, "packed QKV [B, S, (Nq + "
                            f"2*Nkv)*H] with Nq={nq}, Nkv={nkv}")
        h = d // (nq + 2 * nkv)
        q = query[..., : nq * h].reshape(b, s, nq, h)
        kn = query[..., nq * h: (nq + nkv) * h].reshape(b, s, nkv, h)
        vn = query[..., (nq + nkv) * h:].reshape(b, s, nkv, h)
        rules.append("packed QKV split into views")
        return q, kn, vn, h
    if key is None or value is None:
        raise SpecError(ins.field(1 if key is None else 2), None, "key and value together, "
                        "or neither (packed QKV in query)")
    q = heads(ins.field(0), query, nq)
    h = q.shape[3]
    if value.shape[2] != key.shape[2]:
        raise SpecError(ins.field(2) + ".shape", value.shape, f"a last dim {key.shape[2]} "
                        "like the key's: GroupQueryAttention has one head size for K and V "
                        "(attnreg's v_head_size is mapped for Attention and "
                        "MultiHeadAttention, whose ops allow it)")
    kn, vn = heads(ins.field(1), key, nkv), heads(ins.field(2), value, nkv)
    for i, t in ((1, kn), (2, vn)):
        expect_shape(ins.field(i), t, (b, s, nkv, h), "[B, S, Nkv*H] like the query")
    return q, kn, vn, h


def _query_seqlens_rows(ins: Inputs, qs: np.ndarray, lengths: np.ndarray, total: int, cap: int,
                        s: int, pbuf: int, allowed: bool, rules: list[str]) -> _Rows:
    """ORT's right-padded query chunk: Q_b valid rows, T_b = seqlens_k + 1, P_b = T_b - Q_b
    (``allowed``: causal=1 with past_key / past_value, as ORT requires)."""
    if not allowed:
        raise SpecError(ins.field(16), qs, "absent unless causal=1 and past_key/past_value "
                        "are given (ORT's requirements for query_seqlens)")
    expect_shape(ins.field(16), qs, (len(lengths),), "one valid query row count per batch entry")
    past = lengths - qs
    bad = (lengths < 1) | (lengths > total) | (qs < 0) | (qs > np.minimum(s, lengths)) \
        | (past > pbuf) | (past + s > cap)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise SpecError(f"{ins.field(16)}[{i}]", int(qs[i]), f"ORT's query_seqlens rules "
                        f"with seqlens_k + 1 = T = {int(lengths[i])}: 0 <= value <= "
                        f"min(S={s}, T), 1 <= T <= total_sequence_length={total}, T - value "
                        f"<= past_key's length {pbuf} and T - value + S <= the cache "
                        f"capacity {cap}")
    new_rows = qs.astype(np.int64)
    rules.append("query_seqlens: rows past query_seqlens[b] are padding -> seqlens_q; only "
                 "the valid rows enter present; idle entries (0) give 0 and keep the cache")
    # an idle entry runs one row; its output is 0
    return _Rows(lengths, total, cap, past, new_rows, rows=np.maximum(new_rows, 1),
                 idle=tuple(int(i) for i in np.flatnonzero(qs == 0)))


def _prompt_rows(ins: Inputs, sk: np.ndarray, lengths: np.ndarray, total: int, cap: int,
                 s: int, rules: list[str]) -> _Rows:
    """A first prompt; seqlens_k + 1 < S is a right-padded one: row i at position i."""
    if np.any((lengths < 1) | (lengths > s)):
        bad = int(np.argmax((lengths < 1) | (lengths > s)))
        raise SpecError(f"{ins.field(5)}[{bad}]", int(sk[bad]), f"a value in [0, {s - 1}] "
                        "(= total length - 1 <= S - 1) on a first prompt")
    padded = bool(np.any(lengths < s))
    if padded:
        rules.append("right-padded first prompt: S_b = seqlens_k + 1 valid rows -> "
                     "seqlens_q (padding rows are 0)")
    return _Rows(lengths, total, cap, np.zeros(len(lengths), np.int64), lengths,
                 rows=lengths if padded else None, first=True)


def _step_rows(ins: Inputs, sk: np.ndarray, lengths: np.ndarray, total: int, cap: int, s: int,
               pbuf: int) -> _Rows:
    """S new rows after P_b = T_b - S cached ones in every batch entry."""
    past = lengths - s
    if np.any(past < 0) or np.any(past > pbuf) or np.any(lengths > total):
        bad = int(np.argmax((past < 0) | (past > pbuf) | (lengths > total)))
        raise SpecError(f"{ins.field(5)}[{bad}]", int(sk[bad]), f"a value with S={s} <= "
                        f"value + 1 <= total_sequence_length={total} and value + 1 - S <= "
                        f"past_key's length {pbuf}")
    return _Rows(lengths, total, cap, past, np.full(len(lengths), s, np.int64))


def _rows(node: Node, ins: Inputs, b: int, s: int, pbuf: int, has_past: bool,
          rules: list[str]) -> _Rows:
    """seqlens_k, total_sequence_length and query_seqlens read as each entry's rows and keys."""
    sk = ins.need(5, ("int32",), (1,))
    expect_shape(ins.field(5), sk, (b,), "one value (total length - 1) per batch entry")
    tot_arr = ins.need(6, ("int32",))
    if tot_arr.size != 1 or tot_arr.ndim > 1:
        raise SpecError(ins.field(6) + ".shape", tot_arr.shape, "a scalar (or [1])")
    total = int(tot_arr.reshape(()))
    lengths = sk.astype(np.int64) + 1
    causal = node.attr("causal", 1, int)
    qs = ins.get(16, ("int32",), (1,))
    cap = max(total, pbuf)
    if qs is not None:
        return _query_seqlens_rows(ins, qs, lengths, total, cap, s, pbuf,
                                   causal == 1 and has_past, rules)
    if s == total:
        return _prompt_rows(ins, sk, lengths, total, cap, s, rules)
    return _step_rows(ins, sk, lengths, total, cap, s, pbuf)


def _rotate(node: Node, ins: Inputs, q: np.ndarray, kn: np.ndarray, r: _Rows,
            rules: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """ORT's rotary on Q and the new K (do_rotary=1) at each valid row's position."""
    if not node.attr("do_rotary", 0, int):
        for i in (7, 8, 9):
            ins.refuse(i, "absent unless do_rotary=1")
        return q, kn
    b, s, _, h = q.shape
    cos, sin = ins.need(7, FLOATS, (2,)), ins.need(8, FLOATS, (2,))
    if cos.shape != sin.shape or cos.shape[1] * 2 > h or cos.dtype != q.dtype:
        raise SpecError(ins.field(7) + ".shape", cos.shape, f"[max_seq, rotary_dim/2] like "
                        f"sin_cache {sin.shape}, rotary_dim <= head_size={h}, dtype "
                        f"{q.dtype.name}")
    pos_ids = ins.get(9, ("int64",), (2,))
    if pos_ids is not None:
        if r.first:
            raise SpecError(ins.field(9), pos_ids, "absent on a first prompt (ORT reads only "
                            "its first element there; not mapped)")
        expect_shape(ins.field(9), pos_ids, (b, s), "[B, S]")
        pos = pos_ids
    else:
        pos = r.past[:, None] + np.arange(s)[None, :]
    valid = np.arange(s)[None, :] < r.new_rows[:, None]     # padding rows: never read
    if np.any(valid & ((pos < 0) | (pos >= cos.shape[0]))):
        raise SpecError(ins.field(7) + ".shape", cos.shape, f"more than "
                        f"{int(np.where(valid, pos, 0).max())} rows (one per position)")
    pos = np.where(valid, pos, 0)
    inter = bool(node.attr("rotary_interleaved", 0, int))
    rules.append("rotary applied on the host (float32 math, rounded like ORT)")
    return _rotary(q, pos, cos, sin, inter), _rotary(kn, pos, cos, sin, inter)


def _present(kn: np.ndarray, vn: np.ndarray, pk: np.ndarray | None, pv: np.ndarray | None,
             r: _Rows, dtype: np.dtype, rules: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The present cache in ``dtype`` (the query's), BNSH at capacity: each entry's past
    rows, then its valid new rows."""
    b, _, nkv, h = kn.shape
    kk = np.zeros((b, nkv, r.cap, h), dtype)
    vv = np.zeros((b, nkv, r.cap, h), dtype)
    for bi in range(b):
        p, m = int(r.past[bi]), int(r.new_rows[bi])
        if p:
            assert pk is not None and pv is not None
            kk[bi, :, :p], vv[bi, :, :p] = pk[bi, :, :p], pv[bi, :, :p]
        kk[bi, :, p: p + m] = kn[bi, :m].transpose(1, 0, 2)
        vv[bi, :, p: p + m] = vn[bi, :m].transpose(1, 0, 2)
    rules.append("present = past[:P_b] + the valid new K/V rows per batch entry (BNSH, capacity "
                 "max(total_sequence_length, past length); rows beyond seqlens_k + 1 are 0)")
    return kk, vv


def _bias_and_sink(node: Node, ins: Inputs, dtype: np.dtype, nq: int, s: int, r: _Rows,
                   rules: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """attention_bias (widened to the capacity with zeros) and the sink: head_sink, or
    smooth_softmax's zero sink."""
    add = ins.get(10, FLOATS, (4,))
    if add is not None:
        if add.dtype != dtype or add.shape[3] != r.total or add.shape[2] != s:
            raise SpecError(ins.field(10) + ".shape", add.shape, f"[B or 1, Nq or 1, S={s}, "
                            f"total_sequence_length={r.total}] of {dtype.name}")
        if r.cap > r.total:
            add = np.concatenate([add, np.zeros((*add.shape[:3], r.cap - r.total), add.dtype)],
                                 3)
    sink = ins.get(11, FLOATS, (1,))
    if sink is not None:
        expect_shape(ins.field(11), sink, (nq,), "one sink logit per query head")
        if sink.dtype not in (dtype, np.dtype(np.float32)):
            sink = sink.astype(np.float32)
        rules.append("head_sink input -> head_sink")
    elif node.attr("smooth_softmax", 0, int):
        sink = np.zeros(nq, np.float32)
        rules.append("smooth_softmax -> an all-zero head_sink")
    return add, sink


def map_gqa(node: Node, ins: Inputs) -> tuple[AttentionSpec, NodeRun]:
    nq, nkv = _check_attrs(node, ins)
    rules: list[str] = []
    query = ins.need(0, FLOATS, (3,))
    q, kn, vn, h = _qkv(ins, query, nq, nkv, rules)
    b, s = query.shape[:2]
    pk, pv = _past(ins, 3, b, nkv, h, query.dtype)
    r = _rows(node, ins, b, s, 0 if pk is None else pk.shape[2], pk is not None, rules)
    q, kn = _rotate(node, ins, q, kn, r, rules)
    kk, vv = _present(kn, vn, pk, pv, r, query.dtype, rules)
    causal = node.attr("causal", 1, int)
    window = node.attr("local_window_size", -1, int)
    if causal not in (0, 1) or window < -1 or (window > 0 and not causal):
        raise SpecError("GroupQueryAttention.attribute['local_window_size']", window,
                        "-1 (off) or a positive window with causal=1")
    add, sink = _bias_and_sink(node, ins, query.dtype, nq, s, r, rules)
    present = (kk, vv) if node.wants(1) or node.wants(2) else None
    return build("GroupQueryAttention", node, q, "BSNH", kk, vv, "BNSH", output_shape=(b, s, nq * h),
                 scale=_scale(node), softcap=_softcap(node), lengths=r.lengths, q_lens=r.rows,
                 offsets=(r.lengths - (s if r.rows is None else r.rows)) if causal else None,
                 window=window, add=add, sink=sink, present=present, idle=r.idle, rules=rules)
