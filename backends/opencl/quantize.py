"""On-device K/V quantization for an OpenCL runtime: a KV cache's append with kv_dtype "int8" /
"int4" uploads its new tokens once and one small kernel (kernels_cl/quantize_kv.cl) writes
codes and scales straight into the cache's buffers.

One upload per append (the destination rows and every job's values in one pooled buffer) and
one kernel per job (k, v), on the runtime's in-order queue; nothing waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyopencl as cl

from . import device, program
from .memory import DeviceMemory

_DT = {"float32": 0, "float16": 1, "bfloat16": 2}
_ENTRY = {"int8": "quantize_int8", "int4": "quantize_int4"}


def refusal(kv_dtype: str, dtype: str, head_size: int) -> str | None:
    """Why this kernel cannot quantize that storage (None: it can). OpenCL stores bytes, so
    int8 takes any head size."""
    if dtype not in _DT:
        return f"inputs in one of {sorted(_DT)} (got {dtype})"
    if kv_dtype not in _ENTRY:
        return f"kv_dtype one of {sorted(_ENTRY)} (got {kv_dtype})"
    if kv_dtype == "int4" and head_size % 32:
        return f"head_size % 32 == 0 for int4 (got {head_size}): q4_0 blocks of 32"
    return None


def _kernel(ctx: cl.Context, dev: cl.Device, kv_dtype: str, dtype: str, head_size: int,
            fix: tuple[str, ...] = ()) -> cl.Kernel:
    opts = (*program.BASE_OPTIONS, *fix, f"-DHD={head_size}", f"-DDT={_DT[dtype]}")
    prog = device.build(ctx, dev, f"opencl.quantize_kv.{kv_dtype}",
                        program.read_file("quantize_kv.cl"), opts)
    return cl.Kernel(prog, _ENTRY[kv_dtype])


def quantize_into(ctx: cl.Context, dev: cl.Device, queue: cl.CommandQueue, mem: DeviceMemory,
                  kv_dtype: str, rows: np.ndarray,
                  jobs: Sequence[tuple[np.ndarray, Any, Any]], fix: tuple[str, ...] = ()) -> None:
    """The runtime contract's quantize_into (attnreg/memory.py) on this device (``fix``: the
    build options of the device, program.device_options)."""
    if not jobs or rows.size == 0:
        return
    r, h = jobs[0][0].shape
    parts = [np.ascontiguousarray(rows, np.int32).view(np.uint8)]
    offsets = []
    at = parts[0].size
    for x, _, _ in jobs:
        at += -at % 4                       # float loads stay 4-byte aligned
        offsets.append(at)
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        parts.append(np.zeros(offsets[-1] - sum(p.size for p in parts), np.uint8))
        parts.append(raw)
        at += raw.size
    staging = mem.upload_pooled("quant_staging", np.concatenate(parts), private=True)
    kernel = _kernel(ctx, dev, kv_dtype, jobs[0][0].dtype.name, h, fix)
    count = r if kv_dtype == "int8" else r * (h // 32)
    for off, (_, codes, scales) in zip(offsets, jobs):
        kernel.set_args(staging, np.uint32(r), np.uint32(off), codes, scales)
        cl.enqueue_nd_range_kernel(queue, kernel, (count,), None)
    mem.counters["quantize_dispatches"] += len(jobs)
