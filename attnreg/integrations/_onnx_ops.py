"""The three ONNX attention ops, mapped onto attnreg (rules: attnreg.integrations.onnx)."""

from __future__ import annotations

import numpy as np

from ..errors import SpecError
from ..spec import AttentionSpec
from ._onnx_common import FLOATS, Inputs, Node, NodeRun, build, concat_kv, expect_shape, heads

ATTENTION_IN = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
GQA_IN = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale",
          "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens")
MHA_IN = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key",
          "past_value", "past_sequence_length", "cache_indirection")
INTS = ("int32", "int64")


def _scale(node: Node) -> float:
    scale = float(node.attr("scale", 0.0, float))
    if scale < 0 or not np.isfinite(scale):
        raise SpecError(f"{node.op}.attribute['scale']", scale, "0 (1/sqrt(head_size)) or a "
                        "positive finite float")
    return scale


def _softcap(node: Node) -> float:
    softcap = float(node.attr("softcap", 0.0, float))
    if softcap < 0 or not np.isfinite(softcap):
        raise SpecError(f"{node.op}.attribute['softcap']", softcap, "0 (off) or a positive float")
    return softcap


def _no_qk(node: Node, attr: str, out_name: str) -> None:
    if node.wants(3):
        raise SpecError(f"{node.op}.output[3]", node.outputs[3], f"no {out_name} output: attnreg "
                        "never materialises the score matrix, so it cannot produce it")
    if attr and node.attr(attr, 0, int) != 0:
        raise SpecError(f"{node.op}.attribute[{attr!r}]", node.attrs[attr], "0 (the default)")


