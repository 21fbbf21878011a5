"""`attnreg bench --suite context-parallel`: a decode step (GQA 32/8, H=128, float16) over L
keys on one device, against the same L keys split over N ranks of a torch.distributed group
(gloo), one rank per device where the backend lists N devices, else ranks sharing them.

Every time is wall clock per call, host query in and host output back, as an application
sees it (the one-device rows run Session.run on a KVCache the same way). The sharded row
splits its median into the ranks' own attention (local; the slowest rank's beside it), the
all_gather of the states (exchange: it also waits for the slowest rank; gloo's floor, an
all_gather of the same bytes alone, beside it) and the merge (where the rules put it, and,
in a second row, on the device); the merge's share is exchange + merge over the whole call.
The issue's target compares the sharded call over L with one device over L / N (ratio
``vs 1dev L/N``).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import api
from ..caps import DeviceCaps
from ..distributed import ShardedKVCache, sharded_attention
from ..distributed.exchange import HEADER
from ..session import Session
from ..spec import AttentionSpec
from ..tensors import check_tensors
from ..testing import compare, expected
from .bench_report import Row

NQ, NKV, H, DTYPE = 32, 8, 128, "float16"
CHUNK = 8192                # tokens per append while filling a cache
_EXPECTED: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def devices_for(backend: str, device: str | None) -> list[DeviceCaps]:
    """The backend's available devices the ranks take in turn: its GPUs where it has some."""
    devs = [d for d in api.devices(backend) if d.available]
    if device is not None:
        devs = [d for d in devs if device in (d.id, d.name) or device.lower() in d.name.lower()]
    gpus = [d for d in devs if d.device_type == "gpu"]
    return gpus or devs


