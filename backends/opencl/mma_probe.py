"""Whether NVIDIA's OpenCL runs the tensor-core instruction ``mma.sync.m16n8k16`` (f16 inputs,
f32 accumulators) through inline PTX: probed, not assumed. A 32-lane kernel multiplies two
random 16x16 / 16x8 f16 matrices and the probe checks the product against numpy. The answer is
cached per device and driver ($ATTNREG_CACHE_DIR/ptx_mma-v2.json: the measured error, or why
the probe could not run; the verdict is decided from it here), so a process pays the compile
(about 0.1 s) once per driver, not once per run.

Fragment layout (PTX ISA, mma.m16n8k16 with .row A and .col B), lane = 4 * group + t:
A registers hold f16 pairs (row g, cols 2t..2t+1), (row g+8, same), (row g, cols 2t+8..),
(row g+8, cols 2t+8..); B pairs (k 2t..2t+1, col g), (k 2t+8.., col g); D holds
(row g, cols 2t, 2t+1), (row g+8, same). Pairs are read as uint from the raw f16 bits, so the
kernel needs no cl_khr_fp16 (NVIDIA's OpenCL has none).
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from attnreg import cache

FEATURE = "ptx-mma-m16n8k16-f16"     # the feature name kernels declare
MIN_SM = 80                         # mma.sync m16n8k16 with f16 inputs needs sm_80

SOURCE = r"""
__kernel void mma_probe(__global const uint *a, __global const uint *b, __global float *d) {
  uint lane = get_local_id(0), g = lane >> 2, t = lane & 3u;
  uint a0 = a[(g * 16u + 2u * t) / 2u], a1 = a[((g + 8u) * 16u + 2u * t) / 2u];
  uint a2 = a[(g * 16u + 2u * t + 8u) / 2u], a3 = a[((g + 8u) * 16u + 2u * t + 8u) / 2u];
  uint b0 = b[(g * 16u + 2u * t) / 2u], b1 = b[(g * 16u + 2u * t + 8u) / 2u];
  float c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  d[g * 8u + 2u * t] = c0;
  d[g * 8u + 2u * t + 1u] = c1;
  d[(g + 8u) * 8u + 2u * t] = c2;
  d[(g + 8u) * 8u + 2u * t + 1u] = c3;
}
"""

CACHE_FILE = "ptx_mma-v2.json"     # measurements only (v1 stored the verdict)
TOLERANCE = 1e-2                   # the product's max error, f16 inputs and f32 accumulators


class Measured(BaseModel):
    """The probe's product error (inf for a NaN), or why it could not run."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    error: float | None = Field(default=None, ge=0)
    failure: Annotated[str, Field(max_length=400)] | None = None


def cache_key(device_name: str, driver: str, platform_version: str) -> str:
    return f"{device_name}|{driver}|{platform_version}|{FEATURE}"


def applies(platform_name: str, arch: str) -> str | None:
    """Why the probe is not even tried on this device (None: try it)."""
    if "nvidia" not in platform_name.lower():
        return "not NVIDIA's OpenCL (inline PTX is NVIDIA's)"
    try:
        sm = int(arch.removeprefix("sm_"))
    except ValueError:
        return f"compute capability unknown ({arch!r})"
    return None if sm >= MIN_SM else f"{arch} < sm_{MIN_SM}"


def run_probe(cl: Any, dev: Any) -> str | None:
    """Compile and run the probe kernel on ``dev``; None when the product is right, else why."""
    return why_not(measure(cl, dev))


def why_not(m: Measured) -> str | None:
    """None when the measurement says the instruction works, else why not."""
    if m.failure is not None or m.error is None:
        return f"the probe kernel failed: {m.failure}"
    return None if m.error < TOLERANCE else \
        f"the probe's product is wrong (max error {m.error:.3g})"


def measure(cl: Any, dev: Any) -> Measured:
    """Compile and run the probe kernel on ``dev``: the product's max error."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    try:
        ctx = cl.Context([dev])
        queue = cl.CommandQueue(ctx)
        with warnings.catch_warnings():       # the compiler's log is not news here
            warnings.simplefilter("ignore")
            prog = cl.Program(ctx, SOURCE).build()
        mf = cl.mem_flags
        da = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a.view(np.uint16).copy())
        bt = np.ascontiguousarray(b.T)                      # column-major B: k runs fastest
        db = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=bt.view(np.uint16).copy())
        out = np.zeros((16, 8), np.float32)
        dd = cl.Buffer(ctx, mf.WRITE_ONLY, out.nbytes)
        prog.mma_probe(queue, (32,), (32,), da, db, dd)
        cl.enqueue_copy(queue, out, dd)
        queue.finish()
    except Exception as exc:
        return Measured(failure=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    want = a.astype(np.float64) @ b.astype(np.float64)
    err = float(np.abs(out - want).max())
    return Measured(error=err if np.isfinite(err) else float("inf"))


def check(cl: Any, dev: Any, platform: Any, arch: str) -> tuple[bool, str]:
    """(usable, what was found): cached per device and driver."""
    skip = applies(str(platform.name), arch)
    if skip is not None:
        return False, skip
    key = cache_key(str(dev.name), str(dev.driver_version), str(platform.version))
    got, stored = cache.verdict(CACHE_FILE, key, Measured, lambda: measure(cl, dev))
    why = why_not(got)
    text = why or "mma.sync m16n8k16 f16->f32 ran and was right"
    return why is None, text + (" (cached)" if stored else "")