def _past(ins: Inputs, ip: int, b: int, n: int, h: int, dtype: np.dtype,
          hv: int | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """past_key [B, n, P, h] and past_value [B, n, P, hv] (hv None: h), or (None, None)."""
    pk, pv = ins.get(ip, FLOATS, (4,)), ins.get(ip + 1, FLOATS, (4,))
    if (pk is None) != (pv is None):
        raise SpecError(ins.field(ip if pk is None else ip + 1), None,
                        "an array: past_key and past_value come together")
    if pk is not None and pv is not None:
        for i, t, d in ((ip, pk, h), (ip + 1, pv, h if hv is None else hv)):
            if t.dtype != dtype:
                raise SpecError(ins.field(i) + ".dtype", t.dtype.name, f"{dtype.name} (the "
                                "query's; quantized caches are not mapped)")
            expect_shape(ins.field(i), t, (b, n, pk.shape[2], d),
                         "BNSH [B, Nkv, P, H]" if i == ip else "BNSH [B, Nkv, P, Hv]")
    return pk, pv


def map_attention(node: Node, ins: Inputs) -> tuple[AttentionSpec, NodeRun]:
    node.check_attrs(("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode",
                      "scale", "softcap", "softmax_precision"))
    _no_qk(node, "qk_matmul_output_mode", "qk_matmul_output")
    node.attr("softmax_precision", 1, int)   # attnreg's softmax is float32 or better anyway
    rules: list[str] = []
    q = ins.need(0, FLOATS, (3, 4))
    k, v = ins.need(1, FLOATS, (3, 4)), ins.need(2, FLOATS, (3, 4))
    if not q.ndim == k.ndim == v.ndim:
        raise SpecError(ins.field(1) + ".shape", k.shape, f"{q.ndim} dims like Q (and V)")
    if q.ndim == 3:
        nq, nkv = node.attr("q_num_heads", 0, int), node.attr("kv_num_heads", 0, int)
        for name, val in (("q_num_heads", nq), ("kv_num_heads", nkv)):
            if val <= 0:
                raise SpecError(f"Attention.attribute[{name!r}]", node.attrs.get(name),
                                "a positive head count (required with 3-D Q, K, V)")
        q4 = heads(ins.field(0), q, nq)
        kn, vn = heads(ins.field(1), k, nkv), heads(ins.field(2), v, nkv)
        q_layout = "BSNH"
        rules.append("3-D Q [B, S, Nq*H] -> q_layout BSNH (a view)")
    else:
        q4, q_layout = q, "BNSH"
        kn, vn = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)   # views as [B, T, N, H]
    b, s = q4.shape[0], (q4.shape[1] if q_layout == "BSNH" else q4.shape[2])
    h, nkv, t_new, hv = kn.shape[3], kn.shape[2], kn.shape[1], vn.shape[3]
    expect_shape(ins.field(1), kn, (b, t_new, nkv, h), "batch like Q")
    expect_shape(ins.field(2), v, (b, t_new, nkv * hv) if q.ndim == 3 else (b, nkv, t_new, hv),
                 "batch, kv heads and length like K (any head size: v_head_size)")
    # Y has V's head size: [B, S, Nq*Hv] or [B, Nq, S, Hv]
    nq = q4.shape[2] if q_layout == "BSNH" else q4.shape[1]
    out_shape = (b, s, nq * hv) if q.ndim == 3 else (b, nq, s, hv)
    pk, pv = _past(ins, 4, b, nkv, h, q.dtype, hv)
    npk = ins.get(6, INTS, (1,))
    past = 0 if pk is None else pk.shape[2]
    if past or pk is not None or node.wants(1) or node.wants(2):
        kk, vv = concat_kv(pk, kn), concat_kv(pv, vn)
        kv_layout = "BNSH"
        rules.append("past + new K/V concatenated (BNSH) = present_key/value")
    elif q.ndim == 3:
        kk, vv, kv_layout = kn, vn, "BSNH"
    else:
        kk, vv, kv_layout = k, v, "BNSH"
    total = past + t_new
    lengths = None
    if npk is not None:
        if pk is not None:
            raise SpecError(ins.field(6), npk, "absent when past_key is given (ONNX: an "
                            "external cache uses nonpad_kv_seqlen without past/present)")
        expect_shape(ins.field(6), npk, (b,), "one length per batch entry")
        if np.any((npk < 0) | (npk > total)):
            raise SpecError(ins.field(6), npk.tolist(), f"values in [0, {total}]")
        lengths = npk.astype(np.int64)
    offsets = None
    if node.attr("is_causal", 0, int):
        if pk is not None and s == 1 and t_new > 1:
            raise SpecError("Attention.attribute['is_causal']", 1, "0, or one new key per query "
                            "row: with past_key, one query row and several new keys, ONNX "
                            "says row 0 sees keys j <= past while ORT 1.32 attends all keys, "
                            "so the node is ambiguous and refused")
        offsets = (lengths - s) if lengths is not None else np.full(b, past, np.int64)
    visible: np.ndarray | None = None
    add: np.ndarray | None = None
    mask = ins.get(3)
    if mask is not None:
        if mask.dtype == np.bool_:
            visible = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
            rules.append("bool attn_mask -> -inf bias where False")
        elif mask.dtype.name in FLOATS:
            if mask.dtype not in (q.dtype, np.dtype(np.float32)):
                raise SpecError(ins.field(3) + ".dtype", mask.dtype.name, f"bool, float32 or "
                                f"{q.dtype.name}")
            add = mask
            rules.append("float attn_mask -> bias (added)")
        else:
            raise SpecError(ins.field(3) + ".dtype", mask.dtype.name, "bool (True = attend) or "
                            "a float mask added to the scores")
        if not 2 <= mask.ndim <= 4 or mask.shape[-1] > total:
            raise SpecError(ins.field(3) + ".shape", mask.shape, "2 to 4 dims broadcastable to "
                            f"[B, Nq, S, total={total}] (a shorter last dim is padded with -inf)")
        if visible is not None and visible.shape[3] < total:
            widths = [(0, 0)] * 3 + [(0, total - visible.shape[3])]
            visible = np.pad(visible, widths, constant_values=False)
    present = (kk, vv) if kv_layout == "BNSH" and (node.wants(1) or node.wants(2)) else None
    return build("Attention", node, q4, q_layout, kk, vv, kv_layout, output_shape=out_shape,
                 scale=_scale(node), softcap=_softcap(node), lengths=lengths, offsets=offsets,
                 visible=visible, add=add, present=present, rules=rules)


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


