"""The float64 numpy reference: every formula of docs/contract.md, vectorised over batch and
heads.

Layout inside this module is canonical: q/out [B, Nq, S, H], k/v [B, Nkv, C, H]; queries
are grouped as [B, Nkv, G, S, H] so that GQA is a reshape, never a copy of K/V.

Non-finite inputs (docs/contract.md "Non-finite values and scalar fields"), with visibility
positional (key j is visible to row i by L_b, causality and the windows alone; a -inf bias masks
the key's logit but leaves it visible):
- what row i cannot see never changes it: invisible keys and values, their bias entries and
  memory past L_b are never multiplied (selected away, not weighted by 0: 0 * NaN = NaN);
- a non-finite q_i or k_j of a visible key, or a NaN / +inf logit (a NaN or +inf bias entry)
  makes row i's out all-NaN and its lse NaN;
- a non-finite v_j[d] of a visible key (whatever its weight, 0 included) makes out[.., d]
  NaN; lse is unaffected by v. Partial states follow the same rules per split.

Overflow (docs/contract.md "Overflow"): a visible score scale * q.k beyond float32's range
poisons its row like a non-finite q or k; after the bias, a logit beyond it is +inf (poison)
or -inf (masked), as float32 arithmetic makes it in the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .plan import SplitGeometry
from .quant import dequantize_kv
from .spec import F32_MAX, AttentionSpec
from .tensors import kv_starts, q_lengths, valid_lengths

# Rows per chunk are chosen so one chunk's score block stays under this many float64s.
_MAX_SCORE_ELEMS = 1 << 23


def alibi_slopes(num_heads: int, max_bias: float) -> np.ndarray:
    """slope_h for every query head (docs/contract.md "The math": n = 2**floor(log2(Nq)))."""
    n = 2 ** math.floor(math.log2(num_heads))
    m0 = 2.0 ** (-max_bias / n)
    m1 = 2.0 ** (-max_bias / 2.0 / n)
    h = np.arange(num_heads, dtype=np.float64)
    return np.where(h < n, m0 ** (h + 1), m1 ** (2 * (h - n) + 1))


def q_canonical(spec: AttentionSpec, q: np.ndarray) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    return q.transpose(0, 2, 1, 3) if spec.q_layout == "BSNH" else q


def kv_canonical(spec: AttentionSpec, k: np.ndarray,
                 block_table: np.ndarray | None = None) -> np.ndarray:
    """k or v as float64 [B, Nkv, C, H]; a paged pool is gathered through the block table
    (pages of unused table entries are not read: they may be -1)."""
    k = np.asarray(k, dtype=np.float64)
    if spec.kv_layout == "paged":
        assert block_table is not None and spec.page_size is not None
        ps, pages = spec.page_size, spec.pages_per_seq
        table = np.where((block_table >= 0) & (block_table < k.shape[0]), block_table, 0)
        # [B, pages, ps, Nkv, H] -> [B, Nkv, pages*ps, H], cut to C
        g = k[table.reshape(-1)].reshape(spec.batch, pages * ps, spec.kv_num_heads, -1)
        return g[:, : spec.capacity].transpose(0, 2, 1, 3)
    return k.transpose(0, 2, 1, 3) if spec.kv_layout == "BSNH" else k


def out_layout(spec: AttentionSpec, out: np.ndarray) -> np.ndarray:
    """[B, Nq, S, H] -> the spec's q_layout."""
    return out.transpose(0, 2, 1, 3) if spec.q_layout == "BSNH" else out


