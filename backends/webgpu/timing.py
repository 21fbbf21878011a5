"""How the WebGPU runtime times a prepared plan (WebGpuRuntime.timings): the launch's GPU time
from timestamp queries, the host's wall time, and the back-to-back time of many launches in
one compute pass. The runtime hands over how to encode one launch (``encode``: a command
encoder holding the launch's one compute pass, timestamps optional) and how to record it into
an open pass (``record``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .device import GpuDevice
from .memory import DeviceMemory

Encode = Callable[..., Any]          # (timestamp_writes=None) -> command encoder
Record = Callable[[Any], None]       # (compute pass) -> None


def timings(dev: GpuDevice, memory: DeviceMemory, encode: Encode, record: Record, *,
            iters: int, warmup: int, warmup_s: float) -> dict[str, list[float]]:
    """Per-launch times, nothing read back.

    ``gpu_s`` (where the adapter has timestamp-query): timestamps around each launch's one
    compute pass, the iterations submitted back to back, so the GPU stays busy and clocked up
    as in a decode loop. ``wall_s``: host time of submit + wait, one launch at a time.
    ``warmup_s`` keeps launching for that long first: an idle H100 sits at 345 MHz and short
    bursts of launches were timed 2-8x slow without it (0.1 s left the H100's L=32768 decode
    at 190-238 us against 71-76 us after 0.6 s). ``b2b_s``: back to back (back_to_back)."""
    t_end = time.perf_counter() + warmup_s
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        dev.submit([encode().finish()])
        n += 1
        if n % 64 == 0:
            dev.wait()
    dev.wait()
    res: dict[str, list[float]] = {}
    if dev.has_timestamps:
        res["gpu_s"] = _gpu_times(dev, memory, encode, iters)
    wall = []
    for _ in range(iters):
        cmd = encode().finish()
        t0 = time.perf_counter()
        dev.submit([cmd])
        dev.wait()
        wall.append(time.perf_counter() - t0)
    res["wall_s"] = wall
    res["b2b_s"] = [back_to_back(dev, memory, record, iters) for _ in range(3)]
    return res


def back_to_back(dev: GpuDevice, memory: DeviceMemory, record: Record, iters: int) -> float:
    """Seconds per launch with ``iters`` launches enqueued without waiting, recorded into one
    compute pass of one command buffer (as an engine records a decode step's launches, and as
    OpenCL's in-order queue and torch's replayed CUDA graph run theirs): the pass's start to
    its end (timestamp queries) over ``iters``; where the adapter has no timestamps, host
    time from the submit to the end of the wait. WebGPU orders each launch's storage accesses
    after the previous one's, so the launches still run one after the other; what this
    leaves out is the pass and submission around each launch (on the H100 through Dawn, 6 us
    of the 9.5 us a pass of two empty dispatches takes: h100_wgsl_decode_phases.txt in
    ci/results)."""
    n = max(1, iters)
    qs = None
    if dev.has_timestamps:
        qs = dev.device.create_query_set(type=dev.wgpu.QueryType.timestamp, count=2)
    enc = dev.device.create_command_encoder()
    cp = enc.begin_compute_pass(timestamp_writes={
        "query_set": qs, "beginning_of_pass_write_index": 0,
        "end_of_pass_write_index": 1}) if qs else enc.begin_compute_pass()
    for _ in range(n):
        record(cp)
    cp.end()
    cmd = enc.finish()
    t0 = time.perf_counter()
    dev.submit([cmd])
    if qs is None:
        dev.wait()
        return (time.perf_counter() - t0) / n
    ticks = _read_timestamps(dev, memory, qs, 2)
    return float(ticks[1] - ticks[0]) * 1e-9 / n


def _gpu_times(dev: GpuDevice, memory: DeviceMemory, encode: Encode,
               iters: int) -> list[float]:
    qs = dev.device.create_query_set(type=dev.wgpu.QueryType.timestamp, count=2 * iters)
    cmds = [encode({"query_set": qs, "beginning_of_pass_write_index": 2 * i,
                    "end_of_pass_write_index": 2 * i + 1}).finish() for i in range(iters)]
    for cmd in cmds:
        dev.submit([cmd])
    ticks = _read_timestamps(dev, memory, qs, 2 * iters)
    return [float(ticks[2 * i + 1] - ticks[2 * i]) * 1e-9 for i in range(iters)]


def _read_timestamps(dev: GpuDevice, memory: DeviceMemory, qs: Any, count: int) -> np.ndarray:
    """The query set's ``count`` timestamps (nanoseconds in WebGPU), after the work
    submitted before; the query set is destroyed."""
    U = dev.wgpu.BufferUsage
    n = 8 * count
    resolve = memory.buffer("ts_resolve", n, U.QUERY_RESOLVE | U.COPY_SRC)
    rb = memory.buffer("rb_ts", n, U.MAP_READ | U.COPY_DST)
    enc = dev.device.create_command_encoder()
    enc.resolve_query_set(qs, 0, count, resolve, 0)
    enc.copy_buffer_to_buffer(resolve, 0, rb, 0, n)
    dev.submit([enc.finish()])
    try:
        ticks = np.frombuffer(dev.map_read(rb, n), dtype=np.uint64).copy()
    except BaseException:
        memory.discard(rb)           # cancels the map (webgpu/memory.py map_read)
        raise
    finally:
        qs.destroy()
    return ticks
