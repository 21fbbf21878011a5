"""Inputs and checks for conformance: random tensors with poisoned tails, and the contract's
tolerance test against the float64 reference. Used by `attnreg conformance` and the tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import reference as ref
from ..kernel import LSE_ATOL, TOLERANCE
from ..spec import AttentionSpec
from ..tensors import valid_lengths


def make_tensors(spec: AttentionSpec, seed: int = 0, *, lengths: Any = None,
                 bias_shape: tuple[int, ...] | None = None, mask_frac: float = 0.0,
                 poison: bool = True) -> dict[str, np.ndarray]:
    """Random inputs for spec. Keys past each batch's valid length are NaN (poison), so a
    kernel that reads them fails. ``mask_frac`` puts -inf into that fraction of the bias."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(spec.dtype)
    if spec.kv_layout == "paged":
        return _paged(spec, rng, lengths=lengths, bias_shape=bias_shape, mask_frac=mask_frac,
                      poison=poison, seed=seed)
    t: dict[str, np.ndarray] = {
        "q": rng.standard_normal(spec.q_shape).astype(dt),
        "k": rng.standard_normal(spec.kv_shape).astype(dt),
        "v": rng.standard_normal(spec.kv_shape).astype(dt),
    }
    c = spec.capacity
    if spec.seqlens_k:
        if lengths is None:
            lengths = rng.integers(spec.seq_len, c + 1, size=spec.batch)
        t["seqlens_k"] = np.asarray(lengths, dtype=np.int32)
    if poison:
        for b, L in enumerate(valid_lengths(spec, t)):
            for name in ("k", "v"):
                if spec.kv_layout == "BSNH":
                    t[name][b, L:] = np.nan
                else:
                    t[name][b, :, L:] = np.nan
    if spec.bias:
        shape = bias_shape or (spec.batch, spec.num_heads, spec.seq_len, c)
        bias = rng.standard_normal(shape).astype(np.float32)
        if mask_frac > 0:
            bias[rng.random(shape) < mask_frac] = -np.inf
        t["bias"] = bias
    if spec.head_sink:
        t["head_sink"] = rng.standard_normal(spec.num_heads).astype(np.float32)
    return t


