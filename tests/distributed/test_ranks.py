"""sharded_attention across processes: 2 and 3 ranks spawned with torch's spawn and joined by
gloo, each holding one shard on its own backend (lavapipe, PoCL, the reference, mixed),
against the float64 reference on the unsharded cache; and a rank that raises, hangs or dies
mid-call makes every other rank raise RankError within its timeout, never hang.

The ranks are one pool for the module (tests/distributed/ranks.py): starting a rank (torch,
the devices, the programs) costs seconds, so every case reuses them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from tests.support import missing, require_devices

from .ranks import Case, Pool
from .shards import check, reference, unshard

try:
    import torch.distributed as dist
except ImportError:                     # the distributed extra brings torch
    dist = None  # type: ignore[assignment]

# A window that starts inside the first shard, a sink and left padding, across shards of 8
# keys filled by appends of 5 / 9 / 3 tokens (the second spills into the next shard).
DECODE = Case(caps=(8, 8, 8), appends=(5, 9, 3),
              fields={"local_window": 11, "head_sink": True, "kv_start": True})
# A plain decode over two shards (no window, no extra tensors: a prepared launch per shard).
PLAIN = Case(caps=(12, 12), appends=(7, 9), seed=3)
# A causal prefill of 10 rows whose keys span both shards (the diagonal shard, a past one).
PREFILL = Case(caps=(12, 12), appends=(4, 10), seq_len=10, seed=1,
               fields={"causal": True, "local_window": 9, "seqlens_q": True})


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    if dist is None or not dist.is_available() or not dist.is_gloo_available():
        missing("torch.distributed with gloo (pip install 'attnreg[distributed]')")
    p = Pool(3)
    yield p
    p.close()


def _check_all(case: Case, got: dict[int, tuple[str, Any]], what: str) -> None:
    """Every rank's result against the reference on the shards put back together."""
    for r, (status, value) in got.items():
        assert status == "ok", f"{what}: rank {r} {status}: {value}"
    ranks = sorted(got)
    first = got[ranks[0]][1]
    whole = unshard([got[r][1]["shard"] for r in ranks], first["offsets"], first["counts"],
                    case.caps, case.layout)
    _, q, extras = case.inputs()
    spec = first["spec"]
    want = reference(spec, q, whole, first["counts"].sum(axis=0), extras)
    for r in ranks:
        check(spec, got[r][1]["out"], want, f"{what}, rank {r}")


def _job(case: Case, group: str, backends: tuple[str, ...], **kw: Any) -> tuple[str, dict[str, Any]]:
    return "attend", {"case": case, "group": group, "backends": backends, **kw}


@pytest.mark.parametrize("gather", ["point_to_point", "all_gather"])
def test_two_ranks_on_the_reference(pool: Pool, gather: str) -> None:
    for case in (DECODE, PREFILL):
        case = replace(case, gather=gather)
        n = len(case.caps)
        backends = ("reference",) * n
        group = "01" if n == 2 else "world"
        got = pool.run({r: _job(case, group, backends) for r in range(n)})
        _check_all(case, got, f"{n} reference ranks, {gather}")


@pytest.mark.parametrize("gather", ["point_to_point", "all_gather"])
def test_states_past_the_first_round_take_a_second(pool: Pool, gather: str) -> None:
    """A first round of 1 KiB (its header and 512 bytes of states): the prefill's states
    (about 10 KiB a rank) end in a second round."""
    case = replace(PREFILL, gather=gather, exchange_bytes=1024)
    got = pool.run({r: _job(case, "01", ("reference",) * 2) for r in range(2)})
    _check_all(case, got, f"two rounds, {gather}")


def test_three_ranks_of_lavapipe_pocl_and_the_reference(pool: Pool) -> None:
    """Each rank merges on its own device (merge="device": a reduce on lavapipe, PoCL and
    the reference)."""
    require_devices("webgpu")
    require_devices("opencl")
    backends = ("webgpu", "opencl", "reference")
    case = replace(DECODE, merge="device")
    got = pool.run({r: _job(case, "world", backends) for r in range(3)})
    _check_all(case, got, "webgpu + opencl + reference ranks")


