"""One shard's attention states: its launches (pieces.py) run on its own Session and KVCache,
their (out, lse) placed at the rows they answer, as float32 states over the whole query."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..device_tensor import DeviceTensor
from ..kv_cache import KVCache
from ..prepared import PreparedRun
from ..reference import alibi_slopes
from ..session import Session
from ..spec import AttentionSpec
from .pieces import Bounds, Launch

States = tuple[np.ndarray, np.ndarray]


def empty_states(spec: AttentionSpec, into: States | None = None) -> States:
    """States of a shard no row sees: o 0 and lse -inf everywhere (the reduce ignores them),
    written into ``into`` where given."""
    shape = (spec.batch, spec.num_heads, spec.seq_len)
    if into is None:
        return (np.zeros((*shape, spec.head_size_v), np.float32),
                np.full(shape, -np.inf, np.float32))
    into[0].fill(0.0)
    into[1].fill(-np.inf)
    return into


@dataclass(frozen=True)
class Run:
    """One launch as a run of the shard's KVCache: its spec, and the tensors it takes besides
    the query and the cache's own (per-entry lengths, kv_start, row counts), made once per
    placement (the cache's memo)."""

    launch: Launch
    spec: AttentionSpec
    extras: dict[str, np.ndarray]
    whole: bool                         # it answers every row of every entry (a decode)


# A shard's prepared launches for runs with no extras, by their spec: the query's device
# tensor and the PreparedRun over it and the cache's own tensors (kept across appends).
Prepared = dict[AttentionSpec, tuple[DeviceTensor, PreparedRun]]


def shard_runs(spec: AttentionSpec, kv: KVCache, launches: list[Launch]) -> list[Run]:
    """The launches as runs of the shard's KVCache (return_lse, no sink: the merge adds it)."""
    runs = []
    for launch in launches:
        rows = launch.seq_len
        by_entry = {p.b: p for p in launch.pieces}
        ragged = any(p.count != rows for p in launch.pieces)
        # Entries the launch does not answer still need valid lengths: their results are
        # dropped.
        lengths = np.array([by_entry[b].length if b in by_entry else (1 if ragged else rows)
                            for b in range(spec.batch)], np.int32)
        starts = np.array([by_entry[b].start if b in by_entry else 0
                           for b in range(spec.batch)], np.int32)
        local = local_spec(spec, kv.capacity, kv.num_pages, rows, launch.bounds,
                           bool(starts.any()), ragged)
        extras = {}
        if not np.array_equal(lengths, kv.lengths):
            extras["seqlens_k"] = lengths   # else the cache's own lengths, on the device
        if local.kv_start:
            extras["kv_start"] = starts
        if ragged:
            extras["seqlens_q"] = np.array([by_entry[b].count if b in by_entry else 1
                                            for b in range(spec.batch)], np.int32)
        whole = len(launches) == 1 and rows == spec.seq_len and len(launch.pieces) == \
            spec.batch and all(p.rows == (0, spec.seq_len) for p in launch.pieces)
        runs.append(Run(launch, local, extras, whole))
    return runs


def shard_states(session: Session, kv: KVCache, spec: AttentionSpec, q: np.ndarray,
                 runs: list[Run], into: States | None = None,
                 prepared: Prepared | None = None) -> States:
    """o [B, Nq, S, Hv] and lse [B, Nq, S] (float32) of the keys this shard holds, written
    into ``into`` where given. Runs with no extras launch through ``prepared`` where given."""
    whole = len(runs) == 1 and runs[0].whole
    o, lse = into if whole and into is not None else empty_states(spec, into)
    slopes = alibi_slopes(spec.num_heads, spec.alibi_max_bias) if spec.alibi_max_bias else None
    for run in runs:
        out_l, lse_l = _launch(session, kv, _query_rows(spec, q, run.launch), run, prepared)
        o_l = out_l if spec.q_layout == "BNSH" else out_l.transpose(0, 2, 1, 3)
        if whole:                       # a decode: every entry's rows in one launch
            o[:] = o_l
            lse[:] = lse_l
        for p in run.launch.pieces:
            (u, v), n = p.rows, p.count
            if not whole:
                o[p.b, :, u:v] = o_l[p.b, :, :n]
                lse[p.b, :, u:v] = lse_l[p.b, :, :n]
            if slopes is not None and p.shift:
                # the run saw ALiBi's term at positions moved by the shift (pieces.py)
                lse[p.b, :, u:v] -= (slopes * p.shift).astype(np.float32)[:, None]
    return o, lse


def _launch(session: Session, kv: KVCache, q: np.ndarray, run: Run,
            prepared: Prepared | None) -> Any:
    """One run: a prepared launch where it has no extras (the query written into its device
    tensor; planned and checked once), else Session.run."""
    if prepared is None or run.extras:
        return session.run(run.spec, {**kv.tensors(q), **run.extras})
    got = prepared.get(run.spec)
    if got is None:
        if len(prepared) >= 16:         # a caller cycling through many specs
            prepared.clear()
        qt = session.empty(run.spec.q_shape, run.spec.dtype)
        qt.write(q)
        got = prepared[run.spec] = (qt, session.prepare(run.spec, kv.tensors(qt)))
    qt, launch = got
    qt.write(q)
    return launch()


@functools.lru_cache(maxsize=1024)
def local_spec(spec: AttentionSpec, capacity: int, num_pages: int | None, rows: int,
               bounds: Bounds, kv_start: bool, seqlens_q: bool) -> AttentionSpec:
    """The spec of one launch over a shard of ``capacity`` keys (what its KVCache's spec
    gives, with the launch's bounds; return_lse, no sink). Cached: a decode loop makes the
    same launches every step, and building a spec costs tens of microseconds."""
    causal, local_w, right_w = bounds
    return spec.replace(seq_len=rows, past_len=capacity - rows, kv_capacity=capacity,
                        num_pages=num_pages, causal=causal, local_window=local_w,
                        right_window=right_w, kv_start=kv_start, seqlens_q=seqlens_q,
                        head_sink=False, return_lse=True)


def _query_rows(spec: AttentionSpec, q: np.ndarray, launch: Launch) -> np.ndarray:
    """The launch's query: each piece's rows moved to the top (q itself for a decode)."""
    if launch.seq_len == spec.seq_len and all(p.rows == (0, spec.seq_len)
                                               for p in launch.pieces):
        return q
    axis = 1 if spec.q_layout == "BSNH" else 2
    shape = list(q.shape)
    shape[axis] = launch.seq_len
    out = np.zeros(shape, q.dtype)
    for p in launch.pieces:
        (u, v), n = p.rows, p.count
        if axis == 1:
            out[p.b, :n] = q[p.b, u:v]
        else:
            out[p.b, :, :n] = q[p.b, :, u:v]
    return out
