"""The merge of the shards' states (docs/contract.md "Split-KV partial states and merging"):
where it runs (rules.py) and the merge in numpy.

The states are small (B x Nq x S x Hv floats) and, after the exchange, on the host. A merge
on the device pays an upload, a reduce launch and a read-back, each with the device's fixed
costs; numpy pays a few array operations, which grow with the states' size. So small states
are merged in numpy and large ones (a long prefill's) on the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import reference
from ..spec import AttentionSpec
from .rules import MERGE_RULES, choose

States = tuple[np.ndarray, np.ndarray]


def merge_place(spec: AttentionSpec, n_states: int, fixed: str) -> tuple[str, str]:
    """(where the merge runs, the rule or setting that chose it) for ``n_states`` states."""
    rows = spec.batch * spec.num_heads * spec.seq_len
    return choose(MERGE_RULES, fixed, "merge",
                  state_bytes=n_states * rows * (spec.head_size_v + 1) * 4)


def host_merge(spec: AttentionSpec, states: Sequence[States], sink: np.ndarray | None,
               rows: np.ndarray | None) -> Any:
    """The states merged in numpy as the spec's result (out in q's layout and dtype; with
    return_lse, (out, lse)). Rows whose shards all saw some key (every lse finite,
    every o finite) take the direct form; anything else (a shard no row of it saw, padding rows,
    non-finite values) the reference's reduce, which spells those cases out."""
    got = _direct(spec, states, sink, rows)
    if got is None:
        o_parts = np.stack([o for o, _ in states], axis=3)
        lse_parts = np.stack([x for _, x in states], axis=3)
        got = reference.reduce(spec, o_parts, lse_parts, sink, rows)
    out = reference.out_layout(spec, got[0]).astype(spec.dtype, order="C")
    return (out, got[1].astype(np.float32)) if spec.return_lse else out


def _direct(spec: AttentionSpec, states: Sequence[States], sink: np.ndarray | None,
            rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(out, lse) by the reduce's formula where every state is finite, else None. Few array
    operations: the states are small, so each operation's fixed cost is what counts."""
    if rows is not None and (np.asarray(rows) < spec.seq_len).any():
        return None                         # padding rows: no sink, out 0 (the reference's)
    lse = np.array([x for _, x in states], np.float64)          # [T, B, Nq, S]
    if not math.isfinite(lse.sum()):        # some -inf, +inf or NaN: the reference's cases
        return None
    m = lse.max(axis=0)
    s = None if sink is None else np.asarray(sink, np.float64)[None, :, None]
    if s is not None:
        m = np.maximum(m, s)
    w = np.exp(lse - m)
    den = w.sum(axis=0) if s is None else w.sum(axis=0) + np.exp(s - m)
    # the weights (in [0, 1]) times the shards' o, summed in float32: as exact as the o
    t, hv = len(states), spec.head_size_v
    o = np.array([x for x, _ in states], np.float32).reshape(t, -1, hv)     # [T, R, Hv]
    num = (w.astype(np.float32).reshape(t, -1, 1) * o).sum(axis=0)
    out = num.reshape(*m.shape, hv) / den[..., None].astype(np.float32)
    if not math.isfinite(out.sum()):        # an inf or NaN in some o: the reference's NaN
        return None
    return out, m + np.log(den)
