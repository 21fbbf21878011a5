"""ONNX Attention and com.microsoft MultiHeadAttention mapped onto attnreg, and the helpers the
three ops share (GroupQueryAttention: _onnx_gqa.py; rules: attnreg.integrations.onnx)."""

from __future__ import annotations

import numpy as np

from ..errors import SpecError
from ..spec import AttentionSpec
from ._onnx_common import FLOATS, Inputs, Node, NodeRun, build, concat_kv, expect_shape, heads

ATTENTION_IN = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
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


def _no_qk(node: Node, attr: str, out_name: str, modes: int = 1) -> None:
    """Refuse the score-matrix output; ``attr`` selects what that output would hold (modes
    0 .. modes-1 are the op's), which, with no such output asked for, changes nothing."""
    if node.wants(3):
        raise SpecError(f"{node.op}.output[3]", node.outputs[3], f"no {out_name} output: attnreg "
                        "never materialises the score matrix, so it cannot produce it")
    if attr and not 0 <= node.attr(attr, 0, int) < modes:
        raise SpecError(f"{node.op}.attribute[{attr!r}]", node.attrs[attr],
                        "0 (the default)" if modes == 1 else
                        f"one of 0..{modes - 1} (what the {out_name} output would hold)")


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


def _windows(node: Node, keys: int, rows: int) -> tuple[int, int]:
    """Opset 25's ``left_window_size`` / ``right_window_size`` as attnreg's (local_window,
    right_window). ONNX: a row at position p sees p - left <= j <= p + right (-1: that side
    unbounded), so its own key is not counted in ``left``; attnreg's local_window W sees
    j > p - W, W keys ending at the row's own: W = left + 1 (left 0: the row's own key
    only). right_window = right. A bound no key can reach (|j - p| < keys + rows for every
    key and position) is no bound: -1."""
    out = []
    for name in ("left_window_size", "right_window_size"):
        size = node.attr(name, -1, int)
        if size < -1:
            raise SpecError(f"Attention.attribute[{name!r}]", size, "-1 (that side unbounded) "
                            "or an integer >= 0 (opset 25)")
        out.append(-1 if size < 0 or size >= keys + rows else size)
    left, right = out
    return (left + 1 if left >= 0 else -1), right


def _attention_heads(node: Node, ins: Inputs, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     rules: list[str]) -> tuple[np.ndarray, str, np.ndarray, np.ndarray]:
    """Attention's Q as given (3-D: a BSNH view by q_num_heads; 4-D: BNSH) and the new K, V
    as [B, T, N, H] views."""
    if not q.ndim == k.ndim == v.ndim:
        raise SpecError(ins.field(1) + ".shape", k.shape, f"{q.ndim} dims like Q (and V)")
    if q.ndim == 4:
        return q, "BNSH", k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    nq, nkv = node.attr("q_num_heads", 0, int), node.attr("kv_num_heads", 0, int)
    for name, val in (("q_num_heads", nq), ("kv_num_heads", nkv)):
        if val <= 0:
            raise SpecError(f"Attention.attribute[{name!r}]", node.attrs.get(name),
                            "a positive head count (required with 3-D Q, K, V)")
    rules.append("3-D Q [B, S, Nq*H] -> q_layout BSNH (a view)")
    return (heads(ins.field(0), q, nq), "BSNH", heads(ins.field(1), k, nkv),
            heads(ins.field(2), v, nkv))