def run(backends: Sequence[str], *, device: str | None, length: int, ranks: int, iters: int,
        warmup: int, check: bool, flags: Mapping[str, Any] | None = None,
        log: Callable[[str], None] = print) -> list[Row]:
    """The suite's rows for every backend (a backend without a device: a row saying so)."""
    import torch.multiprocessing as mp
    rows = []
    for backend in backends:
        devs = devices_for(backend, device)
        if not devs:
            rows.append(Row("context-parallel", f"decode-f16-L{length}-cp{ranks}", backend, "-",
                            "n/a: no device", None, float("nan"), None, None, None))
            continue
        if len(devs) < ranks:
            log(f"  {backend}: {ranks} ranks on {len(devs)} device(s) ({', '.join(d.id for d in devs)}):"
                " ranks share a device")
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        where = (backend, [d.id for d in devs], dict(flags or {}))
        args = (ranks, _free_port(), where, length, iters, warmup, check, out)
        try:
            mp.spawn(_rank, args=args, nprocs=ranks, join=True)
            got = out.get()
        except Exception as exc:        # one backend failing must not hide the others
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            log(f"  {backend} context-parallel: FAILED {msg}")
            rows.append(Row("context-parallel", f"decode-f16-L{length}-cp{ranks}", backend, "-",
                            f"FAILED: {msg[:80]}", None, float("nan"), None, None, None))
            continue
        rows += [Row(**r) for r in got]
        for r in got:
            log(f"  {backend} {r['case']}: {r['wall_us']:.1f} us ({r['kernels']})")
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, where: tuple[str, list[str], dict[str, Any]],
          length: int, iters: int, warmup: int, check: bool, out: Any) -> None:
    """One rank: rank 0 times one device first (the others wait), then all time the
    sharded call; rank 0 puts the rows on ``out``. ``where``: the backend, the device ids
    the ranks take in turn, the session flags."""
    import torch.distributed as dist
    # every rank on this host: gloo over loopback, whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    backend, dev_ids, flags = where
    dev = dev_ids[rank % len(dev_ids)]
    rows = []
    if rank == 0:
        for n in (length, -(-length // world)):
            with Session(backend=backend, device=dev, flags=flags) as s:
                rows.append(_one_device(s, backend, dev, n, iters, warmup, check and n == length))
    dist.barrier()
    with Session(backend=backend, device=dev, flags=flags) as session:
        sharded = _sharded(session, backend, dev_ids, length, world, iters, warmup, check)
    if rank == 0:
        for row in sharded:
            row["extra"]["vs_1dev_L/N"] = row["wall_us"] / rows[1]["wall_us"]
            row["extra"]["vs_1dev_L"] = row["wall_us"] / rows[0]["wall_us"]
        out.put([*rows, *sharded])
    dist.barrier()
    dist.destroy_process_group()


def _chunks(length: int) -> Any:
    """The cache's tokens, the same on every rank: K and V chunks [1, n, Nkv, H] (a prefix of
    a longer cache's: chunk i is the same for every length that holds it whole)."""
    for i, t in enumerate(range(0, length, CHUNK)):
        yield _chunk(i, min(CHUNK, length - t))


@functools.cache
def _chunk(i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk i of n tokens, drawn once per process (the bench fills several caches)."""
    rng = np.random.default_rng(1000 + i)
    k, v = ((rng.standard_normal((1, n, NKV, H), np.float32) * 0.5).astype(DTYPE)
            for _ in range(2))
    k.flags.writeable = v.flags.writeable = False
    return k, v


def _query(spec: AttentionSpec) -> np.ndarray:
    return (np.random.default_rng(7).standard_normal(spec.q_shape, np.float32) * 0.5).astype(DTYPE)


def _times(call: Callable[[], Any], iters: int, warmup: int, sync: Callable[[], Any]
           ) -> list[float]:
    ts = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        call()
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return ts


def _one_device(s: Session, backend: str, dev: str, length: int, iters: int, warmup: int,
                check: bool) -> dict[str, Any]:
    """Session.run over one KVCache of ``length`` keys on one device."""
    cache = s.kv_cache(batch=1, kv_num_heads=NKV, head_size=H, capacity=length, dtype=DTYPE)
    for k, v in _chunks(length):
        cache.append(k, v)
    spec = cache.spec(NQ, 1, causal=True)
    q = _query(spec)
    t = cache.tensors(q)
    _, plan = s.run_with_plan(spec, t)
    ts = _times(lambda: s.run(spec, t), iters, warmup, lambda: None)
    err = _error(spec, lambda sp: s.run(sp, cache.tensors(q)), length) if check else None
    wall = statistics.median(ts) * 1e6
    return dict(suite="context-parallel", case=f"decode-f16-L{length}-1dev", backend=backend,
                device=dev, kernels=" -> ".join(plan.kernels), gpu_us=None, wall_us=wall,
                gb_s=_bytes(length) / wall / 1e3, tflops=None, max_err=err, extra={})


# The sharded rows: (case suffix, merge, gather, a barrier before every call). The first is
# the default call timed as it always was; "back-to-back" times it as the one-device rows
# are (a decode loop's steady state: the ranks meet in each call's exchange); the others fix
# the exchange ("other": the way the rules did not choose, named in the suffix) or the merge.
SHARDED_ROWS = (("", "auto", "auto", True), ("-back-to-back", "auto", "auto", False),
                ("-{other}", "auto", "other", True), ("-device-merge", "device", "auto", True))


def _sharded(session: Session, backend: str, dev_ids: list[str], length: int, world: int,
             iters: int, warmup: int, check: bool) -> list[dict[str, Any]]:
    """sharded_attention over ``length`` keys split over the group's ranks, one row per
    SHARDED_ROWS entry, each with the slowest rank's local time and gloo's floor (an
    all_gather of the same bytes alone)."""
    import torch.distributed as dist
    # the first (and only) round of a call sized to the decode's states (exchange.py)
    states = 4 * NQ * (H + 1)
    cache = ShardedKVCache(session, batch=1, kv_num_heads=NKV, head_size=H, dtype=DTYPE,
                           shard_capacity=-(-length // world), group=dist.group.WORLD,
                           exchange_bytes=HEADER + states)
    for k, v in _chunks(length):
        cache.append(k, v)
    spec = cache.spec(NQ, 1, causal=True)
    q = _query(spec)
    used = len({dev_ids[r % len(dev_ids)] for r in range(world)})
    floor = _gloo_floor(HEADER + states, world, iters, warmup)
    rows = []
    assert cache.channel is not None
    chosen = cache.channel.way
    other = "all_gather" if chosen == "point_to_point" else "point_to_point"
    for suffix, merge, gather, synced in SHARDED_ROWS:
        cache.merge, cache.gather = merge, other if gather == "other" else gather
        suffix = suffix.format(other=other.replace("_", "-"))
        parts: dict[str, list[float]] = {"local_s": [], "exchange_s": [], "merge_s": []}

        def call(parts: dict[str, list[float]] = parts) -> None:
            sharded_attention(spec, q, cache)
            for key, val in cache.last_timings.items():
                parts[key].append(val)

        ts = _times(call, iters, warmup, dist.barrier if synced else lambda: None)
        err = _error(spec, lambda sp: sharded_attention(sp, q, cache), length) if check else None
        wall = statistics.median(ts) * 1e6
        med = {k[:-2] + "_us": statistics.median(v[warmup:]) * 1e6 for k, v in parts.items()}
        locals_us = [0.0] * world
        dist.all_gather_object(locals_us, med["local_us"])
        share = (med["exchange_us"] + med["merge_us"]) / wall
        placed = "the host" if cache.last_merge.endswith("on_host") or merge == "host" \
            else "the device"
        rows.append(dict(
            suite="context-parallel", backend=backend, device=f"{world} ranks on {used} dev",
            case=f"decode-f16-L{length}-cp{world}{suffix}",
            kernels=f"local {med['local_us']:.0f} (slowest rank {max(locals_us):.0f}) + "
                    f"{cache.channel.way} {med['exchange_us']:.0f} "
                    f"(gloo all_gather floor {floor:.0f}) + merge {med['merge_us']:.0f} us on "
                    f"{placed} (merge share {share:.0%})",
            gpu_us=None, wall_us=wall, gb_s=_bytes(length) / wall / 1e3, tflops=None,
            max_err=err, extra={**med, "merge_share": share, "devices": dev_ids[:world],
                                "local_ranks_us": locals_us, "gloo_floor_us": floor,
                                "merge_rule": cache.last_merge, "gather_rule": cache.gather_rule,
                                "barrier_before_call": synced}))
    return rows


def _gloo_floor(nbytes: int, world: int, iters: int, warmup: int) -> float:
    """Median us of an all_gather of ``nbytes`` per rank alone (the exchange's floor)."""
    import torch
    import torch.distributed as dist
    src = torch.zeros(nbytes, dtype=torch.uint8)
    outs = [torch.empty_like(src) for _ in range(world)]
    ts = _times(lambda: dist.all_gather(outs, src), iters, warmup, dist.barrier)
    return statistics.median(ts) * 1e6


def _bytes(length: int) -> int:
    """K and V of every key, the bytes a decode must read."""
    return 2 * length * NKV * H * 2


def _error(spec: AttentionSpec, call: Callable[[AttentionSpec], Any], length: int) -> float:
    """The max error of the call's (out, lse) against the float64 reference (rank 0 checks;
    the others make the call, as every rank must)."""
    spec = spec.replace(return_lse=True)
    got = call(spec)
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0.0
    ref_spec = AttentionSpec(batch=1, seq_len=1, past_len=length - 1, num_heads=NQ,
                             kv_num_heads=NKV, head_size=H, dtype=DTYPE, kv_layout="BSNH",
                             return_lse=True)
    if length not in _EXPECTED:             # the float64 reference, once per length
        k, v = (np.concatenate(x, axis=1) for x in zip(*_chunks(length)))
        t = check_tensors(ref_spec, {"q": _query(spec), "k": k, "v": v})
        _EXPECTED[length] = expected(ref_spec, t)
    err, problem = compare(ref_spec, got, _EXPECTED[length])
    if problem:
        raise AssertionError(f"{spec.short()}: {problem}")
    return err
