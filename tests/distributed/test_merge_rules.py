"""The sharded call's policy and its numpy merge: where the merge runs and how the ranks
exchange states are named rules (attnreg/distributed/rules.py) whose choice the cache reports;
the numpy merge gives the reference's reduce, the sink, empty shards, padding rows and
non-finite states included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference
from attnreg.distributed import ShardedKVCache, sharded_attention
from attnreg.distributed.merge import host_merge, merge_place
from attnreg.distributed.rules import GATHER_RULES, MERGE_RULES, POINT_TO_POINT_RANKS, choose
from attnreg.testing import compare

NQ, H = 4, 16
DECODE = attnreg.AttentionSpec(seq_len=1, past_len=99, num_heads=32, kv_num_heads=8,
                               head_size=128, dtype="float16")


def test_rules_are_named_with_a_why_and_a_measurement() -> None:
    for rule in (*MERGE_RULES, *GATHER_RULES):
        assert rule.name.startswith("cp_") and rule.why and not rule.why.endswith(".")
        assert all(m.startswith("ci/results/") for m in rule.measured), rule


def test_a_decode_merges_in_numpy_and_a_long_prefill_on_the_device() -> None:
    assert merge_place(DECODE, 2, "auto") == ("host", "cp_merge_small_states_on_host")
    prefill = DECODE.replace(seq_len=2048, past_len=0, causal=True)
    assert merge_place(prefill, 2, "auto") == ("device", "cp_merge_large_states_on_device")
    assert merge_place(prefill, 2, "host") == ("host", "merge='host'")
    assert merge_place(DECODE, 2, "device") == ("device", "merge='device'")


def test_a_few_ranks_with_cores_to_spare_exchange_point_to_point() -> None:
    assert choose(GATHER_RULES, "auto", "gather", ranks=2, cores=32) == \
        ("point_to_point", "cp_gather_point_to_point_few_ranks")
    assert choose(GATHER_RULES, "auto", "gather", ranks=POINT_TO_POINT_RANKS + 1,
                  cores=1024) == ("all_gather", "cp_gather_all_gather")
    assert choose(GATHER_RULES, "auto", "gather", ranks=2, cores=2) == \
        ("all_gather", "cp_gather_all_gather")
    assert choose(GATHER_RULES, "all_gather", "gather", ranks=2, cores=32) == \
        ("all_gather", "gather='all_gather'")


def _states(spec: attnreg.AttentionSpec, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (spec.batch, spec.num_heads, spec.seq_len)
    return [(rng.standard_normal((*shape, spec.head_size_v)).astype(np.float32),
             (rng.standard_normal(shape) * 4).astype(np.float32)) for _ in range(n)]


def _want(spec: attnreg.AttentionSpec, states: list[Any], sink: Any, rows: Any
          ) -> tuple[np.ndarray, np.ndarray]:
    o = np.stack([x for x, _ in states], axis=3)
    lse = np.stack([x for _, x in states], axis=3)
    out, lse_out = reference.reduce(spec, o, lse, sink, rows)
    return reference.out_layout(spec, out), lse_out


CASES = {
    "all-finite": {},
    "sink": {"sink": True},
    "an-empty-shard-row": {"empty": True},
    "padding-rows-and-sink": {"sink": True, "rows": True},
    "nan-lse": {"poison": "lse"},
    "inf-in-o": {"poison": "o"},
}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_numpy_merge_is_the_reference_reduce(case: dict[str, Any], dtype: str) -> None:
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=20, num_heads=NQ, kv_num_heads=2,
                                 head_size=H, dtype=dtype, return_lse=True,
                                 head_sink=bool(case.get("sink")),
                                 seqlens_q=bool(case.get("rows")))
    states = _states(spec, 3, seed=len(str(case)))
    sink = np.linspace(-1, 2, NQ).astype(np.float32) if case.get("sink") else None
    rows = np.array([3, 1], np.int32) if case.get("rows") else None
    if case.get("empty"):
        states[1][1][0, 2, 1] = -np.inf
        states[1][0][0, 2, 1] = np.nan          # an empty split's o is ignored
    if rows is not None:                        # padding rows: every shard empty there
        for o, lse in states:
            lse[1, :, 1:] = -np.inf
            o[1, :, 1:] = 0
    if case.get("poison") == "lse":
        states[0][1][1, 0, 0] = np.nan
    if case.get("poison") == "o":
        states[2][0][0, 1, 2, 5] = np.inf
    got = host_merge(spec, states, sink, rows)
    _, problem = compare(spec, got, _want(spec, states, sink, rows))
    assert not problem, problem
    assert got[0].dtype == np.dtype(dtype) and got[0].flags.c_contiguous


def test_the_cache_reports_what_placed_its_merge() -> None:
    s = attnreg.Session(backend="reference")
    try:
        cache = ShardedKVCache([s, s], batch=1, kv_num_heads=1, head_size=8, shard_capacity=4,
                               dtype="float32")
        x = np.ones((1, 6, 1, 8), np.float32)
        cache.append(x, x)
        spec = cache.spec(2)
        sharded_attention(spec, np.ones(spec.q_shape, np.float32), cache)
        assert cache.last_merge == "cp_merge_small_states_on_host" and cache.gather_rule == ""
        cache.merge = "device"
        sharded_attention(spec, np.ones(spec.q_shape, np.float32), cache)
        assert cache.last_merge == "merge='device'"
        with pytest.raises(attnreg.SpecError, match="gather"):
            cache.gather = "ring"
    finally:
        s.close()