def test_calls_after_calls_reuse_the_exchange_buffers(pool: Pool) -> None:
    """A second call on the same cache, with another query, gets its own result (the states
    are written into, and merged from, buffers kept across calls; a plain decode launches
    through a prepared run, its query written into the same device tensor)."""
    require_devices("webgpu")
    require_devices("opencl")
    backends = ("opencl", "webgpu")
    first = pool.run({r: _job(PLAIN, "01", backends) for r in range(2)})
    _check_all(PLAIN, first, "the first call")
    other = replace(PLAIN, seed=5)
    again = pool.run({r: ("again", {"case": other}) for r in range(2)})
    ranks = sorted(first)
    f = first[ranks[0]][1]
    whole = unshard([first[r][1]["shard"] for r in ranks], f["offsets"], f["counts"],
                    PLAIN.caps, PLAIN.layout)
    _, q, extras = other.inputs()
    want = reference(f["spec"], q, whole, f["counts"].sum(axis=0), extras)
    for r in ranks:
        status, out = again[r]
        assert status == "ok", f"rank {r} {status}: {out}"
        check(f["spec"], out, want, f"the second call, rank {r}")


def test_two_ranks_of_pocl_and_lavapipe_prefill(pool: Pool) -> None:
    require_devices("webgpu")
    require_devices("opencl")
    got = pool.run({r: _job(PREFILL, "01", ("opencl", "webgpu")) for r in range(2)})
    _check_all(PREFILL, got, "opencl + webgpu ranks, causal prefill")


@pytest.mark.parametrize("gather", ["point_to_point", "all_gather"])
def test_a_rank_that_raises_mid_call(pool: Pool, gather: str) -> None:
    """Rank 1's Session is closed before the call: its shard fails inside the call; it raises
    its own ClosedError, the others RankError naming it; the group stays usable."""
    backends = ("reference",) * 3
    case = replace(DECODE, gather=gather)
    jobs = {r: _job(case, "world", backends, timeout=20, close_session=r == 1) for r in range(3)}
    got = pool.run(jobs, timeout=60)
    assert got[1][0] == "raised" and got[1][1][0] == "ClosedError", got[1]
    for r in (0, 2):
        status, (kind, text, ranks, _) = got[r]
        assert (status, kind, ranks) == ("raised", "RankError", (1,)), got[r]
        assert "rank 1 of 3 failed" in text and "ClosedError" in text, text
    got = pool.run({r: _job(case, "world", backends) for r in range(3)})
    _check_all(case, got, "the call after a failed one")


def test_a_rank_that_hangs_then_dies(pool: Pool) -> None:
    """Ranks 0 and 1 call; rank 2 made the cache but never calls: they raise RankError when
    their 1.5 s run out. Then rank 2 is killed while they call again: RankError again, within
    the timeout. (Last in the module: the pool's group is broken afterwards.)"""
    backends = ("reference",) * 3
    pool.send({2: _job(DECODE, "world", backends, then_sleep=60)})
    t0 = time.monotonic()
    got = pool.run({r: _job(DECODE, "world", backends, timeout=1.5) for r in (0, 1)}, timeout=30)
    took = time.monotonic() - t0
    for r in (0, 1):
        status, (kind, text, _, _) = got[r]
        assert (status, kind) == ("raised", "RankError"), got[r]
        assert "did not all answer" in text, text
    assert took < 15, took
    pool.kill(2)
    t0 = time.monotonic()
    got = pool.run({r: ("again", {"case": DECODE}) for r in (0, 1)}, timeout=30)
    for r in (0, 1):
        assert got[r][0] == "raised" and got[r][1][0] == "RankError", got[r]
    assert time.monotonic() - t0 < 15