def _attention_mask(ins: Inputs, dtype: np.dtype, total: int, rules: list[str]
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """attn_mask as (visible, add): a bool mask (True = attend), widened to ``total`` keys
    with False, or a float mask (float32 or the query's ``dtype``) added to the scores."""
    visible: np.ndarray | None = None
    add: np.ndarray | None = None
    mask = ins.get(3)
    if mask is None:
        return None, None
    if mask.dtype == np.bool_:
        visible = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        rules.append("bool attn_mask -> -inf bias where False")
    elif mask.dtype.name in FLOATS:
        if mask.dtype not in (dtype, np.dtype(np.float32)):
            raise SpecError(ins.field(3) + ".dtype", mask.dtype.name, f"bool, float32 or "
                            f"{dtype.name}")
        add = mask
        rules.append("float attn_mask -> bias (added)")
    else:
        raise SpecError(ins.field(3) + ".dtype", mask.dtype.name, "bool (True = attend) or "
                        "a float mask added to the scores")
    if not 1 <= mask.ndim <= 4 or mask.shape[-1] > total:
        raise SpecError(ins.field(3) + ".shape", mask.shape, "1 to 4 dims broadcastable to "
                        f"[B, Nq, S, total={total}] (a shorter last dim is padded with -inf)")
    if visible is not None and visible.shape[3] < total:
        widths = [(0, 0)] * 3 + [(0, total - visible.shape[3])]
        visible = np.pad(visible, widths, constant_values=False)
    return visible, add


def map_attention(node: Node, ins: Inputs) -> tuple[AttentionSpec, NodeRun]:
    node.check_attrs(("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode",
                      "scale", "softcap", "softmax_precision", "left_window_size",
                      "right_window_size"))
    # ONNX: the qk_matmul_output mode picks the scores before / after mask, softcap, softmax
    _no_qk(node, "qk_matmul_output_mode", "qk_matmul_output", modes=4)
    node.attr("softmax_precision", 1, int)   # attnreg's softmax is float32 or better anyway
    rules: list[str] = []
    q = ins.need(0, FLOATS, (3, 4))
    k, v = ins.need(1, FLOATS, (3, 4)), ins.need(2, FLOATS, (3, 4))
    q4, q_layout, kn, vn = _attention_heads(node, ins, q, k, v, rules)
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
    causal = bool(node.attr("is_causal", 0, int))
    window, right = _windows(node, total, s)
    if causal and pk is not None and s == 1 and t_new > 1:
        raise SpecError("Attention.attribute['is_causal']", 1, "0, or one new key per query "
                        "row: with past_key, one query row and several new keys, ONNX says "
                        "row 0 sees keys j <= past while ORT 1.32 attends all keys, so the "
                        "node is ambiguous and refused")
    if causal or window > 0 or right >= 0:
        # row i's position p = i + offset: the causal frontier's and the windows' alike
        offsets = (lengths - s) if lengths is not None else np.full(b, past, np.int64)
    visible, add = _attention_mask(ins, q.dtype, total, rules)
    present = (kk, vv) if kv_layout == "BNSH" and (node.wants(1) or node.wants(2)) else None
    return build("Attention", node, q4, q_layout, kk, vv, kv_layout, output_shape=out_shape,
                 scale=_scale(node), softcap=_softcap(node), lengths=lengths, offsets=offsets,
                 causal=causal, window=window, right_window=right, visible=visible, add=add,
                 present=present, rules=rules)


def _mha_qkv(ins: Inputs, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None,
             n: int, rules: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """MultiHeadAttention's Q, K and V as [B, S|T, N, H] views: packed QKV, packed KV, 3-D
    key / value, or 4-D BNSH cross-attention key / value (the last value: that case)."""
    if query.ndim == 5:
        if key is not None or value is not None or query.shape[2:4] != (n, 3):
            raise SpecError(ins.field(0) + ".shape", query.shape, f"[B, S, N={n}, 3, H] packed "
                            "QKV without key and value, or [B, S, N*H]")
        return query[:, :, :, 0], query[:, :, :, 1], query[:, :, :, 2], False
    if key is not None and key.ndim == 5:
        if value is not None or key.shape[2:4] != (n, 2):
            raise SpecError(ins.field(1) + ".shape", key.shape, f"[B, T, N={n}, 2, H] packed KV "
                            "without value")
        return heads(ins.field(0), query, n), key[:, :, :, 0], key[:, :, :, 1], False
    if key is None or value is None or key.ndim != value.ndim:
        raise SpecError(ins.field(1), key, "key and value of the same rank (3-D or 4-D BNSH), a "
                        "packed KV key, or neither with a packed QKV query")
    q = heads(ins.field(0), query, n)
    if key.ndim == 4:
        rules.append("4-D key/value: BNSH cross-attention K/V, used as they are")
        return q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3), True
    return q, heads(ins.field(1), key, n), heads(ins.field(2), value, n), False


def _add_projection_bias(proj: np.ndarray, q: np.ndarray, kn: np.ndarray, vn: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q, K and V plus their slices of MultiHeadAttention's packed projection bias [q|k|v]."""
    n, h, hv = q.shape[2], q.shape[3], vn.shape[3]
    d = n * h
    return (q + proj[:d].reshape(n, h), kn + proj[d: 2 * d].reshape(n, h),
            vn + proj[2 * d:].reshape(n, hv))


def _key_padding(ins: Inputs, b: int, s: int, total: int, positioned: bool, rules: list[str]
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """key_padding_mask as (lengths, visible): [B] key lengths (a visibility mask when rows
    have positions, ``positioned``: unidirectional), or [B, total] / [B, S, total] of 0/1."""
    kpm = ins.get(4, ("int32",), (1, 2, 3))
    if kpm is None:
        return None, None
    rules.append("key_padding_mask -> masked keys get -inf (ORT adds mask_filter_value)")
    if kpm.ndim == 1:
        expect_shape(ins.field(4), kpm, (b,), "[B] key lengths ([3B+2] is not mapped)")
        if np.any((kpm < 0) | (kpm > total)):
            raise SpecError(ins.field(4), kpm.tolist(), f"lengths in [0, {total}]")
        if not positioned:
            return kpm.astype(np.int64), None
        return None, np.arange(total)[None, None, None, :] < kpm.reshape(b, 1, 1, 1)
    want = (b, total) if kpm.ndim == 2 else (b, s, total)
    expect_shape(ins.field(4), kpm, want, "[B, total] or [B, S, total] of 0/1")
    m = kpm != 0
    return None, (m[:, None, None, :] if kpm.ndim == 2 else m[:, None, :, :])


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
    q, kn, vn, cross_bnsh = _mha_qkv(ins, query, key, value, n, rules)
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
        if cross_bnsh or proj.shape != (n * (2 * h + hv),) or proj.dtype != query.dtype:
            raise SpecError(ins.field(3), proj, f"[{n * (2 * h + hv)}] of {query.dtype.name} (q, "
                            "k, v projection bias), with 3-D or packed key/value")
        q, kn, vn = _add_projection_bias(proj, q, kn, vn)
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
    lengths, visible = _key_padding(ins, b, s, total, offsets is not None, rules)
    add = ins.get(5, FLOATS, (4,))
    if add is not None and (add.dtype != query.dtype or add.shape[2:] != (s, total)):
        raise SpecError(ins.field(5) + ".shape", add.shape, f"[B or 1, N or 1, S={s}, "
                        f"total={total}] of {query.dtype.name}")
    present = (kk, vv) if node.wants(1) or node.wants(2) else None
    return build("MultiHeadAttention", node, q, "BSNH", kk, vv, kv_layout,
                 output_shape=(b, s, n * hv), scale=_scale(node), softcap=0.0, lengths=lengths,
                 offsets=offsets, visible=visible, add=add, present=present, rules=rules)
