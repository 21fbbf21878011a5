"""The copy roof of a WebGPU device (the bench's limit for decodes): device-to-device copy
bandwidth by a copy command and by the shader cores (the copy_bw kernel), each timed by
timestamps where the device has them."""

from __future__ import annotations

import statistics
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import program
from .memory import BIND_ALIGN, cdiv

if TYPE_CHECKING:
    from .memory import DeviceMemory


def copy_bandwidths(mem: DeviceMemory, nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s (read + written) of copying ``nbytes`` device to device: ``command``, one
    copy_buffer_to_buffer per sample, timed by timestamps inside the encoder where the
    device has them (wall clock of submit + wait otherwise); ``shader``, the copy_bw
    kernel timed by compute-pass timestamps (where the device has them). Medians of
    ``repeats`` after a warm-up. On the H100 a copy command measured 411 GB/s while the
    decode kernels stream 1.2 TB/s: a roof needs the shader copy."""
    U = mem.wgpu.BufferUsage
    d = mem.dev.device
    nbytes = cdiv(int(nbytes), 16) * 16
    usage = U.STORAGE | U.COPY_SRC | U.COPY_DST
    src = d.create_buffer(size=nbytes, usage=usage)
    dst = d.create_buffer(size=nbytes, usage=usage)
    inside = "timestamp-query-inside-encoders" in mem.dev.features
    try:
        enc = d.create_command_encoder()
        enc.clear_buffer(src)
        enc.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)        # warm-up (pages, clocks)
        mem.dev.submit([enc.finish()])
        mem.dev.wait()
        secs = timed_copies(mem, src, dst, nbytes, repeats) if inside else []
        if not secs:
            for _ in range(repeats):
                enc = d.create_command_encoder()
                enc.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
                cmd = enc.finish()
                t0 = time.perf_counter()
                mem.dev.submit([cmd])
                mem.dev.wait()
                secs.append(time.perf_counter() - t0)
        res = {"command": 2 * nbytes / statistics.median(secs) / 1e9}
        if mem.dev.has_timestamps:
            shader = shader_copies(mem, src, dst, nbytes, repeats)
            if shader:
                res["shader"] = 2 * nbytes / statistics.median(shader) / 1e9
    finally:
        src.destroy()
        dst.destroy()
    return res


def shader_copies(mem: DeviceMemory, src: Any, dst: Any, nbytes: int, repeats: int) -> list[float]:
    """Seconds per copy by the copy_bw kernel: one compute pass per sample, one dispatch
    per window of at most the storage-binding limit, timed by the pass's timestamps."""
    U = mem.wgpu.BufferUsage
    d = mem.dev.device
    limit = mem.caps.limit("storage_binding") or (128 << 20)
    window = max(16, min(nbytes, limit // BIND_ALIGN * BIND_ALIGN))
    prog = program.utility("copy_bw", dialect=mem.dev.dialect)
    pipe = mem.dev.compile("webgpu.copy_bw", prog.wgsl, prog.layout)
    groups, params = [], []
    n_wg = min(65535, 8 * (mem.caps.compute_units or 16))
    for off in range(0, nbytes, window):
        size = min(window, nbytes - off)
        p = d.create_buffer(size=16, usage=U.UNIFORM | U.COPY_DST)
        d.queue.write_buffer(p, 0, struct.pack("<4I", size // 16, n_wg * prog.threads, 0, 0))
        params.append(p)
        groups.append(d.create_bind_group(layout=mem.dev.layout(prog.layout)[0], entries=[
            {"binding": 0, "resource": {"buffer": p}},
            {"binding": 1, "resource": {"buffer": src, "offset": off, "size": size}},
            {"binding": 2, "resource": {"buffer": dst, "offset": off, "size": size}}]))
    qs = d.create_query_set(type=mem.wgpu.QueryType.timestamp, count=2 * (repeats + 1))
    enc = d.create_command_encoder()
    for i in range(repeats + 1):                      # the first is the warm-up
        cp = enc.begin_compute_pass(timestamp_writes={
            "query_set": qs, "beginning_of_pass_write_index": 2 * i,
            "end_of_pass_write_index": 2 * i + 1})
        cp.set_pipeline(pipe)
        for g in groups:
            cp.set_bind_group(0, g)
            cp.dispatch_workgroups(n_wg, 1, 1)
        cp.end()
    n = 16 * (repeats + 1)
    resolve = d.create_buffer(size=n, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    enc.resolve_query_set(qs, 0, 2 * (repeats + 1), resolve, 0)
    ticks = np.frombuffer(mem.read(resolve, n, enc), dtype=np.uint64)
    qs.destroy()
    resolve.destroy()
    secs = [float(ticks[2 * i + 1] - ticks[2 * i]) * 1e-9 for i in range(1, repeats + 1)]
    return [s for s in secs if s > 0]


def timed_copies(mem: DeviceMemory, src: Any, dst: Any, nbytes: int, repeats: int) -> list[float]:
    U = mem.wgpu.BufferUsage
    d = mem.dev.device
    qs = d.create_query_set(type=mem.wgpu.QueryType.timestamp, count=2 * repeats)
    enc = d.create_command_encoder()
    for i in range(repeats):
        enc._write_timestamp(qs, 2 * i)
        enc.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
        enc._write_timestamp(qs, 2 * i + 1)
    resolve = d.create_buffer(size=16 * repeats, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    enc.resolve_query_set(qs, 0, 2 * repeats, resolve, 0)
    ticks = np.frombuffer(mem.read(resolve, 16 * repeats, enc), dtype=np.uint64)
    qs.destroy()
    resolve.destroy()
    secs = [float(ticks[2 * i + 1] - ticks[2 * i]) * 1e-9 for i in range(repeats)]
    return [s for s in secs if s > 0]
