"""Attention states between the ranks of a torch.distributed process group (gloo on the host:
the states are small host arrays, so no GPU transport is needed), and the error every rank
raises when another one fails.

Every rank sends the same number of bytes in every round (gloo aborts the process on a size
mismatch), whatever went wrong: a first round of a fixed size (the cache's ``exchange_bytes``)
carries each rank's header (ok or failed and why, a digest of its call, its payload size) and
the start of its payload; only when every rank is ok and all digests agree does a second
all_gather, of the agreed remaining size, carry the rest (states larger than the first round:
a long prefill). The first round travels in a cache's Channel: buffers kept across calls, the
states written into the send buffer by the shard and read by the merge from the receive
buffer, as one all_gather or, for a few ranks (rules.py), each rank's isend to and irecv from
every other. Waits are bounded by the cache's timeout; a rank that died, hung or never called
makes the others raise RankError, never hang.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any

import numpy as np

from ..errors import SpecError

Group = Any                  # a torch.distributed ProcessGroup (torch is imported lazily)
HEADER = 512                 # status, payload size, digest, message
_MESSAGE = HEADER - 40


class RankError(RuntimeError):
    """Another rank of the group failed, died, hung or made a different call: raised on every
    rank but the failing one (which raises its own error). ``ranks`` names the ranks at fault
    where they are known. After a timeout or a dead rank the process group is broken (torch's
    rule): destroy it and start again."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


def torch_dist() -> Any:
    """torch.distributed, or a SpecError saying how to install it."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise SpecError("group", None, "torch installed for process groups: pip install "
                        f"'attnreg[distributed]' ({exc})") from None
    return dist


def group_place(group: Group) -> tuple[int, int]:
    """(this rank's index in the group, the group's size)."""
    dist = torch_dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise SpecError("group", group, "a process group of an initialized torch.distributed "
                        "(torch.distributed.init_process_group first)")
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except Exception as exc:         # torch raises ValueError / RuntimeError for a non-group
        raise SpecError("group", group, f"a torch.distributed process group ({exc})") from None
    if rank < 0:
        raise SpecError("group", group, "a process group this rank belongs to")
    return rank, world


def digest(*parts: Any) -> bytes:
    """16 bytes that differ when two ranks' calls (or caches) differ."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.tobytes() if isinstance(p, np.ndarray) else repr(p).encode())
    return h.digest()


class Channel:
    """One cache's exchange buffers, kept across calls (torch views of numpy arrays, no copy
    between them): the rank's send buffer of the first round's ``size`` bytes, whose payload
    part a call's states are written into directly (:meth:`payload`), and one receive row per
    rank, which the merge reads in place. ``way``: how the rounds travel (rules.py: one
    all_gather, or point to point)."""

    def __init__(self, group: Group, size: int, way: str = "all_gather") -> None:
        import torch
        self.group, self.size, self.way = group, size, way
        self.rank, self.world = group_place(group)
        self.send = np.zeros(size, np.uint8)
        self._src = torch.from_numpy(self.send)
        recv = torch.empty((self.world, size), dtype=torch.uint8)
        self._outs = list(recv.unbind(0))
        self.recv = recv.numpy()
        # the other ranks, as (index in the group, global rank): point to point takes the latter
        dist = torch_dist()
        self._peers = [(r, dist.get_global_rank(group, r)) for r in range(self.world)
                       if r != self.rank]

    def payload(self, nbytes: int) -> np.ndarray | None:
        """The send buffer's first ``nbytes`` payload bytes (a call writes its states there),
        or None when they do not fit the first round."""
        return self.send[HEADER:HEADER + nbytes] if nbytes <= self.size - HEADER else None

    def all_gather(self, timeout: float | None) -> list[np.ndarray]:
        """Every rank's send buffer: the receive buffer's rows (this rank's own: the send
        buffer itself)."""
        self._move(self._src, self._outs, timeout)
        return [self.send if r == self.rank else row for r, row in enumerate(self.recv)]

    def gather(self, data: np.ndarray, timeout: float | None) -> list[np.ndarray]:
        """Every rank's ``data`` (the same size on every rank), in fresh arrays."""
        import torch
        src = torch.from_numpy(np.ascontiguousarray(data))
        outs = [torch.empty_like(src) for _ in range(self.world)]
        self._move(src, outs, timeout)
        return [data if r == self.rank else o.numpy() for r, o in enumerate(outs)]

    def _move(self, src: Any, outs: list[Any], timeout: float | None) -> None:
        """``src`` to every rank, theirs into ``outs`` (one tensor per rank), the channel's
        way, bounded by ``timeout``; RankError if a rank does not answer."""
        dist = torch_dist()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if self.way == "point_to_point":    # the receives posted before the sends
                works = [dist.irecv(outs[r], src=g, group=self.group) for r, g in self._peers]
                works += [dist.isend(src, dst=g, group=self.group) for _, g in self._peers]
            else:
                works = [dist.all_gather(outs, src, group=self.group, async_op=True)]
            for work in works:
                if deadline is None:
                    work.wait()
                else:
                    left = max(deadline - time.monotonic(), 1e-3)
                    work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as exc:    # gloo: RuntimeError / DistBackendError, a dead peer, a timeout
            raise RankError(f"rank {self.rank}: the other ranks did not all answer (a rank "
                            f"died, hung or did not make this call; timeout "
                            f"{timeout or 'of the group'} s): "
                            f"{str(exc).splitlines()[0][:300]}") from exc


