"""What bounds a sharded decode (`attnreg bench --suite context-parallel`'s call): on every
rank of a 2-rank gloo group, one device each, the kernel alone (profiling events), the
runtime's launch without transfers, a Session.run around it (out, and out + lse, back), the
host <-> device transfers a run adds, the sharded call's phases with each exchange (back to
back and with a barrier before every call), gloo's floors for the exchange's bytes (one
all_gather, one isend / irecv pair) and the numpy merge alone::

    python3 -m bench.cp_bounds --backend opencl --length 262144 --iters 50    # from the checkout
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

NQ, NKV, H = 32, 8, 128


def _med(f: Callable[[], Any], n: int, sync: Callable[[], Any] | None = None) -> float:
    """Median microseconds of f over n calls, after 5 untimed ones."""
    ts = []
    for i in range(n + 5):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        f()
        if i >= 5:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _runs(s: Any, kv: Any, n: int, say: Callable[[str], None]) -> None:
    """One device: the kernel, the launch, Session.run, the transfers."""
    sp1 = kv.spec(NQ, 1, causal=True)
    spl = sp1.replace(return_lse=True)
    q = (np.random.default_rng(7).standard_normal(sp1.q_shape) * .5).astype(np.float16)
    t = kv.tensors(q)
    _, plan = s.run_with_plan(spl, t)
    rt = s.device_runtime(s.home_device())
    qt, small = s.tensor(q), s.tensor(np.zeros(NQ * H, np.float16))
    tim = rt.timings(plan, dict(t), iters=n)
    if tim.get("gpu_s"):
        say(f"kernel alone (profiling events)   {statistics.median(tim['gpu_s']) * 1e6:8.1f} us "
            f"({', '.join(plan.kernels)})")
    say(f"enqueue + finish, no transfers    {statistics.median(tim['wall_s']) * 1e6:8.1f}")
    say(f"Session.run, out back             {_med(lambda: s.run(sp1, t), n):8.1f}")
    say(f"Session.run, out + lse back       {_med(lambda: s.run(spl, t), n):8.1f}")
    say(f"q upload (8 KiB) + finish         {_med(lambda: (qt.write(q), rt.mem.sync()), n):8.1f}")
    say(f"one 8 KiB read-back               {_med(lambda: small.numpy(), n):8.1f}")


def _sharded(cache: Any, n: int, say: Callable[[str], None]) -> None:
    """The sharded call's phases with each exchange, back to back and barrier-synced."""
    import torch.distributed as dist

    from attnreg.distributed import sharded_attention
    spec = cache.spec(NQ, 1, causal=True)
    q = (np.random.default_rng(7).standard_normal(spec.q_shape) * .5).astype(np.float16)
    for gather in ("point_to_point", "all_gather"):
        cache.gather = gather
        for synced in (False, True):
            parts: dict[str, list[float]] = {"local_s": [], "exchange_s": [], "merge_s": []}

            def one(parts: dict[str, list[float]] = parts) -> None:
                sharded_attention(spec, q, cache)
                for key, val in cache.last_timings.items():
                    parts[key].append(val)

            wall = _med(one, n, dist.barrier if synced else None)
            m = {k: statistics.median(v[5:]) * 1e6 for k, v in parts.items()}
            say(f"sharded {gather:14s} {'barrier' if synced else 'b2b    '} wall {wall:7.1f} = "
                f"local {m['local_s']:6.1f} + exchange {m['exchange_s']:6.1f} + merge "
                f"{m['merge_s']:6.1f} ({cache.last_merge})")


def _floors(nbytes: int, rank: int, n: int, say: Callable[[str], None]) -> None:
    """gloo alone for the exchange's bytes; the numpy merge of two decode states alone."""
    import torch
    import torch.distributed as dist

    import attnreg
    from attnreg.distributed.merge import host_merge
    src = torch.zeros(nbytes, dtype=torch.uint8)
    outs = [torch.empty_like(src) for _ in range(2)]

    def pair() -> None:
        works = [dist.irecv(outs[1 - rank], src=1 - rank), dist.isend(src, dst=1 - rank)]
        for w in works:
            w.wait()

    for name, f in (("all_gather", lambda: dist.all_gather(outs, src)), ("isend/irecv", pair)):
        say(f"gloo {name:11s} {nbytes} B alone: barrier-synced {_med(f, n, dist.barrier):7.1f}, "
            f"back to back {_med(f, n):7.1f}")
    spec = attnreg.AttentionSpec(seq_len=1, past_len=99, num_heads=NQ, kv_num_heads=NKV,
                                 head_size=H, dtype="float16")
    rng = np.random.default_rng(0)
    st = [(rng.standard_normal((1, NQ, 1, H)).astype(np.float32),
           rng.standard_normal((1, NQ, 1)).astype(np.float32)) for _ in range(2)]
    say(f"numpy merge of 2 decode states alone {_med(lambda: host_merge(spec, st, None, None), n):7.1f}")


def _rank(rank: int, port: int, backend: str, length: int, n: int) -> None:
    import torch.distributed as dist

    import attnreg
    from attnreg.distributed import ShardedKVCache
    from attnreg.distributed.exchange import HEADER
    from attnreg.tools.bench_cp import _chunks, devices_for
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    devs = devices_for(backend, None)
    dev = devs[rank % len(devs)].id
    lines: list[str] = []
    nbytes = HEADER + 4 * NQ * (H + 1)
    with attnreg.Session(backend=backend, device=dev) as s:
        cache = ShardedKVCache(s, batch=1, kv_num_heads=NKV, head_size=H, dtype="float16",
                               shard_capacity=length // 2, group=dist.group.WORLD,
                               exchange_bytes=nbytes)
        for k, v in _chunks(length):
            cache.append(k, v)
        dist.barrier()
        _runs(s, cache.shards[rank][1], n, lambda m: lines.append(f"[rank {rank} {dev}] {m}"))
        _sharded(cache, n, lambda m: lines.append(f"[rank {rank} {dev}] {m}"))
    _floors(nbytes, rank, n, lambda m: lines.append(f"[rank {rank} {dev}] {m}"))
    got: list[Any] = [None, None]
    dist.all_gather_object(got, lines)
    if rank == 0:
        print("\n".join(line for r in got for line in r), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="opencl")
    ap.add_argument("--length", type=int, default=262144, help="keys over both ranks")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    mp.spawn(_rank, args=(port, a.backend, a.length, a.iters), nprocs=2, join=True)


if __name__ == "__main__":
    main()