def _paged(spec: AttentionSpec, rng: np.random.Generator, *, seed: int, lengths: Any,
           bias_shape: tuple[int, ...] | None, mask_frac: float, poison: bool) -> dict[str, np.ndarray]:
    """A paged version of the same recipe: each sequence's used pages sit at shuffled pool
    positions; unused pages and table entries past a sequence's length are poison (NaN, -1)."""
    assert spec.page_size is not None and spec.num_pages is not None
    flat = spec.replace(kv_layout="BSNH", page_size=None, num_pages=None)
    t = make_tensors(flat, seed, lengths=lengths, bias_shape=bias_shape, mask_frac=mask_frac,
                     poison=poison)
    lens = valid_lengths(flat, t)
    ps, n_pages = spec.page_size, spec.num_pages
    used = [int(-(-L // ps)) for L in lens]
    if sum(used) > n_pages:
        raise ValueError(f"num_pages={n_pages} < {sum(used)} pages these lengths need")
    order = rng.permutation(n_pages)
    table = np.full(spec.block_table_shape, -1, np.int32)
    pool_k = np.full(spec.kv_shape, np.nan if poison else 0.0, spec.dtype)
    pool_v = pool_k.copy()
    nxt = 0
    for b in range(spec.batch):
        for p in range(used[b]):
            page = int(order[nxt])
            nxt += 1
            table[b, p] = page
            lo, hi = p * ps, min((p + 1) * ps, spec.capacity)
            pool_k[page, : hi - lo] = t["k"][b, lo:hi]
            pool_v[page, : hi - lo] = t["v"][b, lo:hi]
    t["k"], t["v"], t["block_table"] = pool_k, pool_v, table
    return t


def random_qkv(spec: AttentionSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Benchmark inputs: q, k, v of the spec's shapes and dtype, N(0, 0.25) so that softmax
    is neither one-hot nor flat."""
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(spec.dtype)
            for n, shape in (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}


def packed_docs(n_docs: int, doc_len: int, nq: int, nkv: int, h: int, dtype: str
                ) -> tuple[AttentionSpec, dict[str, np.ndarray]]:
    """n_docs sequences packed into one batch entry: causal, block-diagonal bias [1,1,S,S]."""
    s = n_docs * doc_len
    spec = AttentionSpec(batch=1, seq_len=s, past_len=0, num_heads=nq, kv_num_heads=nkv,
                         head_size=h, dtype=dtype, causal=True, bias=True)
    x = random_qkv(spec, seed=5)
    doc = np.arange(s) // doc_len
    x["bias"] = np.where(doc[:, None] == doc[None, :], 0.0, -np.inf).astype(np.float32)[None, None]
    return spec, x


def expected(spec: AttentionSpec, tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference in the spec's output layout: (out, lse)."""
    out, lse = ref.attention(spec, tensors)
    return ref.out_layout(spec, out), lse


def compare(spec: AttentionSpec, got: Any, want: tuple[np.ndarray, np.ndarray],
            tol: tuple[float, float] | None = None) -> tuple[float, str]:
    """(max abs error, problem text or '') of got (out, or (out, lse)) against want."""
    want_out, want_lse = want
    out, lse = got if spec.return_lse else (got, None)
    atol, rtol = tol or TOLERANCE[spec.dtype]
    if not isinstance(out, np.ndarray) or out.shape != want_out.shape:
        return float("inf"), f"out shape {getattr(out, 'shape', None)} != {want_out.shape}"
    if out.dtype != np.dtype(spec.dtype):
        return float("inf"), f"out dtype {out.dtype} != {spec.dtype}"
    o = out.astype(np.float64)
    if np.isnan(o).any():
        return float("inf"), f"{int(np.isnan(o).sum())} NaN in out"
    err = np.abs(o - want_out)
    worst = float(err.max()) if err.size else 0.0
    bad = err > atol + rtol * np.abs(want_out)
    if bad.any():
        at = np.unravel_index(int(np.argmax(err)), err.shape)
        return worst, (f"{int(bad.sum())}/{bad.size} values off, max err {worst:.3g} at {at} "
                       f"(atol={atol}, rtol={rtol})")
    if lse is not None:
        if lse.dtype != np.float32 or lse.shape != spec.lse_shape:
            return worst, f"lse {lse.dtype}{lse.shape} != float32{spec.lse_shape}"
        if not np.array_equal(np.isneginf(lse), np.isneginf(want_lse)):
            return worst, "-inf pattern of lse differs from the reference"
        fin = np.isfinite(want_lse)
        lerr = np.abs(lse[fin] - want_lse[fin])
        if lerr.size and lerr.max() > LSE_ATOL[spec.dtype]:
            return worst, f"lse err {lerr.max():.3g} > {LSE_ATOL[spec.dtype]}"
    return worst, ""


def compare_partials(spec: AttentionSpec, got: tuple[np.ndarray, np.ndarray],
                     want: tuple[np.ndarray, np.ndarray], tol: tuple[float, float]) -> tuple[float, str]:
    """Partial states against the reference's: same shapes, empty splits exact, values close."""
    (o, lse), (wo, wl) = got, want
    if o.shape != wo.shape or lse.shape != wl.shape or o.dtype != np.float32 or lse.dtype != np.float32:
        return float("inf"), f"partials {o.dtype}{o.shape}/{lse.dtype}{lse.shape} != float32{wo.shape}"
    if not np.array_equal(np.isneginf(lse), np.isneginf(wl)):
        return float("inf"), "-inf pattern of lse_parts differs (empty splits)"
    if np.isnan(o).any() or np.isnan(lse).any():
        return float("inf"), "NaN in partial states"
    empty = np.isneginf(wl)
    if (o[empty] != 0).any():
        return float("inf"), "o_parts of an empty split is not 0"
    atol, rtol = tol
    err = np.abs(o.astype(np.float64) - wo)
    worst = float(err.max()) if err.size else 0.0
    if (err > atol + rtol * np.abs(wo)).any():
        return worst, f"o_parts max err {worst:.3g}"
    fin = ~empty
    lerr = np.abs(lse[fin] - wl[fin])
    if lerr.size and lerr.max() > LSE_ATOL[spec.dtype]:
        return worst, f"lse_parts err {lerr.max():.3g}"
    return worst, ""


# A contract feature as an input recipe: (tag, spec changes, make_tensors keywords plus
# ``bias_f16`` / ``docs`` / ``doc_values``, whether query row 0 is fully masked).
Feature = tuple[str, dict[str, Any], dict[str, Any], bool]


def contract_features(b: int, nq: int, s: int, c: int) -> list[Feature]:
    """One case per CONTRACT feature for a backend's own case list: (tag, spec changes,
    make_tensors keywords (+ ``bias_f16``), whether query row 0 is fully masked). b, nq, s, c
    are the batch, query heads, query rows and KV capacity, for the broadcast bias shapes."""
    return [
        ("plain", {}, {}, False),
        ("noncausal", {"causal": False}, {}, False),
        ("bias", {"bias": True}, {}, False),
        ("bias-bcast-b", {"bias": True}, {"bias_shape": (1, nq, s, c)}, False),
        ("bias-bcast-h", {"bias": True}, {"bias_shape": (b, 1, s, c)}, False),
        ("bias-bcast-s", {"bias": True, "causal": False}, {"bias_shape": (b, nq, 1, c)}, False),
        ("bias-f16-masked", {"bias": True}, {"bias_f16": True, "mask_frac": 0.3}, False),
        ("masked-rows-lse", {"bias": True, "return_lse": True}, {}, True),
        ("seqlens-capacity", {"seqlens_k": True, "kv_capacity": c + 13}, {}, False),
        ("capacity", {"kv_capacity": c + 9}, {}, False),
        ("window", {"local_window": 5}, {}, False),
        ("softcap", {"softcap": 1.5}, {}, False),
        ("alibi", {"alibi_max_bias": 8.0}, {}, False),
        ("alibi-noncausal", {"alibi_max_bias": 8.0, "causal": False}, {}, False),
        ("sink-lse", {"head_sink": True, "return_lse": True}, {}, False),
        ("sink-masked-rows", {"head_sink": True, "bias": True, "return_lse": True}, {}, True),
        ("all", {"seqlens_k": True, "kv_capacity": c + 5, "softcap": 3.0, "alibi_max_bias": 4.0,
                 "local_window": 37, "head_sink": True, "return_lse": True, "bias": True},
         {"bias_shape": (1, nq, s, c + 5)}, False),
    ]


def document_features(b: int, nq: int, s: int, c: int) -> list[Feature]:
    """What a block-skipping kernel runs (it needs a bias): the bias features of
    contract_features, plus document masks (block-diagonal biases that leave whole KV blocks
    -inf, see doc_mask) with a shared zero bias, per-head values, and everything at once."""
    return [f for f in contract_features(b, nq, s, c) if f[1].get("bias")] + [
        ("docs-shared-zero", {"bias": True}, {"docs": 3, "bias_shape": (1, 1, s, c)}, False),
        ("docs-heads", {"bias": True, "causal": False}, {"docs": 4, "doc_values": True}, False),
        ("docs-everything", {"seqlens_k": True, "kv_capacity": c + 5, "softcap": 3.0,
                             "alibi_max_bias": 4.0, "head_sink": True, "return_lse": True,
                             "bias": True},
         {"docs": 2, "doc_values": True, "bias_shape": (1, nq, s, c + 5)}, False),
    ]


def doc_mask(spec: AttentionSpec, bias: np.ndarray, docs: int, keep_values: bool) -> np.ndarray:
    """A block-diagonal bias (packed sequences): query row i sees key j only if both lie in
    the same of ``docs`` equal documents of the key range; inside a document the bias is 0
    (or keeps its values), across documents -inf."""
    c = bias.shape[3]
    rows = spec.total_len - spec.seq_len + np.arange(bias.shape[2])
    same = (rows[:, None] * docs // c) == (np.arange(c)[None, :] * docs // c)
    inside = bias if keep_values else np.zeros_like(bias)
    return np.where(same[None, None], inside, -np.inf).astype(bias.dtype)