def exchange(channel: Channel, timeout: float | None, stamp: bytes,
             payload: np.ndarray | None, failure: BaseException | None) -> list[np.ndarray]:
    """Every rank's payload (uint8), in rank order; RankError if a rank failed, sent another
    stamp, or did not answer in time. Every rank's channel has the same size (the first
    round's byte count); a failed rank passes its exception and no payload. A payload in the
    channel's send buffer (Channel.payload) is sent as it is; the payloads that fit the first
    round come back as views of the channel's receive buffer, valid until its next exchange."""
    size, send = channel.size, channel.send
    data = payload if payload is not None and failure is None else np.zeros(0, np.uint8)
    _header(send, stamp, data.size, failure)
    head = min(data.size, size - HEADER)
    if head and data.ctypes.data != send.ctypes.data + HEADER:
        send[HEADER:HEADER + head] = data[:head]
    got = channel.all_gather(timeout)
    _check(got, channel.rank)
    if failure is not None:
        raise failure                   # the others raise RankError naming this rank
    rest = data.size - head             # the same on every rank: _check compared the sizes
    if rest == 0:
        return [g[HEADER:HEADER + head] for g in got]
    tails = channel.gather(data[head:], timeout)
    return [np.concatenate([g[HEADER:HEADER + head], t]) for g, t in zip(got, tails)]


def _header(buf: np.ndarray, stamp: bytes, size: int, failure: BaseException | None) -> None:
    buf[4:8].view(np.int32)[0] = 0 if failure is None else 1
    buf[8:16].view(np.int64)[0] = size
    buf[16:32] = np.frombuffer(stamp.ljust(16, b"\0")[:16], np.uint8)
    if failure is not None:
        text = f"{type(failure).__name__}: {failure}".encode(errors="replace")[:_MESSAGE]
        buf[32:36].view(np.int32)[0] = len(text)
        buf[40:40 + len(text)] = np.frombuffer(text, np.uint8)


def _check(got: list[np.ndarray], rank: int) -> None:
    """RankError on every rank if some rank failed (not on the failing one: it raises its
    own error) or the ranks' stamps or payload sizes differ."""
    failed = [r for r, x in enumerate(got) if x[4:8].view(np.int32)[0] != 0]
    if failed and rank not in failed:
        first = got[failed[0]]
        n = int(first[32:36].view(np.int32)[0])
        why = bytes(first[40:40 + n]).decode(errors="replace")
        raise RankError(f"rank {failed[0]} of {len(got)} failed in this call: {why}"
                        + (f" (ranks {failed} failed)" if len(failed) > 1 else ""), tuple(failed))
    if failed:
        return
    odd = [r for r, x in enumerate(got) if bytes(x[8:32]) != bytes(got[0][8:32])]
    if odd:
        raise RankError(f"ranks {odd} made a different call than rank 0 (every rank must make "
                        "the same appends and calls, with the same spec)", tuple(odd))
