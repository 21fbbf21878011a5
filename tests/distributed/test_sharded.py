"""sharded_attention over shards on several Sessions of one process, against the float64
reference on the unsharded cache: windows, left padding and query row counts across shard
boundaries, sinks counted once, ALiBi, causal prefill (the diagonal shard, shards no row sees),
int8 / int4 and paged shards, shards on lavapipe, PoCL and the reference at once; the
placement rule of appends; and the refusals. Process groups: test_ranks.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.distributed import ShardedKVCache, sharded_attention
from attnreg.distributed.pieces import shard_launches
from tests.support import require_devices

from .shards import check, reference, shard_arrays, unshard

NQ, NKV, H = 4, 2, 32


@pytest.fixture(scope="module")
def ref3() -> Iterator[list[attnreg.Session]]:
    sessions = [attnreg.Session(backend="reference") for _ in range(3)]
    yield sessions
    for s in sessions:
        s.close()


def _cache(sessions: list[attnreg.Session], caps: tuple[int, ...], appends: tuple[int, ...],
           seed: int = 0, **kw: Any) -> ShardedKVCache:
    kw.setdefault("dtype", "float32")
    cache = ShardedKVCache(sessions, batch=2, kv_num_heads=NKV, head_size=H,
                           shard_capacity=list(caps), **kw)
    rng = np.random.default_rng(seed)
    for a in appends:
        cache.append(*(rng.standard_normal((2, a, NKV, H)).astype(cache.dtype) for _ in range(2)))
    return cache


def _call(cache: ShardedKVCache, seq_len: int = 1, seed: int = 1, **fields: Any) -> float:
    """One sharded call with the fields' tensors drawn at random, checked against the
    reference on the unsharded cache; the max error."""
    rng = np.random.default_rng(seed)
    lengths = cache.lengths
    extras: dict[str, Any] = {}
    if fields.get("head_sink"):
        extras["head_sink"] = rng.standard_normal(NQ).astype(np.float32)
    if fields.get("kv_start"):
        extras["kv_start"] = np.array([int(rng.integers(0, n)) for n in lengths], np.int32)
    if fields.get("seqlens_q"):
        extras["seqlens_q"] = np.array([min(n, seq_len - b) for b, n in enumerate(lengths)],
                                       np.int32)
    spec = cache.spec(NQ, seq_len, return_lse=True, **fields)
    q = rng.standard_normal(spec.q_shape).astype(spec.dtype)
    got = sharded_attention(spec, q, cache, tensors=extras)
    parts = [shard_arrays(kv) for _, (_, kv) in sorted(cache.shards.items())]
    whole = unshard(parts, cache.offsets, cache.counts, cache.capacities, cache.layout)
    return check(spec, got, reference(spec, q, whole, lengths, extras), f"{fields}")


DECODES = {
    "window-ends-inside-a-shard": {"local_window": 13},
    "sink-once-left-padding-alibi": {"head_sink": True, "kv_start": True, "alibi_max_bias": 8.0},
    "softcap-window-shorter-than-a-shard": {"softcap": 5.0, "local_window": 3, "q_layout": "BNSH"},
}


@pytest.mark.parametrize("fields", DECODES.values(), ids=DECODES.keys())
def test_decode_across_shards(ref3: list[attnreg.Session], fields: dict[str, Any]) -> None:
    cache = _cache(ref3, (8, 8, 8), (5, 9, 6))       # the second append spills into shard 1
    _call(cache, **fields)


def test_entries_of_different_lengths(ref3: list[attnreg.Session]) -> None:
    """release(1) restarts entry 1 in the active shard: its keys there start at its position 0."""
    cache = _cache(ref3, (8, 8, 8), (7, 4))
    cache.release(1)
    cache.append(*(np.ones((2, 3, NKV, H), np.float32) * x for x in (0.5, -1.0)))
    assert cache.lengths.tolist() == [14, 3] and cache.offsets[1].tolist() == [8, 0]
    _call(cache, local_window=5, head_sink=True)


PREFILLS = {
    "causal-window-seqlens-q": {"causal": True, "local_window": 9, "seqlens_q": True},
    "causal-alibi-sink": {"causal": True, "alibi_max_bias": 4.0, "head_sink": True},
    "bidirectional-two-sided-window": {"causal": False, "local_window": 6, "right_window": 2,
                                       "kv_start": True},
}


@pytest.mark.parametrize("fields", PREFILLS.values(), ids=PREFILLS.keys())
def test_prefill_across_shards(ref3: list[attnreg.Session], fields: dict[str, Any]) -> None:
    """20 query rows over shards of 8: rows before a shard, on its diagonal and past it."""
    cache = _cache(ref3, (8, 8, 8), (4, 20))
    _call(cache, seq_len=20, **fields)


def test_the_merge_in_numpy(ref3: list[attnreg.Session]) -> None:
    """merge="host": the reduce in numpy instead of one on the device (the sink and the
    padding rows of seqlens_q included), in q's layout and dtype."""
    cache = _cache(ref3, (8, 8, 8), (4, 20), merge="host", dtype="float16")
    _call(cache, seq_len=12, causal=True, head_sink=True, seqlens_q=True, q_layout="BNSH")
    _call(cache, local_window=13, head_sink=True)


