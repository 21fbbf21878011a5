"""ShardedKVCache: one sequence-sharded KV cache, its shards on several Sessions of this
process or one shard per rank of a torch.distributed process group.

The placement rule (no rebalancing: a token never moves once written): shards fill in order.
Every shard is a static KVCache of its own capacity. An append goes to the last shard in use;
the part of it that does not fit there (some entry would pass the shard's capacity) starts the
next shard, which then holds, for every entry, the positions from that entry's length at the
moment it started. Shard r therefore holds, for batch entry b, the keys at global positions
[offsets[r, b], offsets[r, b] + counts[r, b]), consecutive shards continuing each other. In a
process group every rank makes the same appends (the same arrays); each writes the part that
falls in its own shard and keeps the placement of all of them. ``release(b)`` ends sequence b
on every shard; its next tokens start at position 0 of the active shard.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from ..errors import ClosedError, SpecError
from ..kv_cache import KVCache
from ..session import Session
from ..spec import AttentionSpec
from .exchange import HEADER, Channel, Group, digest, exchange, group_place
from .rules import GATHER_RULES, GATHERS, MERGES, choose, host_cores
from .shard import Prepared

T = TypeVar("T")

# The spec fields a caller chooses per call; the rest describe the cache (cache.spec makes them).
CALL_FIELDS = ("q_layout", "causal", "scale", "softcap", "local_window", "right_window",
               "alibi_max_bias", "head_sink", "return_lse", "kv_start", "seqlens_q")


class ShardedKVCache:
    """A KV cache sharded by sequence position (see the module's placement rule).

    ``sessions``: a list of Sessions, one shard each (devices, or backends, of this process),
    or, with ``group`` (a torch.distributed process group, e.g. ``dist.group.WORLD``), this
    rank's one Session: the group's ranks hold one shard each, in rank order.
    ``shard_capacity``: the most tokens a shard holds, one for all or one per shard. The
    other arguments are :meth:`attnreg.Session.kv_cache`'s, for every shard (a paged shard
    owns its block table). ``timeout``: seconds a call waits for the other ranks (None: the
    process group's timeout); ``exchange_bytes``: the size of a call's first all_gather
    (exchange.py: states that fit take one round). ``merge``: where the states are merged:
    "auto" (rules.py: numpy for small states, the device for large ones), "device" (one
    reduce on this process's device: the first Session's, or this rank's) or "host" (numpy).
    ``gather``: how a group's ranks exchange the states' first round: "auto" (rules.py),
    "all_gather" or "point_to_point" (isend / irecv between every two ranks). In a group every
    rank makes the cache with the same arguments (its own Session), checked by one all_gather
    here; ``merge`` and ``gather`` may be set again between calls (``gather`` alike on every
    rank).
    """

    def __init__(self, sessions: Session | Sequence[Session], *, batch: int, kv_num_heads: int,
                 head_size: int, shard_capacity: int | Sequence[int], dtype: str = "float16",
                 layout: str = "BSNH", kv_dtype: str | None = None, page_size: int | None = None,
                 v_head_size: int | None = None, group: Group | None = None,
                 timeout: float | None = None, exchange_bytes: int = 65536,
                 merge: str = "auto", gather: str = "auto") -> None:
        if merge not in MERGES:
            raise SpecError("merge", merge, f"one of {MERGES}")
        if gather not in GATHERS:
            raise SpecError("gather", gather, f"one of {GATHERS}")
        self.merge = merge
        local = [sessions] if isinstance(sessions, Session) else list(sessions) \
            if isinstance(sessions, (list, tuple)) else None
        if not local or not all(isinstance(s, Session) for s in local):
            raise SpecError("sessions", sessions, "an attnreg.Session or a non-empty list of them")
        self.group = group
        self.batch, self.kv_num_heads, self.head_size = batch, kv_num_heads, head_size
        self.v_head_size, self.dtype, self.layout = v_head_size, dtype, layout
        self.kv_dtype, self.page_size = kv_dtype, page_size
        self.rank, n_shards = 0, len(local)
        if group is not None:
            if len(local) != 1:
                raise SpecError("sessions", sessions, "one Session (this rank's shard), because "
                                "a group is given")
            self.rank, n_shards = group_place(group)
        failure = None
        try:
            self._setup(local, shard_capacity, n_shards, timeout, exchange_bytes)
        except Exception as exc:
            if group is None:
                raise
            failure = exc
        if group is not None:       # every rank's cache alike, or every rank raises
            stamp = digest(getattr(self, "capacities", shard_capacity), exchange_bytes, batch,
                           kv_num_heads, head_size, dtype, layout, kv_dtype, page_size,
                           v_head_size, gather)
            # by all_gather, whatever the ranks' gather settings (the stamp compares them)
            exchange(Channel(group, HEADER, "all_gather"), timeout, stamp, None, failure)
        # the exchange's buffers, kept across calls, and how they travel (the gather setter)
        self.channel = Channel(group, self.exchange_bytes) if group is not None else None
        self.gather = gather
        self.offsets = np.zeros((n_shards, batch), np.int64)
        self.counts = np.zeros((n_shards, batch), np.int64)
        self.active = 0                 # the last shard in use (appends go there first)
        self.last_timings: dict[str, float] = {}     # the last call's steps, in seconds
        self.last_merge = ""            # the rule (or setting) that placed the last merge
        self.checked_specs: set[AttentionSpec] = set()   # specs already checked against it
        self.version = 0                # bumped by every append and release (the placement)
        self._lengths = (-1, self.counts.sum(axis=0))
        # per call spec, what does not change until the next append or release (attention.py)
        self.memo: dict[Any, Any] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _setup(self, local: list[Session], shard_capacity: Any, n_shards: int,
               timeout: Any, exchange_bytes: Any) -> None:
        """Checks the arguments and makes the KVCaches of this process's shards."""
        self.capacities = _capacities(shard_capacity, n_shards)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not 0 < timeout < math.inf):
            raise SpecError("timeout", timeout, "None or a positive number of seconds")
        if isinstance(exchange_bytes, bool) or not isinstance(exchange_bytes, int) \
                or not 2 * HEADER <= exchange_bytes <= 2**30:
            raise SpecError("exchange_bytes", exchange_bytes, f"an integer in [{2 * HEADER}, 2**30]")
        self.timeout, self.exchange_bytes = timeout, exchange_bytes
        mine = range(n_shards) if self.group is None else [self.rank]
        # shard index -> (its Session, its KVCache), for the shards this process holds
        self.shards: dict[int, tuple[Session, KVCache]] = {}
        for r, session in zip(mine, local):
            self.shards[r] = (session, session.kv_cache(
                batch=self.batch, kv_num_heads=self.kv_num_heads, head_size=self.head_size,
                capacity=self.capacities[r], dtype=self.dtype, layout=self.layout,
                kv_dtype=self.kv_dtype, page_size=self.page_size, v_head_size=self.v_head_size))
        self.head_size_v = next(iter(self.shards.values()))[1].head_size_v
        # each shard's prepared launches (shard.py), kept across calls and appends
        self.prepared: dict[int, Prepared] = {r: {} for r in self.shards}

    def each_shard(self, fn: Callable[[int], T]) -> list[T]:
        """fn(r) for every shard this process holds, in shard order; concurrently where they
        are on different Sessions (each Session runs one call at a time)."""
        order = sorted(self.shards)
        if len({id(self.shards[r][0]) for r in order}) <= 1:
            return [fn(r) for r in order]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(order), thread_name_prefix="attnreg-shard")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        futures = [self._pool.submit(fn, r) for r in order]
        return [f.result() for f in futures]

    @property
    def gather(self) -> str:
        """How a group's ranks exchange states: "auto", "all_gather" or "point_to_point"."""
        return self._gather

    @gather.setter
    def gather(self, value: str) -> None:
        if value not in GATHERS:
            raise SpecError("gather", value, f"one of {GATHERS}")
        self._gather, self.gather_rule = value, ""       # the rule, for a group's cache
        if self.channel is not None:
            self.channel.way, self.gather_rule = choose(GATHER_RULES, value, "gather",
                                                        ranks=self.num_shards,
                                                        cores=host_cores())

    @property
    def num_shards(self) -> int:
        return len(self.capacities)

    @property
    def capacity(self) -> int:
        return sum(self.capacities)

    @property
    def lengths(self) -> np.ndarray:
        """L_b: the tokens each batch entry holds over all shards (a read-only array)."""
        if self._lengths[0] != self.version:
            lengths = self.counts.sum(axis=0)
            lengths.flags.writeable = False
            self._lengths = (self.version, lengths)
        return self._lengths[1]

    def _moved(self) -> None:
        """The placement changed: what was kept for the old one no longer holds."""
        self.version += 1
        self.memo.clear()

    def spec(self, num_heads: int, seq_len: int = 1, **fields: Any) -> AttentionSpec:
        """The AttentionSpec of attending over the whole cache with seq_len new query rows
        (``fields``: the call's own, such as causal, local_window, head_sink, return_lse)."""
        paging = {"page_size": self.page_size, "num_pages": sum(
            self.batch * -(-c // self.page_size) for c in self.capacities)} \
            if self.layout == "paged" and self.page_size else {}
        return AttentionSpec(batch=self.batch, seq_len=seq_len, past_len=self.capacity - seq_len,
                             num_heads=num_heads, kv_num_heads=self.kv_num_heads,
                             head_size=self.head_size, dtype=self.dtype, kv_layout=self.layout,
                             kv_capacity=self.capacity, seqlens_k=True, kv_dtype=self.kv_dtype,
                             v_head_size=self.v_head_size, **paging, **fields)

    def append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Write S new tokens per batch entry ([B, S, Nkv, H] in the cache's dtype) after each
        entry's length, by the placement rule. Checked whole before anything is written."""
        s = self._check_new(k_new, v_new)
        try:
            for r, t0, t1 in self._placement(s):
                if r != self.active:    # a shard starts where every entry's length is now
                    self.active = r
                    self.offsets[r] = self.counts.sum(axis=0)
                if r in self.shards:
                    self.shards[r][1].append(np.ascontiguousarray(k_new[:, t0:t1]),
                                             np.ascontiguousarray(v_new[:, t0:t1]))
                self.counts[r] += t1 - t0
        finally:
            self._moved()

    def release(self, b: int) -> None:
        """End sequence ``b`` on every shard (KVCache.release): its length becomes 0 and its
        next tokens go to the active shard, from that shard's position 0 for b."""
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.batch:
            raise SpecError("b", b, f"a batch index in [0, {self.batch})")
        for _, kv in self.shards.values():
            kv.release(int(b))
        self.counts[:, b] = 0
        self.offsets[:, b] = 0
        self._moved()

    def _placement(self, s: int) -> list[tuple[int, int, int]]:
        """(shard, first, end) of the new tokens each shard takes, or a SpecError if the
        shards from the active one on cannot take s tokens."""
        out, t, r = [], 0, self.active
        fill = int(self.counts[r].max())
        while t < s and r < self.num_shards:
            take = min(self.capacities[r] - fill, s - t)
            if take > 0:
                out.append((r, t, t + take))
                t += take
            r, fill = r + 1, 0
        if t < s:
            raise SpecError("k_new.shape[1]", s, f"at most {t} new tokens: the shards "
                            f"{list(self.capacities)} hold {self.lengths.tolist()} tokens per "
                            "entry, filled in order")
        return out

    def _check_new(self, k_new: Any, v_new: Any) -> int:
        """The number of new tokens, once k_new and v_new are checked as every shard would."""
        for name, x, h in (("k_new", k_new, self.head_size), ("v_new", v_new, self.head_size_v)):
            want = (self.batch, None, self.kv_num_heads, h)
            if not isinstance(x, np.ndarray) or x.ndim != 4 or x.dtype != np.dtype(self.dtype) \
                    or any(w is not None and w != d for w, d in zip(want, x.shape)):
                raise SpecError(name, x, f"a {self.dtype} array [B={self.batch}, S, "
                                f"Nkv={self.kv_num_heads}, {h}]")
        if v_new.shape[1] != k_new.shape[1]:
            raise SpecError("v_new.shape", v_new.shape, f"k_new's {k_new.shape} in its first 3 dims")
        if self.kv_dtype is not None:
            for name, x in (("k_new", k_new), ("v_new", v_new)):
                if not np.isfinite(x.astype(np.float32)).all():
                    raise SpecError(name, "non-finite values", f"finite values (a {self.kv_dtype}"
                                    " KV cache cannot hold NaN or inf)")
        for session, _ in self.shards.values():
            if session.closed:
                raise ClosedError("sessions", session, "open Sessions (one was closed)")
        return int(k_new.shape[1])


def _capacities(value: Any, n: int) -> tuple[int, ...]:
    caps = [value] * n if isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
        else list(value) if isinstance(value, (list, tuple)) else None
    if caps is None or len(caps) != n or not all(
            isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 1 for c in caps):
        raise SpecError("shard_capacity", value, f"an integer >= 1, or {n} of them (one per shard)")
    return tuple(int(c) for c in caps)
