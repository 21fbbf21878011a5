"""sharded_attention: what run computes, over a ShardedKVCache (docs/contract.md "Past one
device"). Each shard's states come from its own Session (shard.py), are gathered in-process or
through the process group (exchange.py), and are merged as the splits of one reduce, by the
reduce's rule (docs/contract.md "Split-KV partial states and merging"), the sink counted there,
once: on this process's device or in numpy, as merge.py's rules say."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..device_tensor import DeviceTensor
from ..errors import SpecError
from ..session import Session
from ..spec import AttentionSpec
from ..tensors import _as_array, _check_dtype, _check_index, _check_shape, _check_sink
from .cache import CALL_FIELDS, ShardedKVCache
from .exchange import Group, digest, exchange
from .merge import host_merge, merge_place
from .pieces import shard_launches
from .shard import States, empty_states, shard_runs, shard_states

EXTRAS = {"head_sink": "head_sink", "kv_start": "kv_start", "seqlens_q": "seqlens_q"}


@dataclass
class Call:
    """A checked call: the query, its extra tensors, and L_b, kv_start[b], S_b."""

    spec: AttentionSpec
    q: np.ndarray
    extras: dict[str, Any]
    lengths: np.ndarray
    starts: np.ndarray
    rows: np.ndarray


def sharded_attention(spec: AttentionSpec, q: Any, cache: ShardedKVCache,
                      group: Group | None = None,
                      tensors: Mapping[str, Any] | None = None) -> Any:
    """Attention of ``q`` over the whole sharded cache: out, or (out, lse) with return_lse.

    ``spec`` is ``cache.spec(num_heads, seq_len, ...)``; ``tensors`` holds the call's other
    tensors of run (head_sink, kv_start, seqlens_q); a bias is not taken. In a process group
    every rank makes the same call (``group``: None or the cache's) and gets the whole result;
    if a rank fails, the others raise :class:`RankError` within the cache's timeout.
    """
    if not isinstance(cache, ShardedKVCache):
        raise SpecError("cache", cache, "an attnreg.distributed.ShardedKVCache")
    if group is not None and group is not cache.group:
        raise SpecError("group", group, "None or the process group the cache was made with "
                        f"({cache.group!r})")
    if cache.group is None:
        return _in_process(spec, q, cache, tensors)
    return _ranked(spec, q, cache, tensors)


def _in_process(spec: Any, q: Any, cache: ShardedKVCache,
                tensors: Mapping[str, Any] | None) -> Any:
    t0 = time.perf_counter()
    call = check_call(spec, q, cache, tensors)
    states = cache.each_shard(lambda r: local_states(cache, r, call))
    t1 = time.perf_counter()
    res = merge(cache, cache.shards[0][0], call, states)
    cache.last_timings = {"local_s": t1 - t0, "exchange_s": 0.0,
                          "merge_s": time.perf_counter() - t1}
    return res


def _ranked(spec: Any, q: Any, cache: ShardedKVCache,
            tensors: Mapping[str, Any] | None) -> Any:
    """This rank's shard, the exchange, the merge. Any failure before the exchange is sent
    through it, so that the other ranks raise RankError instead of waiting."""
    t0 = time.perf_counter()
    payload, failure, call = None, None, None
    try:
        call = check_call(spec, q, cache, tensors)
        payload = _local_payload(cache, call)
    except Exception as exc:            # sent to the other ranks, then raised here
        failure = exc
    t1 = time.perf_counter()
    assert cache.channel is not None
    got = exchange(cache.channel, cache.timeout, _stamp(spec, cache), payload, failure)
    t2 = time.perf_counter()
    assert call is not None             # exchange raised the failure otherwise
    res = merge(cache, cache.shards[cache.rank][0], call, [_unpack(call.spec, x) for x in got])
    cache.last_timings = {"local_s": t1 - t0, "exchange_s": t2 - t1,
                          "merge_s": time.perf_counter() - t2}
    return res


def _local_payload(cache: ShardedKVCache, call: Call) -> np.ndarray:
    """This rank's states as the exchange's payload bytes (o, then lse, float32): written
    straight into the channel's send buffer where they fit its first round."""
    spec = call.spec
    nbytes = 4 * spec.batch * spec.num_heads * spec.seq_len * (spec.head_size_v + 1)
    assert cache.channel is not None
    buf = cache.channel.payload(nbytes)
    if buf is None:
        buf = np.empty(nbytes, np.uint8)
    local_states(cache, cache.rank, call, into=_unpack(spec, buf))
    return buf


def _stamp(spec: Any, cache: ShardedKVCache) -> bytes:
    """The digest of a call the ranks compare: its spec and the cache's placement (kept in
    the cache's memo until the placement changes)."""
    if not isinstance(spec, AttentionSpec):
        return digest(repr(spec), cache.offsets, cache.counts)
    key = ("stamp", spec)
    got = cache.memo.get(key)
    if got is None:
        got = cache.memo[key] = digest(_spec_text(spec), cache.offsets, cache.counts)
    return got


@functools.lru_cache(maxsize=256)
def _spec_text(spec: AttentionSpec) -> str:
    return repr(spec)


def _unpack(spec: AttentionSpec, data: np.ndarray) -> States:
    """A rank's payload as its (o, lse): the bytes _local_payload wrote (views, no copy)."""
    rows = (spec.batch, spec.num_heads, spec.seq_len)
    flat = data.view(np.float32)
    cut = math.prod(rows) * spec.head_size_v
    return (flat[:cut].reshape(*rows, spec.head_size_v),
            flat[cut:cut + math.prod(rows)].reshape(rows))


def local_states(cache: ShardedKVCache, r: int, call: Call,
                 into: States | None = None) -> States:
    """Shard r's states for the call (empty, with no launch, where no row sees it), written
    into ``into`` where given. Its runs are kept in the cache's memo for the next calls with
    the same spec, kv_start and row counts until the placement changes; its prepared
    launches, across appends."""
    session, kv = cache.shards[r]
    key = ("runs", r, call.spec, call.starts.tobytes(), call.rows.tobytes())
    runs = cache.memo.get(key)
    if runs is None:
        launches = shard_launches(call.spec, cache.offsets[r], cache.counts[r], call.lengths,
                                  call.starts, call.rows)
        if len(cache.memo) > 256:           # a caller cycling through many specs
            cache.memo.clear()
        runs = cache.memo[key] = shard_runs(call.spec, kv, launches)
    if not runs:
        return empty_states(call.spec, into)
    return shard_states(session, kv, call.spec, call.q, runs, into, cache.prepared[r])


def merge(cache: ShardedKVCache, session: Session, call: Call, states: list[States]) -> Any:
    """The shards' states as the splits of one reduce, where merge.py's rules (or the cache's
    ``merge`` setting) say: on ``session``'s device, or in numpy; the sink, and the padding
    rows of seqlens_q, are the reduce's."""
    spec = call.spec
    where, cache.last_merge = merge_place(spec, len(states), cache.merge)
    sink, rows = call.extras.get("head_sink"), call.extras.get("seqlens_q")
    if where == "host":
        return host_merge(spec, states, sink, rows)
    o_parts = np.stack([o for o, _ in states], axis=3)
    lse_parts = np.stack([lse for _, lse in states], axis=3)
    return session.reduce_states(reduce_spec(spec), o_parts, lse_parts, sink, seqlens_q=rows)


@functools.lru_cache(maxsize=256)
def reduce_spec(spec: AttentionSpec) -> AttentionSpec:
    """The reduce's spec for a call: its rows, heads, dtype, layout, sink and row counts."""
    return AttentionSpec(batch=spec.batch, seq_len=spec.seq_len, num_heads=spec.num_heads,
                         kv_num_heads=spec.kv_num_heads, head_size=spec.head_size,
                         v_head_size=spec.v_head_size, dtype=spec.dtype, q_layout=spec.q_layout,
                         causal=False, head_sink=spec.head_sink, seqlens_q=spec.seqlens_q,
                         return_lse=spec.return_lse)


def check_call(spec: Any, q: Any, cache: ShardedKVCache,
               tensors: Mapping[str, Any] | None) -> Call:
    """The call checked as run would check it against the unsharded cache."""
    _check_spec(spec, cache)
    if isinstance(q, DeviceTensor):
        raise SpecError("q", q, "a host array (every shard reads the query)")
    arrays = {"q": _as_array("q", q)}
    _check_dtype("q", arrays["q"], (spec.dtype,))
    _check_shape("q", arrays["q"], spec.q_shape, f"q_layout={spec.q_layout}")
    given = {} if tensors is None else tensors
    if not isinstance(given, Mapping):
        raise SpecError("tensors", tensors, "None or a mapping of head_sink / kv_start / seqlens_q")
    for name in given:
        if name not in EXTRAS or not getattr(spec, EXTRAS[name]):
            raise SpecError(f"tensors[{name!r}]", given[name], "absent: sharded_attention takes "
                            "head_sink, kv_start and seqlens_q, each when the spec asks for it")
    for name, field in EXTRAS.items():
        if getattr(spec, field) and name not in given:
            raise SpecError(f"tensors[{name!r}]", None, f"a tensor, because spec.{field} is True")
        if name in given:
            arrays[name] = _as_array(name, given[name])
    lengths = cache.lengths
    low = 1 if spec.seqlens_q else spec.seq_len
    if (lengths < low).any():
        raise SpecError("cache.lengths", lengths.tolist(), f"at least {low} token(s) per entry: "
                        "the query's own tokens are appended first")
    if spec.seqlens_q:
        _check_index("seqlens_q", arrays, spec.batch, 1, np.minimum(spec.seq_len, lengths),
                     "the number of query rows of batch b: 1 <= value <= min(seq_len, L_b)")
    if spec.kv_start:
        _check_index("kv_start", arrays, spec.batch, 0, lengths - 1,
                     "the first existing key of batch b: 0 <= value < L_b")
    if spec.head_sink:
        _check_sink(spec, arrays)
    starts = np.asarray(arrays.get("kv_start", np.zeros(spec.batch)), np.int64)
    rows = np.asarray(arrays.get("seqlens_q", np.full(spec.batch, spec.seq_len)), np.int64)
    q_arr = np.ascontiguousarray(arrays.pop("q"))
    return Call(spec, q_arr, arrays, lengths, starts, rows)


def _check_spec(spec: Any, cache: ShardedKVCache) -> None:
    if not isinstance(spec, AttentionSpec):
        raise SpecError("spec", spec, "an attnreg.AttentionSpec (cache.spec(...) makes one)")
    if spec in cache.checked_specs:
        return
    if spec.bias:
        raise SpecError("spec.bias", True, "False: sharded_attention takes no bias")
    want = cache.spec(spec.num_heads, spec.seq_len, **{f: getattr(spec, f) for f in CALL_FIELDS})
    for field in type(spec).model_fields:
        if getattr(spec, field) != getattr(want, field):
            raise SpecError(f"spec.{field}", getattr(spec, field), f"{getattr(want, field)!r}, "
                            "what the sharded cache holds (cache.spec(num_heads, seq_len, ...) "
                            "makes the spec)")
    if len(cache.checked_specs) > 256:       # a caller cycling through many specs
        cache.checked_specs.clear()
    cache.checked_specs.add(spec)
