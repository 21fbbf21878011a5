"""Rank processes for the process-group tests: a pool of ranks started once (torch's
multiprocessing, gloo on a free port), each serving jobs from the test process, so the ranks'
start-up (torch, the devices, compiled programs) is paid once for every case."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import attnreg
from attnreg.distributed import ShardedKVCache, sharded_attention

from .shards import shard_arrays

# Every collective of the pool's process group gives up after this long (gloo's own timeout).
GROUP_TIMEOUT_S = 30


@dataclass(frozen=True)
class Case:
    """A sharded call every rank makes alike: the cache, its appends and the call."""

    caps: tuple[int, ...]
    appends: tuple[int, ...]
    seq_len: int = 1
    batch: int = 2
    heads: tuple[int, int] = (4, 2)
    head_size: int = 32
    dtype: str = "float16"
    layout: str = "BSNH"
    kv_dtype: str | None = None
    page_size: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    merge: str = "auto"
    gather: str = "auto"
    exchange_bytes: int = 65536

    def inputs(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, dict[str, Any]]:
        """The appends, the query and the call's extra tensors (the same on every rank)."""
        rng = np.random.default_rng(self.seed)
        nq, nkv = self.heads
        kv = [tuple(rng.standard_normal((self.batch, a, nkv, self.head_size)).astype(self.dtype)
                    for _ in range(2)) for a in self.appends]
        length = sum(self.appends)
        shape = (self.batch, self.seq_len, nq, self.head_size)
        q = rng.standard_normal(shape).astype(self.dtype)
        extras: dict[str, Any] = {}
        if self.fields.get("head_sink"):
            extras["head_sink"] = rng.standard_normal(nq).astype(np.float32)
        if self.fields.get("kv_start"):
            extras["kv_start"] = np.arange(self.batch, dtype=np.int32) * 3 % length
        if self.fields.get("seqlens_q"):
            extras["seqlens_q"] = np.maximum(1, self.seq_len - np.arange(self.batch)).astype(np.int32)
        return kv, q, extras  # type: ignore[return-value]


class Worker:
    """One rank's state across jobs: its Sessions (programs compiled once) and groups."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist
        self.rank, self.dist = rank, dist
        self.sessions: dict[str, attnreg.Session] = {}
        # every group the tests use, made by every rank in the same order (torch's rule)
        self.groups = {"world": dist.group.WORLD, "01": dist.new_group([0, 1])}
        self.cache: ShardedKVCache | None = None

    def session(self, backend: str) -> attnreg.Session:
        s = self.sessions.get(backend)
        if s is None or s.closed:
            s = self.sessions[backend] = attnreg.Session(backend=backend)
        return s

    def attend(self, case: Case, group: str, backends: tuple[str, ...], timeout: float | None = None,
               close_session: bool = False, then_sleep: float = 0.0) -> dict[str, Any]:
        """Make the case's cache, append, call: the result and this rank's shard. With
        close_session this rank's Session is closed before the call (its shard then fails
        mid-call); with then_sleep it makes the cache but sleeps instead of calling."""
        g = self.groups[group]
        me = self.dist.get_rank(g)
        session = self.session(backends[me])
        kv, q, extras = case.inputs()
        cache = self.cache = ShardedKVCache(
            session, batch=case.batch, kv_num_heads=case.heads[1], head_size=case.head_size,
            shard_capacity=list(case.caps), dtype=case.dtype, layout=case.layout,
            kv_dtype=case.kv_dtype, page_size=case.page_size, group=g, timeout=timeout,
            merge=case.merge, gather=case.gather, exchange_bytes=case.exchange_bytes)
        for k, v in kv:
            cache.append(k, v)
        if then_sleep:
            time.sleep(then_sleep)
            return {"slept": True}
        spec = cache.spec(case.heads[0], case.seq_len, return_lse=True, **case.fields)
        if close_session:
            session.close()
        out = sharded_attention(spec, q, cache, tensors=extras)
        return {"out": out, "spec": spec, "shard": shard_arrays(cache.shards[me][1]),
                "offsets": cache.offsets,
                "counts": cache.counts, "timings": cache.last_timings}

    def again(self, case: Case) -> Any:
        """The last cache's call once more (after another rank failed), with the case's query
        and extra tensors (its appends are not made again)."""
        assert self.cache is not None
        _, q, extras = case.inputs()
        spec = self.cache.spec(case.heads[0], case.seq_len, return_lse=True, **case.fields)
        return sharded_attention(spec, q, self.cache, tensors=extras)


def serve(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    """A rank: join the group, then run jobs (method name, kwargs) until None."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # every rank on this host: gloo over loopback, whatever the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    worker = Worker(rank, world)
    results.put((rank, "ready", None))
    while (job := jobs.get()) is not None:
        name, kw = job
        try:
            results.put((rank, "ok", getattr(worker, name)(**kw)))
        except Exception as exc:
            results.put((rank, "raised", (type(exc).__name__, str(exc), getattr(exc, "ranks", None),
                                          traceback.format_exc()[-2000:])))
    os._exit(0)            # no teardown of a group a test may have broken


class Pool:
    """``world`` spawned ranks serving jobs; ``run`` gives each rank's answer, bounded."""

    def __init__(self, world: int, start_timeout: float = 180.0) -> None:
        import torch.multiprocessing as mp
        # Fresh processes like spawn's, started by forking a server that has imported torch
        # and attnreg once (and opened no device): three spawned ranks would each import
        # torch, about three times the start-up on CI's two cores.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch.distributed", "attnreg", __name__])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=serve, args=(r, world, port, self.jobs[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        ready = self._collect(set(range(world)), start_timeout)
        assert all(v[0] == "ready" for v in ready.values()), ready

    def send(self, jobs: dict[int, tuple[str, dict[str, Any]]]) -> None:
        for r, job in jobs.items():
            self.jobs[r].put(job)

    def run(self, jobs: dict[int, tuple[str, dict[str, Any]]], timeout: float = 120.0
            ) -> dict[int, tuple[str, Any]]:
        self.send(jobs)
        return self._collect(set(jobs), timeout)

    def _collect(self, ranks: set[int], timeout: float) -> dict[int, tuple[str, Any]]:
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while set(got) != ranks:
            try:
                r, status, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(ranks - set(got))} gave no answer within "
                                     f"{timeout} s") from None
            got[r] = (status, value)
        return got

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)  # type: ignore[arg-type]

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