def map_gqa(node: Node, ins: Inputs) -> tuple[AttentionSpec, NodeRun]:
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
    rules: list[str] = []
    query = ins.need(0, FLOATS, (3,))
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
    elif key is not None and value is not None:
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
    else:
        raise SpecError(ins.field(1 if key is None else 2), None, "key and value together, "
                        "or neither (packed QKV in query)")
    pk, pv = _past(ins, 3, b, nkv, h, query.dtype)
    pbuf = 0 if pk is None else pk.shape[2]
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
    idle: tuple[int, ...] = ()
    rows: np.ndarray | None = None           # S_b where a batch entry has padding rows
    if qs is not None:
        # ORT's right-padded query chunk: Q_b valid rows, T_b = seqlens_k + 1, P_b = T_b - Q_b
        if causal != 1 or pk is None:
            raise SpecError(ins.field(16), qs, "absent unless causal=1 and past_key/past_value "
                            "are given (ORT's requirements for query_seqlens)")
        expect_shape(ins.field(16), qs, (b,), "one valid query row count per batch entry")
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
        idle = tuple(int(i) for i in np.flatnonzero(qs == 0))
        rows = np.maximum(new_rows, 1)           # an idle entry runs one row; its output is 0
        first = False
        rules.append("query_seqlens: rows past query_seqlens[b] are padding -> seqlens_q; only "
                     "the valid rows enter present; idle entries (0) give 0 and keep the cache")
    elif s == total:
        # a first prompt; seqlens_k + 1 < S is a right-padded one: row i at position i
        if np.any((lengths < 1) | (lengths > s)):
            bad = int(np.argmax((lengths < 1) | (lengths > s)))
            raise SpecError(f"{ins.field(5)}[{bad}]", int(sk[bad]), f"a value in [0, {s - 1}] "
                            "(= total length - 1 <= S - 1) on a first prompt")
        past = np.zeros(b, np.int64)
        new_rows = lengths
        first = True
        if np.any(lengths < s):
            rows = lengths
            rules.append("right-padded first prompt: S_b = seqlens_k + 1 valid rows -> "
                         "seqlens_q (padding rows are 0)")
    else:
        past = lengths - s
        if np.any(past < 0) or np.any(past > pbuf) or np.any(lengths > total):
            bad = int(np.argmax((past < 0) | (past > pbuf) | (lengths > total)))
            raise SpecError(f"{ins.field(5)}[{bad}]", int(sk[bad]), f"a value with S={s} <= "
                            f"value + 1 <= total_sequence_length={total} and value + 1 - S <= "
                            f"past_key's length {pbuf}")
        new_rows = np.full(b, s, np.int64)
        first = False
    if node.attr("do_rotary", 0, int):
        cos, sin = ins.need(7, FLOATS, (2,)), ins.need(8, FLOATS, (2,))
        if cos.shape != sin.shape or cos.shape[1] * 2 > h or cos.dtype != query.dtype:
            raise SpecError(ins.field(7) + ".shape", cos.shape, f"[max_seq, rotary_dim/2] like "
                            f"sin_cache {sin.shape}, rotary_dim <= head_size={h}, dtype "
                            f"{query.dtype.name}")
        pos_ids = ins.get(9, ("int64",), (2,))
        if pos_ids is not None:
            if first:
                raise SpecError(ins.field(9), pos_ids, "absent on a first prompt (ORT reads only "
                                "its first element there; not mapped)")
            expect_shape(ins.field(9), pos_ids, (b, s), "[B, S]")
            pos = pos_ids
        else:
            pos = past[:, None] + np.arange(s)[None, :]
        valid = np.arange(s)[None, :] < new_rows[:, None]     # padding rows: never read
        if np.any(valid & ((pos < 0) | (pos >= cos.shape[0]))):
            raise SpecError(ins.field(7) + ".shape", cos.shape, f"more than "
                            f"{int(np.where(valid, pos, 0).max())} rows (one per position)")
        pos = np.where(valid, pos, 0)
        inter = bool(node.attr("rotary_interleaved", 0, int))
        q, kn = _rotary(q, pos, cos, sin, inter), _rotary(kn, pos, cos, sin, inter)
        rules.append("rotary applied on the host (float32 math, rounded like ORT)")
    else:
        for i in (7, 8, 9):
            ins.refuse(i, "absent unless do_rotary=1")
    kk = np.zeros((b, nkv, cap, h), query.dtype)
    vv = np.zeros((b, nkv, cap, h), query.dtype)
    for bi in range(b):
        p, m = int(past[bi]), int(new_rows[bi])
        if p:
            assert pk is not None and pv is not None
            kk[bi, :, :p], vv[bi, :, :p] = pk[bi, :, :p], pv[bi, :, :p]
        kk[bi, :, p: p + m] = kn[bi, :m].transpose(1, 0, 2)
        vv[bi, :, p: p + m] = vn[bi, :m].transpose(1, 0, 2)
    rules.append("present = past[:P_b] + the valid new K/V rows per batch entry (BNSH, capacity "
                 "max(total_sequence_length, past length); rows beyond seqlens_k + 1 are 0)")
    window = node.attr("local_window_size", -1, int)
    if causal not in (0, 1) or window < -1 or (window > 0 and not causal):
        raise SpecError("GroupQueryAttention.attribute['local_window_size']", window,
                        "-1 (off) or a positive window with causal=1")
    add = ins.get(10, FLOATS, (4,))
    if add is not None:
        if add.dtype != query.dtype or add.shape[3] != total or add.shape[2] != s:
            raise SpecError(ins.field(10) + ".shape", add.shape, f"[B or 1, Nq or 1, S={s}, "
                            f"total_sequence_length={total}] of {query.dtype.name}")
        if cap > total:
            add = np.concatenate([add, np.zeros((*add.shape[:3], cap - total), add.dtype)], 3)
    sink = ins.get(11, FLOATS, (1,))
    if sink is not None:
        expect_shape(ins.field(11), sink, (nq,), "one sink logit per query head")
        if sink.dtype not in (query.dtype, np.dtype(np.float32)):
            sink = sink.astype(np.float32)
        rules.append("head_sink input -> head_sink")
    elif node.attr("smooth_softmax", 0, int):
        sink = np.zeros(nq, np.float32)
        rules.append("smooth_softmax -> an all-zero head_sink")
    present = (kk, vv) if node.wants(1) or node.wants(2) else None
    return build("GroupQueryAttention", node, q, "BSNH", kk, vv, "BNSH", output_shape=(b, s, nq * h),
                 scale=_scale(node), softcap=_softcap(node), lengths=lengths, q_lens=rows,
                 offsets=(lengths - (s if rows is None else rows)) if causal else None,
                 window=window, add=add, sink=sink, present=present, idle=idle, rules=rules)


