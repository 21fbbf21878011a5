"""On-device K/V quantization for a WebGPU runtime (wgpu-native or Dawn): a KV cache's append
with kv_dtype "int8" / "int4" uploads its new tokens once and one small kernel
(shaders/quantize_kv.wgsl, built by program.py) writes codes and scales straight into the
cache's buffers.

One upload per append (the destination rows and every job's values in one staging buffer),
one encoder, one compute pass with a dispatch per job (k, v), one submit; nothing waits.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from attnreg.errors import SpecError

from . import program
from .device import GpuDevice
from .memory import DeviceMemory, cdiv, resource, span
from .program import Utility

_DT = {"float32": 0, "float16": 1, "bfloat16": 2}
_Q = {"int8": 1, "int4": 2}
# Per storage, the scales binding's type and its store (shaders/storage.wgsl): int8's f32
# scale is a whole word; int4's f16 scales pair up in a word that two blocks write.
_SCALES = {"int8": ("array<u32>", "put_scale_word"),
           "int4": ("array<atomic<u32>>", "put_scale_half")}


def refusal(kv_dtype: str, dtype: str, head_size: int) -> str | None:
    """Why this kernel cannot quantize that storage (None: it can)."""
    if dtype not in _DT:
        return f"inputs in one of {sorted(_DT)} (got {dtype})"
    if kv_dtype == "int8" and head_size % 4:
        return (f"head_size % 4 == 0 for int8 on WebGPU (got {head_size}): codes are stored "
                "in 32-bit words, so a vector of H bytes must start on a word")
    if kv_dtype == "int4" and head_size % 32:
        return f"head_size % 32 == 0 for int4 (got {head_size}): q4_0 blocks of 32"
    if kv_dtype not in _Q:
        return f"kv_dtype one of {sorted(_Q)} (got {kv_dtype})"
    return None


def utility(kv_dtype: str, dtype: str, head_size: int, dialect: str) -> Utility:
    """The kernel for one (storage, input dtype, head size)."""
    ty, put = _SCALES[kv_dtype]
    return program.utility("quantize_kv", consts={"VEC_DIM": head_size, "IN_DTYPE": _DT[dtype],
                                                  "QUANT": _Q[kv_dtype]},
                           types={"scales": ty}, pieces=(put,), dialect=dialect)


def _words(arr: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    return raw.view(np.uint32)


def quantize_into(dev: GpuDevice, memory: DeviceMemory, kv_dtype: str, rows: np.ndarray,
                  jobs: Sequence[tuple[np.ndarray, Any, Any]]) -> None:
    """The runtime contract's quantize_into (attnreg/memory.py) on this device."""
    if not jobs or rows.size == 0:
        return
    r, h = jobs[0][0].shape
    limit = memory.caps.limit("storage_binding")
    for _, codes, scales in jobs:
        size = span(codes)[2]
        if limit is not None and max(size, span(scales)[2]) > limit:
            raise SpecError("capacity", f"{size} bytes of codes", f"a cache whose k / v "
                            f"fit one storage binding ({limit} bytes) on {memory.caps.name}")
    dtype = jobs[0][0].dtype.name
    parts, offsets = [_words(rows.astype(np.int32))], []
    at = parts[0].size
    for x, _, _ in jobs:
        offsets.append(at)
        parts.append(_words(x))
        at += parts[-1].size
    staged = np.concatenate(parts)
    src = memory.stage("quant_src", staged)     # one host upload, counted
    U = dev.wgpu.BufferUsage
    prog = utility(kv_dtype, dtype, h, dev.dialect)
    pipe = dev.compile(f"webgpu.quantize_kv.{kv_dtype}", prog.wgsl, prog.layout)
    count = r if kv_dtype == "int8" else r * (h // 32)
    groups = cdiv(count, prog.threads)
    x_groups = min(groups, 65535)
    grid = (x_groups, cdiv(groups, x_groups), 1)
    enc = dev.device.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    for j, (off, (_, codes, scales)) in enumerate(zip(offsets, jobs)):
        params = memory.buffer(f"quant_params{j}", 16, U.UNIFORM | U.COPY_DST)
        dev.device.queue.write_buffer(params, 0, struct.pack("<4I", r, count, off, 0))
        group = dev.device.create_bind_group(layout=dev.layout(prog.layout)[0], entries=[
            {"binding": 0, "resource": {"buffer": params}},
            {"binding": 1, "resource": {"buffer": src, "offset": 0, "size": staged.nbytes}},
            {"binding": 2, "resource": resource(codes)},
            {"binding": 3, "resource": resource(scales)}])
        cp.set_bind_group(0, group)
        cp.dispatch_workgroups(*grid)
    cp.end()
    dev.submit([enc.finish()])
    memory.counters["quantize_dispatches"] += len(jobs)