class _Problem:
    """Inputs brought to canonical float64 form once; logits computed per row chunk."""

    def __init__(self, spec: AttentionSpec, tensors: Mapping[str, np.ndarray]) -> None:
        self.spec = spec
        b, nkv, g = spec.batch, spec.kv_num_heads, spec.group_size
        s, c, h = spec.seq_len, spec.capacity, spec.head_size
        self.lengths = valid_lengths(spec, tensors)                         # [B]
        self.starts = kv_starts(spec, tensors)                              # [B]
        self.q_lens = q_lengths(spec, tensors)                              # [B]
        self.keys = np.arange(c)
        exists = (self.keys[None, :] < self.lengths[:, None]) \
            & (self.keys[None, :] >= self.starts[:, None])                  # [B, C]
        # rows past S_b are padding: their q may hold anything and is never read
        self.row_ok = np.arange(s)[None, :] < self.q_lens[:, None]          # [B, S]
        # Keys past L_b may hold anything: they are zeroed. Non-finite values that exist are
        # zeroed too and remembered, so that the matmuls stay finite and only the rows that
        # see them are poisoned (never through a weight of 0: 0 * NaN = NaN).
        table = tensors.get("block_table")
        k_in, v_in = tensors["k"], tensors["v"]
        if spec.kv_dtype is not None:
            # the contract's dequantization, on the stored codes (then the same math)
            k_in = dequantize_kv(k_in, tensors["k_scale"], spec.kv_dtype)
            v_in = dequantize_kv(v_in, tensors["v_scale"], spec.kv_dtype)
        k = np.where(exists[:, None, :, None], kv_canonical(spec, k_in, table), 0.0)
        v = np.where(exists[:, None, :, None], kv_canonical(spec, v_in, table), 0.0)
        q = q_canonical(spec, tensors["q"]).reshape(b, nkv, g, s, h)
        q = np.where(self.row_ok[:, None, None, :, None], q, 0.0)
        k_fin, v_fin, q_fin = np.isfinite(k), np.isfinite(v), np.isfinite(q)
        self.k = np.where(k_fin, k, 0.0)
        self.v = np.where(v_fin, v, 0.0)
        self.q = np.where(q_fin, q, 0.0)
        self.k_bad = np.asarray(~k_fin.all(axis=-1))                        # [B, Nkv, C]
        self.q_bad = np.asarray(~q_fin.all(axis=-1))                        # [B, Nkv, G, S]
        # [B, Nkv, C, H] as float (for visible @ v_bad), or None when v is all finite
        self.v_bad = None if v_fin.all() else (~v_fin).astype(np.float64)
        self.bias = None
        if spec.bias:
            bias = np.asarray(tensors["bias"], dtype=np.float64)
            bb, nb = bias.shape[:2]
            self.bias = bias.reshape(bb, nkv, g, bias.shape[2], c) if nb == spec.num_heads \
                else bias.reshape(bb, 1, 1, bias.shape[2], c)
        self.slopes = None
        if spec.alibi_max_bias > 0:
            self.slopes = alibi_slopes(spec.num_heads, spec.alibi_max_bias).reshape(1, nkv, g, 1, 1)
        self.sink = None
        if spec.head_sink:
            self.sink = np.asarray(tensors["head_sink"], dtype=np.float64).reshape(1, nkv, g, 1)

    def row_sink(self, rows: slice, shape: tuple[int, ...]) -> np.ndarray:
        """The sink logit per row of ``shape`` [B, Nkv, G, r]; -inf for padding rows (past
        S_b), which see nothing at all: out 0, lse -inf."""
        assert self.sink is not None
        sink = np.broadcast_to(self.sink, shape)
        return np.where(self.row_ok[:, None, None, rows], sink, -np.inf)

    def row_chunks(self) -> list[slice]:
        spec = self.spec
        per_row = spec.batch * spec.num_heads * spec.capacity
        step = max(1, _MAX_SCORE_ELEMS // max(per_row, 1))
        return [slice(r, min(r + step, spec.seq_len)) for r in range(0, spec.seq_len, step)]

    def logits(self, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        """(s_j, visible) for rows: s [B, Nkv, G, r, C] with invisible keys -inf and NaN
        where the row's q or the key's k is not finite; visible [B, 1, 1, r, C]."""
        spec = self.spec
        q = self.q[:, :, :, rows]
        b, n, g, r, h = q.shape
        # matmul, not einsum: BLAS keeps a 32-head, 8k-key decode well under a second.
        s = (q.reshape(b, n, g * r, h) @ self.k.swapaxes(-1, -2)).reshape(b, n, g, r, -1)
        s = s * spec.effective_scale
        # a score beyond float32's range poisons its row like a non-finite q or k
        # (docs/contract.md "Overflow"): kernels compute it in float32
        bad = self.q_bad[:, :, :, rows, None] | self.k_bad[:, :, None, None, :] \
            | (np.abs(s) > F32_MAX)
        if bad.any():
            s = np.where(bad, np.nan, s)
        with np.errstate(invalid="ignore"):
            if spec.softcap > 0:
                s = spec.softcap * np.tanh(s / spec.softcap)
            if self.bias is not None:
                bias = self.bias[:, :, :, rows] if self.bias.shape[3] > 1 else self.bias
                s = s + bias
        pos = (self.lengths[:, None] - self.q_lens[:, None]
               + np.arange(spec.seq_len)[rows][None, :])
        pos = pos[:, None, None, :, None]                                   # p_i, [B,1,1,r,1]
        j = self.keys[None, None, None, None, :]
        if self.slopes is not None:
            s = s + self.slopes * (j - pos)
        if self.bias is not None:         # a logit past float32's range is +inf or -inf there
            with np.errstate(invalid="ignore"):
                s = np.where(np.abs(s) > F32_MAX, np.copysign(np.inf, s), s)
        visible = (j < self.lengths[:, None, None, None, None]) \
            & (j >= self.starts[:, None, None, None, None]) \
            & self.row_ok[:, None, None, rows, None]
        visible = within_reach(spec, visible, j, pos)
        return np.where(visible, s, -np.inf), visible


def within_reach(spec: AttentionSpec, visible: np.ndarray, j: np.ndarray, pos: np.ndarray
                 ) -> np.ndarray:
    """``visible`` and key j within reach of the row at position ``pos``: the causal frontier
    j <= pos, the window j > pos - local_window, the right window j - pos <= right_window
    (docs/contract.md "The math", "Every head size, two-sided windows")."""
    if spec.causal:
        visible = visible & (j <= pos)
    if spec.local_window > 0:
        visible = visible & (j > pos - spec.local_window)
    if spec.right_window >= 0:
        visible = visible & (j - pos <= spec.right_window)
    return visible


def _weights(logits: np.ndarray, extra: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """exp(logits - M) over the last axis, M the row's largest logit or ``extra`` (0 where
    that is not finite); returns (the weights, their sum plus exp(extra - M), M)."""
    m = logits.max(axis=-1)
    if extra is not None:
        m = np.maximum(m, extra)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(logits - m_safe[..., None])
    total = w.sum(axis=-1)
    if extra is not None:
        total = total + np.exp(extra - m_safe)
    return w, total, m_safe


def _softmax_pv(s: np.ndarray, v: np.ndarray, extra: np.ndarray | None,
                spec_in: str, spec_out: str, visible: np.ndarray | None = None,
                v_bad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the last axis of s (plus an optional extra logit in the denominator)
    and the weighted sum of v. Rows with nothing visible give o = 0, lse = -inf. A NaN or
    +inf logit makes its row's o and lse NaN; where a visible key's v is not finite
    (``v_bad``, 1.0 there, with v itself zeroed) o is NaN in that component."""
    poison = np.isnan(s) | np.isposinf(s)
    row_bad = poison.any(axis=-1)
    if row_bad.any():
        s = np.where(poison, -np.inf, s)
    p, l, m_safe = _weights(s, extra)
    o = np.einsum(f"{spec_in},{spec_out}", p, v)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where((l > 0)[..., None], o / np.where(l > 0, l, 1.0)[..., None], 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    if v_bad is not None and visible is not None:
        # rows x components that see a non-finite v: (visible as 0/1) @ (v non-finite as 0/1)
        vis = np.broadcast_to(visible, s.shape).astype(np.float64)
        o = np.where(np.einsum(f"{spec_in},{spec_out}", vis, v_bad) > 0, np.nan, o)
    if row_bad.any():
        o = np.where(row_bad[..., None], np.nan, o)
        lse = np.where(row_bad, np.nan, lse)
    return o, lse


def attention(spec: AttentionSpec, tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Full attention. Returns (out [B, Nq, S, H], lse [B, Nq, S]) in float64, canonical layout.

    ``tensors`` must already be validated (``attnreg.tensors.check_tensors``).
    """
    p = _Problem(spec, tensors)
    b, nq, s, h = spec.batch, spec.num_heads, spec.seq_len, spec.head_size_v
    out = np.empty((b, nq, s, h))
    lse = np.empty((b, nq, s))
    for rows in p.row_chunks():
        logits, visible = p.logits(rows)
        extra = None if p.sink is None else p.row_sink(rows, logits.shape[:-1])
        o, l = _softmax_pv(logits, p.v, extra, "bngrj", "bnjh->bngrh", visible, p.v_bad)
        r = o.shape[3]
        out[:, :, rows] = o.reshape(b, nq, r, h)
        lse[:, :, rows] = l.reshape(b, nq, r)
    return out, lse


def n_splits(spec: AttentionSpec, split_size: int) -> int:
    return SplitGeometry.over(spec.capacity, split_size).n_splits


def partial_states(spec: AttentionSpec, tensors: Mapping[str, np.ndarray],
                   split_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Split-KV partial states: (o_t [B, Nq, S, T, H], lse_t [B, Nq, S, T]) in float64.

    Split t covers keys [t*split_size, (t+1)*split_size) of [0, C); the sink is left to
    the reduce. A split with no visible key has o_t = 0, lse_t = -inf.
    """
    p = _Problem(spec, tensors)
    b, nq, s, h, c = spec.batch, spec.num_heads, spec.seq_len, spec.head_size_v, spec.capacity
    nkv, g = spec.kv_num_heads, spec.group_size
    t = n_splits(spec, split_size)
    pad = t * split_size - c
    pad_kv = ((0, 0), (0, 0), (0, pad), (0, 0))
    v = np.pad(p.v, pad_kv).reshape(b, nkv, t, split_size, h)
    v_bad = None if p.v_bad is None else np.pad(p.v_bad, pad_kv).reshape(b, nkv, t, split_size, h)
    o_parts = np.empty((b, nq, s, t, h))
    lse_parts = np.empty((b, nq, s, t))
    for rows in p.row_chunks():
        logits, visible = p.logits(rows)
        r = logits.shape[3]
        logits = np.pad(logits, ((0, 0),) * 4 + ((0, pad),), constant_values=-np.inf)
        logits = logits.reshape(b, nkv, g, r, t, split_size)
        visible = np.broadcast_to(visible, (b, 1, 1, r, c))
        visible = np.pad(visible, ((0, 0),) * 4 + ((0, pad),)).reshape(b, 1, 1, r, t, split_size)
        o, l = _softmax_pv(logits, v, None, "bngrtj", "bntjh->bngrth", visible, v_bad)
        o_parts[:, :, rows] = o.reshape(b, nq, r, t, h)
        lse_parts[:, :, rows] = l.reshape(b, nq, r, t)
    return o_parts, lse_parts


def combine(o_parts: np.ndarray, lse_parts: np.ndarray,
            sink: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The split-KV reduce: o_parts [..., T, H], lse_parts [..., T], sink broadcastable to
    [...]. Returns (out [..., H], lse [...]) in float64. A split whose lse_t is -inf adds
    nothing, whatever its o_t holds (no NaN from it); every other split's o_t is multiplied
    by its weight, 0 included, so a NaN or inf in it reaches out (as NaN). A NaN or +inf
    lse_t makes the row's out and lse NaN."""
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    o_parts = np.asarray(o_parts, dtype=np.float64)
    poison = np.isnan(lse_parts) | np.isposinf(lse_parts)
    row_bad = poison.any(axis=-1)
    empty = np.isneginf(lse_parts) | poison
    lse_parts = np.where(poison, -np.inf, lse_parts)
    w, den, m_safe = _weights(lse_parts, sink)
    with np.errstate(invalid="ignore", over="ignore"):
        num = np.where(empty[..., None], 0.0, w[..., None] * o_parts).sum(axis=-2)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where((den > 0)[..., None], num / np.where(den > 0, den, 1.0)[..., None], 0.0)
        lse = np.where(den > 0, m_safe + np.log(np.where(den > 0, den, 1.0)), -np.inf)
    out = np.where(np.isfinite(out), out, np.nan)           # an inf in o_t: NaN, as kernels
    out = np.where(row_bad[..., None], np.nan, out)
    return out, np.where(row_bad, np.nan, lse)


def reduce(spec: AttentionSpec, o_parts: np.ndarray, lse_parts: np.ndarray,
           head_sink: np.ndarray | None = None, seqlens_q: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The reduce of partial states (docs/contract.md "Split-KV partial states and merging") into
    (out [B, Nq, S, Hv], lse [B, Nq, S]). Padding rows (i >= seqlens_q[b]) get no sink: out 0, lse
    -inf (their partials are all empty)."""
    sink = None
    if head_sink is not None:
        sink = np.broadcast_to(np.asarray(head_sink, np.float64)[None, :, None],
                               (spec.batch, spec.num_heads, spec.seq_len))
        if seqlens_q is not None:
            pad = np.arange(spec.seq_len)[None, None, :] >= np.asarray(seqlens_q)[:, None, None]
            sink = np.where(pad, -np.inf, sink)
    return combine(o_parts, lse_parts, sink)


def merge(states: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """merge_states in float64: stack the pairs as splits and reduce them (no sink)."""
    o = np.stack([np.asarray(s[0], np.float64) for s in states], axis=-2)
    lse = np.stack([np.asarray(s[1], np.float64) for s in states], axis=-1)
    return combine(o, lse)
