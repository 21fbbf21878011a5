"""Whether a device's OpenCL compiler builds attnreg's kernels right with its optimizer on:
checked, not assumed. One real kernel -- the tiled decode_partial in float32, built from the
library's own sources -- runs a tiny problem and its partial states are compared with the
float64 reference. A device whose optimized build is wrong while the unoptimized one is right
gets every program built with ``-cl-opt-disable`` (slower, right), and its caps say so
(``extra["cl_build_fix"]``, ``extra["cl_optimizer"]`` and a line of ``settings``, which
``attnreg devices`` prints). The cache holds the two measured errors only: the build options
are decided from them here, from attnreg's own list (FIX), never read from a file.

Why this exists: PoCL 5.0 (LLVM 16, Ubuntu 24.04's package) on an x86-64 CPU miscompiled the
work-group-memory decode kernels (o_parts 0, lse off by 2%, NaN in larger cases; every
dense decode_partial / decode_fused / decode_qk / decode_pv configuration of the quick
matrix failed), while PoCL 3.1 (Debian 12) and NVIDIA's compiler build them right and PoCL 5.0
builds them right with the optimizer off (the same matrix then passed). The configuration
here is the smallest one found failing there: 128 work-items holding the next K/V tile as two
float4 each across the tile loop's barriers. The verdict is cached per device and driver
($ATTNREG_CACHE_DIR/cl_optimizer.json), so a process pays the two small builds once per
driver.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from attnreg import cache, reference
from attnreg.backends import common
from attnreg.spec import AttentionSpec

from . import program, tiles

FIX = ("-cl-opt-disable",)          # the build option a failing device's programs get
CACHE_FILE = "cl_optimizer-v2.json"   # measurements only (v1 stored the options themselves)
FAMILY = "decode_partial"
SPEC = AttentionSpec(batch=1, seq_len=1, past_len=63, num_heads=2, kv_num_heads=1,
                     head_size=32, dtype="float32", causal=False)
PARAMS = {"kv_tile": 32, "wg": 128, "m_tile": 1, "split_size": 64, "n_splits": 1,
          "block_skip": False}
TOLERANCE = 1e-4


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {n: (rng.standard_normal(shape) * 0.5).astype(np.float32)
            for n, shape in (("q", SPEC.q_shape), ("k", SPEC.kv_shape), ("v", SPEC.kv_shape))}


def run_once(cl: Any, dev: Any, extra: tuple[str, ...], source: str | None = None
             ) -> float:
    """Max abs error of the check kernel's partial states (built with ``extra`` options)
    against the float64 reference; inf when a value is NaN."""
    g = dataclasses.replace(tiles.geometry(FAMILY, "", SPEC, PARAMS), stage_v=True)
    defines = program.defines(SPEC, g, None, PARAMS)
    x = _inputs()
    ctx = cl.Context([dev])
    queue = cl.CommandQueue(ctx)
    with warnings.catch_warnings():           # the compiler's log is not news here
        warnings.simplefilter("ignore")
        prog = cl.Program(ctx, source or program.source(FAMILY, "")).build(
            options=list(program.options(defines, extra)))
    mf = cl.mem_flags
    bufs = {n: cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a) for n, a in x.items()}
    rows = SPEC.batch * SPEC.num_heads * SPEC.seq_len * PARAMS["n_splits"]
    o = np.full((rows, SPEC.head_size_v), np.nan, np.float32)
    lse = np.full(rows, np.nan, np.float32)
    bufs["o_parts"] = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=o)
    bufs["lse_parts"] = cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=lse)
    block = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR,
                      hostbuf=np.frombuffer(common.pack(SPEC, PARAMS), np.uint8))
    kernel = cl.Kernel(prog, program.ENTRY[FAMILY])
    kernel.set_args(*program.arguments(FAMILY, block, bufs))
    gsize = program.global_size(FAMILY, SPEC, g, PARAMS)
    cl.enqueue_nd_range_kernel(queue, kernel, (gsize,), (g.wg,))
    cl.enqueue_copy(queue, o, bufs["o_parts"])
    cl.enqueue_copy(queue, lse, bufs["lse_parts"])
    queue.finish()
    ro, rl = reference.partial_states(SPEC, x, PARAMS["split_size"])
    err = max(float(np.max(np.abs(o - ro.reshape(o.shape)))),
              float(np.max(np.abs(lse - rl.reshape(lse.shape)))))
    return err if np.isfinite(err) else float("inf")


class Measured(BaseModel):
    """What the check measured: the check kernel's error built optimized and, where that was
    wrong, unoptimized (inf for a NaN); or why it could not run."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    optimized: float | None = Field(default=None, ge=0)
    unoptimized: float | None = Field(default=None, ge=0)
    failure: Annotated[str, Field(max_length=300)] | None = None


def measure(cl: Any, dev: Any, source: str | None = None) -> Measured:
    """Run the check kernel optimized, and unoptimized where that was wrong."""
    try:
        err = run_once(cl, dev, (), source)
        err0 = run_once(cl, dev, FIX, source) if err > TOLERANCE else None
    except Exception as exc:      # a device that cannot run the check is not judged by it
        return Measured(failure=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    return Measured(optimized=err, unoptimized=err0)


def decide(m: Measured) -> dict[str, Any]:
    """{"fix": the options every build needs ([] or FIX), "why": what was found}."""
    err, err0 = m.optimized, m.unoptimized
    if m.failure is not None or err is None:
        return {"fix": [], "why": f"not checked: {m.failure}"}
    if err <= TOLERANCE:
        return {"fix": [], "why": f"optimized build right (max error {err:.2g})"}
    if err0 is not None and err0 <= TOLERANCE:
        return {"fix": list(FIX), "why": f"the optimizer miscompiled the check kernel (max "
                f"error {err:.3g}; {err0:.2g} with {' '.join(FIX)}): every program is built "
                f"with {' '.join(FIX)}"}
    return {"fix": [], "why": f"the check kernel was wrong with and without the optimizer "
            f"({err:.3g} / {err0 if err0 is not None else float('nan'):.3g}): nothing to fix "
            "by build options"}


def verdict(cl: Any, dev: Any, source: str | None = None) -> dict[str, Any]:
    """{"fix": the options every build needs ([] when none), "why": what was found}."""
    return decide(measure(cl, dev, source))


def check(cl: Any, dev: Any, platform: Any) -> tuple[tuple[str, ...], str]:
    """(extra build options, why): measured once per device, driver and platform version
    (cached), decided here."""
    key = f"{dev.name}|{dev.driver_version}|{platform.version}"
    got, stored = cache.verdict(CACHE_FILE, key, Measured, lambda: measure(cl, dev))
    decided = decide(got)
    return tuple(decided["fix"]), str(decided["why"]) + (" (cached)" if stored else "")