def map_mha(node: Node, ins: Inputs) -> tuple[AttentionSpec, NodeRun]:
    node.check_attrs(("num_heads", "unidirectional", "scale", "mask_filter_value"))
    _no_qk(node, "", "qk")
    ins.refuse(8, "absent: ORT's shared past/present buffer mode (past_sequence_length) is not "
               "mapped")
    ins.refuse(9, "absent: beam-search cache_indirection is not mapped")
    n = node.attr("num_heads", 0, int)
    if n <= 0:
        raise SpecError("MultiHeadAttention.attribute['num_heads']", node.attrs.get("num_heads"),
                        "a positive head count")
    rules: list[str] = []
    query = ins.need(0, FLOATS, (3, 5))
    key, value = ins.get(1, FLOATS, (3, 4, 5)), ins.get(2, FLOATS, (3, 4))
    proj = ins.get(3, FLOATS, (1,))
    b, s = query.shape[:2]
    cross_bnsh = False
    if query.ndim == 5:
        if key is not None or value is not None or query.shape[2:4] != (n, 3):
            raise SpecError(ins.field(0) + ".shape", query.shape, f"[B, S, N={n}, 3, H] packed "
                            "QKV without key and value, or [B, S, N*H]")
        q, kn, vn = query[:, :, :, 0], query[:, :, :, 1], query[:, :, :, 2]
    elif key is not None and key.ndim == 5:
        if value is not None or key.shape[2:4] != (n, 2):
            raise SpecError(ins.field(1) + ".shape", key.shape, f"[B, T, N={n}, 2, H] packed KV "
                            "without value")
        q, kn, vn = heads(ins.field(0), query, n), key[:, :, :, 0], key[:, :, :, 1]
    elif key is not None and value is not None and key.ndim == value.ndim:
        q = heads(ins.field(0), query, n)
        if key.ndim == 4:
            cross_bnsh = True
            kn, vn = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
            rules.append("4-D key/value: BNSH cross-attention K/V, used as they are")
        else:
            kn, vn = heads(ins.field(1), key, n), heads(ins.field(2), value, n)
    else:
        raise SpecError(ins.field(1), key, "key and value of the same rank (3-D or 4-D BNSH), a "
                        "packed KV key, or neither with a packed QKV query")
    h, hv = q.shape[3], vn.shape[3]
    t_new = kn.shape[1]
    expect_shape(ins.field(1), kn, (b, t_new, n, h), "batch, heads and head size of the query")
    expect_shape(ins.field(2), vn, (b, t_new, n, hv), "batch, heads and length of the key")
    if hv != h and (cross_bnsh or ins.get(6) is not None):
        raise SpecError(ins.field(2) + ".shape", value.shape if value is not None else None,
                        f"V's head size equal to K's ({h}) with " + ("4-D (BNSH) key/value"
                        if cross_bnsh else "past_key/past_value") + ": ORT's op defines those "
                        "with one head_size (its CPU EP refuses a different one); a 3-D value "
                        "[B, T, N*Hv] without a past may have its own head size")
    if proj is not None:
        d = n * h
        if cross_bnsh or proj.shape != (2 * d + n * hv,) or proj.dtype != query.dtype:
            raise SpecError(ins.field(3), proj, f"[{2 * d + n * hv}] of {query.dtype.name} (q, "
                            "k, v projection bias), with 3-D or packed key/value")
        q = q + proj[:d].reshape(n, h)
        kn, vn = kn + proj[d: 2 * d].reshape(n, h), vn + proj[2 * d:].reshape(n, hv)
        rules.append("projection bias added on the host")
    pk, pv = _past(ins, 6, b, n, h, query.dtype)
    if cross_bnsh and pk is not None:
        raise SpecError(ins.field(6), pk, "absent with 4-D (BNSH) key/value")
    kk: np.ndarray
    vv: np.ndarray
    past = 0 if pk is None else pk.shape[2]
    if pk is not None or node.wants(1) or node.wants(2):
        kk, vv, kv_layout = concat_kv(pk, kn), concat_kv(pv, vn), "BNSH"
    elif cross_bnsh and key is not None and value is not None:
        kk, vv, kv_layout = key, value, "BNSH"
    else:
        kk, vv, kv_layout = kn, vn, "BSNH"
    total = past + t_new
    offsets = None
    if node.attr("unidirectional", 0, int):
        if t_new != s:
            raise SpecError("MultiHeadAttention.attribute['unidirectional']", 1, f"0 unless the "
                            f"new key length {t_new} equals the query length {s}: ORT's causal "
                            "mask for cross lengths is neither top-left nor bottom-right")
        offsets = np.full(b, past, np.int64)
    lengths = visible = None
    kpm = ins.get(4, ("int32",), (1, 2, 3))
    if kpm is not None:
        rules.append("key_padding_mask -> masked keys get -inf (ORT adds mask_filter_value)")
        if kpm.ndim == 1:
            expect_shape(ins.field(4), kpm, (b,), "[B] key lengths ([3B+2] is not mapped)")
            if np.any((kpm < 0) | (kpm > total)):
                raise SpecError(ins.field(4), kpm.tolist(), f"lengths in [0, {total}]")
            if offsets is None:
                lengths = kpm.astype(np.int64)
            else:
                visible = np.arange(total)[None, None, None, :] < kpm.reshape(b, 1, 1, 1)
        else:
            want = (b, total) if kpm.ndim == 2 else (b, s, total)
            expect_shape(ins.field(4), kpm, want, "[B, total] or [B, S, total] of 0/1")
            m = kpm != 0
            visible = m[:, None, None, :] if kpm.ndim == 2 else m[:, None, :, :]
    add = ins.get(5, FLOATS, (4,))
    if add is not None and (add.dtype != query.dtype or add.shape[2:] != (s, total)):
        raise SpecError(ins.field(5) + ".shape", add.shape, f"[B or 1, N or 1, S={s}, "
                        f"total={total}] of {query.dtype.name}")
    present = (kk, vv) if node.wants(1) or node.wants(2) else None
    return build("MultiHeadAttention", node, q, "BSNH", kk, vv, kv_layout,
                 output_shape=(b, s, n * hv), scale=_scale(node), softcap=0.0, lengths=lengths,
                 offsets=offsets, visible=visible, add=add, present=present, rules=rules)
