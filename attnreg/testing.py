"""Inputs and checks for conformance: random tensors with poisoned tails, non-finite values
planted where some rows see them and others do not, and the contract's tolerance test
against the float64 reference. Used by `attnreg conformance`, the tests and backends that
check themselves (the browser's export --check): it imports only the core."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import reference as ref
from .kernel import LSE_ATOL, TOLERANCE
from .quant import quantize_kv
from .spec import F32_MAX, AttentionSpec
from .tensors import kv_starts, q_lengths, valid_lengths


def make_tensors(spec: AttentionSpec, seed: int = 0, *, lengths: Any = None,
                 bias_shape: tuple[int, ...] | None = None, mask_frac: float = 0.0,
                 poison: bool = True, starts: Any = None, q_lens: Any = None
                 ) -> dict[str, np.ndarray]:
    """Random inputs for spec. Keys past each batch's valid length (and before its kv_start)
    are NaN (poison), so a kernel that reads them fails; so are the q rows past a batch's
    seqlens_q. ``mask_frac`` puts -inf into that fraction of the bias. ``lengths``,
    ``starts`` and ``q_lens`` fix seqlens_k, kv_start and seqlens_q (else drawn: see
    _model_rows)."""
    if spec.kv_dtype is not None:
        return _quantized(spec, make_tensors(spec.replace(kv_dtype=None), seed, lengths=lengths,
                                             bias_shape=bias_shape, mask_frac=mask_frac,
                                             poison=poison, starts=starts, q_lens=q_lens))
    rng = np.random.default_rng(seed)
    dt = np.dtype(spec.dtype)
    if spec.kv_layout == "paged":
        return _paged(spec, rng, lengths=lengths, bias_shape=bias_shape, mask_frac=mask_frac,
                      poison=poison, seed=seed, starts=starts, q_lens=q_lens)
    t: dict[str, np.ndarray] = {
        "q": rng.standard_normal(spec.q_shape).astype(dt),
        "k": rng.standard_normal(spec.kv_shape).astype(dt),
        "v": rng.standard_normal(spec.v_shape).astype(dt),
    }
    c = spec.capacity
    if spec.seqlens_k:
        if lengths is None:
            lo = 1 if spec.seqlens_q else spec.seq_len
            lengths = rng.integers(lo, c + 1, size=spec.batch)
            lengths[0] = max(lengths[0], min(spec.seq_len, c))
        t["seqlens_k"] = np.asarray(lengths, dtype=np.int32)
    _model_rows(spec, t, rng, starts, q_lens)
    if poison:
        first = kv_starts(spec, t)
        for b, L in enumerate(valid_lengths(spec, t)):
            for name in ("k", "v"):
                if spec.kv_layout == "BSNH":
                    t[name][b, L:] = np.nan
                    t[name][b, : first[b]] = np.nan
                else:
                    t[name][b, :, L:] = np.nan
                    t[name][b, :, : first[b]] = np.nan
        for b, n in enumerate(q_lengths(spec, t)):
            if spec.q_layout == "BSNH":
                t["q"][b, n:] = np.nan
            else:
                t["q"][b, :, n:] = np.nan
    if spec.bias:
        shape = bias_shape or (spec.batch, spec.num_heads, spec.seq_len, c)
        bias = rng.standard_normal(shape).astype(np.float32)
        if mask_frac > 0:
            bias[rng.random(shape) < mask_frac] = -np.inf
        t["bias"] = bias
    if spec.head_sink:
        t["head_sink"] = rng.standard_normal(spec.num_heads).astype(np.float32)
    return t


def _model_rows(spec: AttentionSpec, t: dict[str, np.ndarray], rng: np.random.Generator,
                starts: Any, q_lens: Any) -> None:
    """kv_start and seqlens_q tensors (given, or drawn): batch 0 keeps every row and a third
    of its keys left-padded, the last batch about half its rows; the rest at random."""
    lens = valid_lengths(spec, t)
    if spec.seqlens_q:
        if q_lens is None:
            top = np.minimum(spec.seq_len, lens)
            q_lens = rng.integers(1, top + 1)
            q_lens[0] = top[0]
            if spec.batch > 1:
                q_lens[-1] = max(1, min(int(top[-1]), (spec.seq_len + 1) // 2))
        t["seqlens_q"] = np.asarray(q_lens, dtype=np.int32)
    if spec.kv_start:
        if starts is None:
            starts = rng.integers(0, lens)
            starts[0] = lens[0] // 3
            if spec.batch > 1:
                starts[-1] = 0
        t["kv_start"] = np.asarray(starts, dtype=np.int32)


def _paged(spec: AttentionSpec, rng: np.random.Generator, *, seed: int, lengths: Any,
           bias_shape: tuple[int, ...] | None, mask_frac: float, poison: bool,
           starts: Any = None, q_lens: Any = None) -> dict[str, np.ndarray]:
    """A paged version of the same recipe: each sequence's used pages sit at shuffled pool
    positions; unused pages and table entries past a sequence's length are poison (NaN, -1)."""
    assert spec.page_size is not None and spec.num_pages is not None
    flat = spec.replace(kv_layout="BSNH", page_size=None, num_pages=None)
    t = make_tensors(flat, seed, lengths=lengths, bias_shape=bias_shape, mask_frac=mask_frac,
                     poison=poison, starts=starts, q_lens=q_lens)
    lens = valid_lengths(flat, t)
    ps, n_pages = spec.page_size, spec.num_pages
    used = [int(-(-L // ps)) for L in lens]
    if sum(used) > n_pages:
        raise ValueError(f"num_pages={n_pages} < {sum(used)} pages these lengths need")
    order = rng.permutation(n_pages)
    table = np.full(spec.block_table_shape, -1, np.int32)
    pool_k = np.full(spec.kv_shape, np.nan if poison else 0.0, spec.dtype)
    pool_v = np.full(spec.v_shape, np.nan if poison else 0.0, spec.dtype)
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


def _quantized(spec: AttentionSpec, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float recipe's k and v quantized (attnreg.quantize_kv); a vector the recipe
    poisons (past its sequence's length, unused pages) keeps its codes but gets NaN scales,
    so a kernel that reads it dequantizes NaN."""
    assert spec.kv_dtype is not None
    for name in ("k", "v"):
        x = t[name]
        bad = np.isnan(x).any(axis=-1)
        codes, scales = quantize_kv(np.where(np.isnan(x), 0.0, x), spec.kv_dtype)
        scales[bad] = np.nan
        t[name], t[f"{name}_scale"] = codes, scales
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


def _nan_pattern(what: str, got: np.ndarray, want: np.ndarray) -> str:
    """'' if got is NaN exactly where want is, else what differs (counts, a first index)."""
    g, w = np.isnan(got), np.isnan(want)
    if np.array_equal(g, w):
        return ""
    missing, extra = w & ~g, g & ~w
    parts = []
    if missing.any():
        at = tuple(int(x) for x in np.argwhere(missing)[0])
        parts.append(f"{int(missing.sum())} expected NaN missing (first at {at}, got "
                     f"{got[at]!r})")
    if extra.any():
        at = tuple(int(x) for x in np.argwhere(extra)[0])
        parts.append(f"{int(extra.sum())} unexpected NaN (first at {at})")
    return f"{what}: " + ", ".join(parts)


def compare(spec: AttentionSpec, got: Any, want: tuple[np.ndarray, np.ndarray],
            tol: tuple[float, float] | None = None) -> tuple[float, str]:
    """(max abs error, problem text or '') of got (out, or (out, lse)) against want. NaN
    must appear exactly where the reference has it (nowhere, for finite inputs); the other
    values must be within tolerance."""
    want_out, want_lse = want
    out, lse = got if spec.return_lse else (got, None)
    atol, rtol = tol or TOLERANCE[spec.dtype]
    if not isinstance(out, np.ndarray) or out.shape != want_out.shape:
        return float("inf"), f"out shape {getattr(out, 'shape', None)} != {want_out.shape}"
    if out.dtype != np.dtype(spec.dtype):
        return float("inf"), f"out dtype {out.dtype} != {spec.dtype}"
    o = out.astype(np.float64)
    if not np.isnan(want_out).any() and np.isnan(o).any():
        return float("inf"), f"{int(np.isnan(o).sum())} NaN in out"
    problem = _nan_pattern("out", o, want_out)
    if problem:
        return float("inf"), problem
    fin = ~np.isnan(want_out)
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(o - np.where(fin, want_out, 0.0)), 0.0)
    worst = float(err.max()) if err.size else 0.0
    bad = fin & ~(err <= atol + rtol * np.abs(np.where(fin, want_out, 0.0)))
    if bad.any():
        at = np.unravel_index(int(np.argmax(np.where(bad, err, -1.0))), err.shape)
        return worst, (f"{int(bad.sum())}/{bad.size} values off, max err {worst:.3g} at {at} "
                       f"(atol={atol}, rtol={rtol})")
    if lse is not None:
        if lse.dtype != np.float32 or lse.shape != spec.lse_shape:
            return worst, f"lse {lse.dtype}{lse.shape} != float32{spec.lse_shape}"
        problem = _nan_pattern("lse", lse, want_lse)
        if problem:
            return worst, problem
        if not np.array_equal(np.isneginf(lse), np.isneginf(want_lse)):
            return worst, "-inf pattern of lse differs from the reference"
        fin_l = np.isfinite(want_lse)
        lerr = np.abs(lse[fin_l] - want_lse[fin_l])
        if lerr.size and not lerr.max() <= LSE_ATOL[spec.dtype]:
            return worst, f"lse err {lerr.max():.3g} > {LSE_ATOL[spec.dtype]}"
    return worst, ""


def compare_partials(spec: AttentionSpec, got: tuple[np.ndarray, np.ndarray],
                     want: tuple[np.ndarray, np.ndarray], tol: tuple[float, float]) -> tuple[float, str]:
    """Partial states against the reference's: same shapes, NaN exactly where the
    reference has it, empty splits exact (o = 0, lse = -inf), other values close."""
    (o, lse), (wo, wl) = got, want
    if o.shape != wo.shape or lse.shape != wl.shape or o.dtype != np.float32 or lse.dtype != np.float32:
        return float("inf"), f"partials {o.dtype}{o.shape}/{lse.dtype}{lse.shape} != float32{wo.shape}"
    if not np.isnan(wo).any() and not np.isnan(wl).any() and (np.isnan(o).any() or np.isnan(lse).any()):
        return float("inf"), "NaN in partial states"
    problem = _nan_pattern("lse_parts", lse, wl) or _nan_pattern("o_parts", o, wo)
    if problem:
        return float("inf"), problem
    if not np.array_equal(np.isneginf(lse), np.isneginf(wl)):
        return float("inf"), "-inf pattern of lse_parts differs (empty splits)"
    empty = np.isneginf(wl)
    if (np.where(np.isnan(wo), 0.0, o)[empty] != 0).any():
        return float("inf"), "o_parts of an empty split is not 0"
    atol, rtol = tol
    fin = ~np.isnan(wo)
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(o.astype(np.float64) - np.where(fin, wo, 0.0)), 0.0)
    worst = float(err.max()) if err.size else 0.0
    if (fin & ~(err <= atol + rtol * np.abs(np.where(fin, wo, 0.0)))).any():
        return worst, f"o_parts max err {worst:.3g}"
    fin_l = np.isfinite(wl)
    lerr = np.abs(lse[fin_l] - wl[fin_l])
    if lerr.size and not lerr.max() <= LSE_ATOL[spec.dtype]:
        return worst, f"lse_parts err {lerr.max():.3g}"
    return worst, ""


# -- non-finite values (docs/contract.md "Non-finite values and scalar fields") -----------------
def visibility(spec: AttentionSpec, lengths: np.ndarray, starts: Any = None,
               q_lens: Any = None) -> np.ndarray:
    """[B, S, C] bool: key j is visible to query row i of batch b (positional: L_b,
    kv_start, the row counts, causality, the windows; the bias plays no part)."""
    j = np.arange(spec.capacity)[None, None, :]
    L = np.asarray(lengths, np.int64)[:, None, None]
    first = np.zeros_like(L) if starts is None else np.asarray(starts, np.int64)[:, None, None]
    sq = np.full_like(L, spec.seq_len) if q_lens is None \
        else np.asarray(q_lens, np.int64)[:, None, None]
    rows = np.arange(spec.seq_len)[None, :, None]
    pos = L - sq + rows
    return ref.within_reach(spec, (j < L) & (j >= first) & (rows < sq), j, pos)


def _kv_index(spec: AttentionSpec, t: Mapping[str, np.ndarray], b: int, n: int, j: int,
              d: int) -> tuple[int, ...]:
    """Index of element d of key j, kv head n, batch b in k/v (any kv layout)."""
    if spec.kv_layout == "paged":
        assert spec.page_size is not None
        return (int(t["block_table"][b, j // spec.page_size]), j % spec.page_size, n, d)
    return (b, j, n, d) if spec.kv_layout == "BSNH" else (b, n, j, d)


def plant_overflow(spec: AttentionSpec, t: dict[str, np.ndarray]) -> int:
    """Scores that overflow float32 from finite inputs (docs/contract.md "Overflow"), in place:
    q of the last batch's query heads of kv head 0 (every row) and k of that batch's kv head
    0 (every existing key) so large that every score of those rows is beyond float32's range,
    s = scale * q.k > 4 * 3.4e38: those rows' out and lse are NaN on every backend and in the
    reference. The batch's bias entries of those heads lose their -inf (a block-skipping kernel
    would skip a block masked whole, leaving a row that sees keys by position empty).

    Only where such values exist and leave the other plants their rows: float32 or bfloat16
    q and k (no float16 value is that large; quantized K/V are codes), two batches or more,
    and a query head outside kv head 0's group other than the last (the visible +inf bias
    entry goes there; the last head's q is NaN). Returns that head (0 when nothing is
    planted)."""
    g, nq = spec.group_size, spec.num_heads
    spare = list(range(g, nq - 1))
    if spec.dtype == "float16" or spec.kv_dtype is not None or spec.batch < 2 or not spare:
        return 0
    b = spec.batch - 1
    big = min(2.0 * math.sqrt(F32_MAX / (spec.effective_scale * spec.head_size)), 1e38)
    if spec.q_layout == "BSNH":
        t["q"][b, :, :g] = big
    else:
        t["q"][b, :g] = big
    for j in range(int(valid_lengths(spec, t)[b])):
        t["k"][_kv_index(spec, t, b, 0, j, 0)[:-1]] = big
    if spec.bias:
        bias = t["bias"]
        mine = bias[b % bias.shape[0], :g]          # a view (one head if broadcast)
        mine[np.isneginf(mine)] = 0.0
    return spare[0]


def plant_nonfinite(spec: AttentionSpec, t: dict[str, np.ndarray]) -> None:
    """Plant NaN and inf (in place) where some rows see them and others do not:

    - k of the last existing key of batch 0, kv head 0 (NaN): under causal masking only the
      last query row sees it;
    - v of the key before it, kv head Nkv-1 (+inf in one component, NaN in another): the
      rows that see it get NaN in those components only;
    - k and v of the key just left of the first row's window, every batch (invisible to
      every row: NaN, -inf);
    - without causal masking, v of the key just right of the first row's right window,
      every batch, kv head 0 (NaN in the last component: the later rows that see it get
      NaN there, the first row must not);
    - bias: NaN and +inf in entries no row sharing them can see, +inf in one entry that
      some row sees;
    - q of the last head of the last batch (NaN), in row 0, or with a bias the first row
      that sees a key the bias does not mask;
    - scores that overflow float32 (plant_overflow), in the last batch's kv head 0, where
      the shapes leave a head for the visible +inf bias entry outside that group.

    Memory past each L_b is NaN already (make_tensors). Which rows turn NaN follows from
    the reference (docs/contract.md "Non-finite values and scalar fields": visible NaN / +inf
    poison their rows). The planted q, k and v that rows see sit where their bias does not mask
    them: a block-skipping kernel never reads a block its bias masks whole (-inf), so a NaN there
    cannot reach its rows, though visibility is positional (the reference, and every other kernel,
    poison them)."""
    lengths = valid_lengths(spec, t)
    vis = visibility(spec, lengths, kv_starts(spec, t), q_lengths(spec, t))
    h_inf = plant_overflow(spec, t)            # the head for the visible +inf bias entry
    nkv, h = spec.kv_num_heads, spec.head_size
    hv = spec.head_size_v
    b0, b1 = 0, spec.batch - 1
    L0 = int(lengths[b0])
    t["k"][_kv_index(spec, t, b0, 0, L0 - 1, 1 % h)] = np.nan
    jv = max(L0 - 2, 0)
    t["v"][_kv_index(spec, t, b0, nkv - 1, jv, 2 % hv)] = np.inf
    t["v"][_kv_index(spec, t, b0, nkv - 1, jv, hv - 1)] = np.nan
    if spec.local_window > 0:
        for b, (L, sq) in enumerate(zip(lengths, q_lengths(spec, t))):
            jw = int(L) - int(sq) - spec.local_window    # p_0 - window: invisible to all rows
            if jw >= 0:
                t["k"][_kv_index(spec, t, b, 0, jw, 0)] = np.nan
                t["v"][_kv_index(spec, t, b, nkv - 1, jw, 0)] = -np.inf
    right: list[tuple[int, int]] = []           # (batch, key) of the right-window plants
    if spec.right_window >= 0 and not spec.causal:
        for b, (L, sq) in enumerate(zip(lengths, q_lengths(spec, t))):
            jr = int(L) - int(sq) + spec.right_window + 1   # p_0 + right_window + 1
            if jr < int(L):                     # invisible to row 0, visible to later rows
                t["v"][_kv_index(spec, t, b, 0, jr, hv - 1)] = np.nan
                right.append((b, jr))
    if spec.bias:
        bias = t["bias"]
        bb, hb, sb = bias.shape[:3]
        # an entry is seen if any (batch, row) it broadcasts to sees its key
        seen = vis if sb > 1 else vis.any(axis=1, keepdims=True)
        seen = np.asarray(seen if bb > 1 else seen.any(axis=0, keepdims=True))  # [bb, sb, C]
        # the k and v planted above are not masked by the bias for the rows that see them
        # (see the note on block-skipping kernels above)
        for b, j in [(b0, jv), (b0, L0 - 1), *right]:
            col = bias[b % bb, :, :, j]
            col[np.isneginf(col)] = 0.0
        in_range = np.arange(spec.capacity)[None, None, :] < lengths.max()
        hidden = np.argwhere(~seen & in_range)
        if len(hidden):
            x, i, j = (int(v) for v in hidden[-1])          # the latest invisible in range
            bias[x, hb - 1, i, j] = np.nan
            x, i, j = (int(v) for v in hidden[0])
            bias[x, 0, i, j] = np.inf
        shown = np.argwhere(seen[bb - 1, sb - 1])
        if len(shown):
            bias[bb - 1, h_inf % hb, sb - 1, int(shown[0][0])] = np.inf
    # q: the first row of the last head that sees a key its bias does not mask (a row that
    # only sees -inf would be skipped whole by block-skipping kernels, see above)
    hq, row = spec.num_heads - 1, 0
    if spec.bias:
        bias = t["bias"]
        sees = vis[b1] & ~np.isneginf(bias[b1 % bias.shape[0], hq % bias.shape[1]])
        rows = np.nonzero(sees.any(axis=-1))[0]
        row = int(rows[0]) if len(rows) else 0
    t["q"][(b1, row, hq, 0) if spec.q_layout == "BSNH" else (b1, hq, row, 0)] = np.nan