def test_causal_prefill_runs_only_the_shards_rows_see() -> None:
    """Rows 0..9 at positions 14..23 of shards of 8 keys, window 5: shard 0 (keys 0..7) is
    out of every window and runs nothing; shard 1 (keys 8..15) runs the rows whose windows
    reach it, 14 and 15 on its diagonal and 16..19 past its end, as one piece moved by 4
    positions (the causal bound as right_window 4, the window as 1); shard 2 runs rows
    2..9 on its diagonal, as they are."""
    spec = attnreg.AttentionSpec(batch=1, seq_len=10, past_len=14, num_heads=NQ,
                                 kv_num_heads=NKV, head_size=H, causal=True, local_window=5)

    def launches(r: int) -> list[tuple[tuple[int, int], tuple[bool, int, int]]]:
        got = shard_launches(spec, np.array([8 * r]), np.array([8]), np.array([24]),
                             np.array([0]), np.array([10]))
        return [(p.rows, p.bounds) for launch in got for p in launch.pieces]

    assert launches(0) == []
    assert launches(1) == [((0, 6), (False, 1, 4))]
    assert launches(2) == [((2, 10), (True, 5, -1))]


@pytest.mark.parametrize("layout,kv_dtype", [("BNSH", "int8"), ("paged", "int4")])
def test_quantized_and_paged_shards(ref3: list[attnreg.Session], layout: str,
                                    kv_dtype: str) -> None:
    cache = _cache(ref3[:2], (12, 12), (9, 10), dtype="float16", layout=layout, kv_dtype=kv_dtype,
                   page_size=4 if layout == "paged" else None)
    _call(cache, local_window=15, head_sink=True)
    _call(cache, seq_len=6, causal=True, seqlens_q=True)


def test_shards_on_lavapipe_pocl_and_the_reference() -> None:
    """Three devices of one process (their shards run concurrently); the merge on the first
    (merge="device": a reduce on lavapipe)."""
    sessions = [attnreg.Session(backend=b, device=require_devices(b)[0].id)
                for b in ("webgpu", "opencl", "reference")]
    try:
        cache = _cache(sessions, (8, 8, 8), (5, 9, 6), dtype="float16", merge="device")
        _call(cache, local_window=13, head_sink=True)
        _call(cache, seq_len=6, causal=True)
    finally:
        for s in sessions:
            s.close()


def test_a_decode_loop_on_lavapipe_and_pocl_shards() -> None:
    """Call, append, call: each shard's plain decode runs through its prepared launch, kept
    across appends (the cache's own lengths on the device), the merge in numpy and, on the
    last step, on lavapipe."""
    sessions = [attnreg.Session(backend=b, device=require_devices(b)[0].id)
                for b in ("webgpu", "opencl")]
    try:
        cache = _cache(sessions, (8, 8), (7,), dtype="float16")
        for step in range(3):
            cache.merge = "device" if step == 2 else "auto"
            _call(cache, seed=10 + step, causal=True)
            rng = np.random.default_rng(step)
            cache.append(*(rng.standard_normal((2, 2, NKV, H)).astype(np.float16)
                           for _ in range(2)))
        assert all(len(p) == 1 for p in cache.prepared.values()), cache.prepared
    finally:
        for s in sessions:
            s.close()


