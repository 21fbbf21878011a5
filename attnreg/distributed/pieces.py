"""Which query rows see which keys of one shard, as runs of that shard's own KVCache.

A shard holds, for batch entry b, the keys at global positions [off_b, off_b + n_b) (its own
positions 0 .. n_b - 1). Query row i of b sits at p_i = L_b - S_b + i (docs/contract.md "The
math"; S_b = seq_len without seqlens_q). A run over the shard is an ordinary spec of its
KVCache: it places its rows bottom-right of its own lengths L'_b, at p'_i = L'_b - S'_b + i'.
Rows beyond the shard's end (a past shard, seen whole) or a window that starts inside it do not
fit that frame as they are, so each piece of rows is run with its positions moved by a shift
delta = (p_i - off_b) - p'_i, and the bounds moved with them:

- the right bound (causal: E = 0; right_window R: E = R; neither: none) becomes
  right_window E + delta (0 is causal; a bound no row of the piece reaches is dropped);
- the left bound (local_window W) becomes local_window W - delta, or, for a one-row piece (a
  decode), a per-entry kv_start; kv_start itself becomes max(0, kv_start_b - off_b);
- ALiBi's term moves by slope_h * delta, so the run's lse is corrected by -slope_h * delta.

Rows that see nothing of the shard (earlier rows of a causal prefill, rows whose window starts
after it) are not run: their states stay empty, and a shard no row sees runs nothing. Pieces
of different entries that share the local bounds run together as one launch (decode: one
launch per shard).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..spec import AttentionSpec

# (causal, local_window, right_window) of a run: what the pieces of one launch share.
Bounds = tuple[bool, int, int]


@dataclass(frozen=True)
class Piece:
    """Query rows [rows[0], rows[1]) of batch entry ``b`` run on one shard: the run's valid
    length ``length`` (L'_b), first key ``start`` (kv_start'_b) and position ``shift``."""

    b: int
    rows: tuple[int, int]
    length: int
    start: int
    shift: int
    bounds: Bounds

    @property
    def count(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(frozen=True)
class Launch:
    """One run over a shard: at most one piece per batch entry, all with the same bounds."""

    bounds: Bounds
    pieces: tuple[Piece, ...]

    @property
    def seq_len(self) -> int:
        return max(p.count for p in self.pieces)


def shard_launches(spec: AttentionSpec, offsets: np.ndarray, counts: np.ndarray,
                   lengths: np.ndarray, kv_start: np.ndarray, q_rows: np.ndarray
                   ) -> list[Launch]:
    """The runs that give every query row exactly the keys of this shard it sees: the shard
    holds counts[b] keys from global position offsets[b]; lengths, kv_start and q_rows are
    L_b, kv_start[b] and S_b of the whole cache."""
    pieces: list[Piece] = []
    for b in range(spec.batch):
        pieces += _entry(spec, b, int(offsets[b]), int(counts[b]), int(lengths[b]),
                         int(kv_start[b]), int(q_rows[b]))
    return _group(pieces)


def _entry(spec: AttentionSpec, b: int, off: int, n: int, length: int, first_key: int,
           rows: int) -> list[Piece]:
    """Entry b's pieces on a shard holding n keys from position off."""
    start = max(0, first_key - off)
    if n <= 0 or start >= n:
        return []
    right = 0 if spec.causal else (spec.right_window if spec.right_window >= 0 else None)
    window = spec.local_window if spec.local_window > 0 else None
    p0 = length - rows - off                 # row 0's position, counted from the shard's start
    # Row i sees some key of the shard exactly when its right bound reaches the first key and
    # its window starts before the shard's end; those rows are consecutive.
    lo = 0 if right is None else max(0, start - right - p0)
    hi = rows if window is None else min(rows, n - 1 + window - p0)
    # Pieces of at most n rows: a run's valid length (at most n) may not be below its rows.
    return [_piece(b, u, min(hi, u + n), p0, n, start, right, window)
            for u in range(lo, hi, n)]


def _piece(b: int, u: int, v: int, p0: int, n: int, start: int, right: int | None,
           window: int | None) -> Piece:
    last = p0 + v - 1                        # the piece's last row, from the shard's start
    length = n if right is None else min(n, last + 1 + right)
    shift = last + 1 - length                # >= 0 unless a right bound reaches past the end
    causal, right_w, local_w = True, -1, -1
    if v - u > 1:                            # one row is last in its run: no right bound binds
        if right is not None and p0 + u + right < length - 1:
            causal, right_w = (True, -1) if right + shift == 0 else (False, right + shift)
        else:
            causal = False
    if window is not None and last - window + 1 > start:     # the window cuts into the keys
        if v - u == 1:
            start = last - window + 1
        else:
            local_w = window - shift
    return Piece(b, (u, v), length, start, shift, (causal, local_w, right_w))


def _group(pieces: Sequence[Piece]) -> list[Launch]:
    """Pieces with the same bounds, one per entry, as launches (in a stable order)."""
    if pieces and all(p.bounds == pieces[0].bounds and p.b == b for b, p in enumerate(pieces)):
        return [Launch(pieces[0].bounds, tuple(pieces))]      # a decode: one launch
    by_bounds: dict[Bounds, dict[int, list[Piece]]] = defaultdict(lambda: defaultdict(list))
    for p in pieces:
        by_bounds[p.bounds][p.b].append(p)
    out = []
    for bounds, per_entry in by_bounds.items():
        for k in range(max(len(ps) for ps in per_entry.values())):
            out.append(Launch(bounds, tuple(ps[k] for ps in per_entry.values() if len(ps) > k)))
    return out