def test_appends_fill_shards_in_order(ref3: list[attnreg.Session]) -> None:
    cache = _cache(ref3, (4, 6, 5), (3,))
    assert cache.counts.tolist() == [[3, 3], [0, 0], [0, 0]]
    new = np.zeros((2, 5, NKV, H), np.float32)
    cache.append(new, new)              # 1 fills shard 0, 4 start shard 1 at position 4
    assert cache.counts[:, 0].tolist() == [4, 4, 0] and cache.offsets[1].tolist() == [4, 4]
    with pytest.raises(attnreg.SpecError, match=r"k_new.shape\[1\].*at most 7 new tokens"):
        cache.append(*(np.zeros((2, 8, NKV, H), np.float32),) * 2)
    assert cache.lengths.tolist() == [8, 8]          # a refused append writes nothing
    with pytest.raises(attnreg.SpecError, match="v_new"):
        cache.append(new, new[:, :, :1])


def test_refusals(ref3: list[attnreg.Session]) -> None:
    cache = _cache(ref3[:2], (8, 8), (6,))
    spec = cache.spec(NQ, 1)
    q = np.zeros(spec.q_shape, np.float32)
    refusals = [
        ((spec.replace(kv_capacity=17), q, cache), "spec.kv_capacity"),
        ((spec.replace(seqlens_k=False), q, cache), "spec.seqlens_k"),
        ((cache.spec(NQ, 1, bias=True), q, cache), "spec.bias"),
        ((spec, q.astype(np.float16), cache), "dtype"),
        ((spec, ref3[0].tensor(q), cache), "a host array"),
        ((spec, q, "cache"), "ShardedKVCache"),
        ((cache.spec(NQ, 1, head_sink=True), q, cache), "head_sink"),
        ((cache.spec(NQ, 7), np.zeros((2, 7, NQ, H), np.float32), cache), "at least 7"),
    ]
    for args, match in refusals:
        with pytest.raises(attnreg.SpecError, match=match):
            sharded_attention(*args)
    with pytest.raises(attnreg.SpecError, match="group"):
        sharded_attention(spec, q, cache, group=object())
    with pytest.raises(attnreg.SpecError, match="kv_start"):
        sharded_attention(spec, q, cache, tensors={"kv_start": np.zeros(2, np.int32)})
    with pytest.raises(attnreg.SpecError, match="shard_capacity"):
        ShardedKVCache(ref3, batch=1, kv_num_heads=1, head_size=8, shard_capacity=[4, 4])
    with pytest.raises(attnreg.SpecError, match="merge"):
        ShardedKVCache(ref3, batch=1, kv_num_heads=1, head_size=8, shard_capacity=4, merge="gpu")


def test_attnreg_and_in_process_shards_need_no_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"       # any import of torch fails
            "import numpy as np, attnreg\n"
            "from attnreg.distributed import ShardedKVCache, sharded_attention\n"
            "s = attnreg.Session(backend='reference')\n"
            "c = ShardedKVCache([s, s], batch=1, kv_num_heads=1, head_size=8, shard_capacity=4,"
            " dtype='float32')\n"
            "x = np.ones((1, 6, 1, 8), np.float32); c.append(x, x)\n"
            "out = sharded_attention(c.spec(1), np.ones((1, 1, 1, 8), np.float32), c)\n"
            "assert np.allclose(out, 1.0), out\n"
            "try:\n"
            "    ShardedKVCache(s, batch=1, kv_num_heads=1, head_size=8, shard_capacity=4,"
            " group=object())\n"
            "except attnreg.SpecError as e:\n"
            "    assert 'attnreg[distributed]' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('a group without torch was taken')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
