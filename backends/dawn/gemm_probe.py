"""A subgroup-matrix GEMM probe: the f16 x f16 -> f32 product rate that WGSL's matrix units
(Dawn's chromium_experimental_subgroup_matrix) deliver on a device, the ceiling the matrix
kernels are measured against (`attnreg bench`; bench/gemm_probe.py sweeps the tiles).

C[M, N] = A[M, K] B[K, N] (row-major; B optionally stored transposed, as attention's K is),
operands L2-sized and read from storage buffers either straight by subgroupMatrixLoad or
staged through workgroup memory in blocks of ``stage`` keys. Each subgroup owns tm x tn
result matrices, held as separate variables: the WGSL text (gemm_wgsl.py) is generated with
the products unrolled, because an array of accumulators is indexed dynamically and spills (10 TFLOP/s
against 55 for the same tiles unrolled by hand on the H100). Every run is checked against
the float64 product of the same f16 inputs before its rate counts.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable

from .gemm_wgsl import Config, fits, wgsl

FEATURE = "subgroup-matrix"          # probe.FEATURES' name for Dawn's experimental feature
# The probe's result is right when its largest error is this small a part of the largest
# product (f32 accumulation of K products differs from float64 by ~1e-6 of it).
REL_TOL = 1e-3
SHAPE = (2048, 2048, 2048)           # M, N, K: A and B 8 MiB each, C 16 MiB (L2-sized)


# The configs `attnreg bench` runs: the best three of bench/gemm_probe.py's sweeps on the H100
# (ci/results/h100_gemm_probe.txt, 2048^3: 89.0-89.4, 84.3 and 74.6 TFLOP/s; the first 86.0
# at 4096^3). The prefetched builds are not among them: their H100 run predates the fix of
# their B-block index and was wrong, so they have no measurement yet.
TUNED: tuple[Config, ...] = (Config(4, 2, 2, 4, stage=32), Config(4, 2, 4, 4, stage=32),
                             Config(4, 4, 1, 1))


@dataclass
class Result:
    config: Config
    tflops: float | None          # None: did not run, or ran wrong (see note)
    rel_err: float | None = None
    note: str = ""

    def line(self) -> str:
        rate = f"{self.tflops:7.1f} TFLOP/s" if self.tflops is not None else "      - TFLOP/s"
        err = f"err {self.rel_err:.1e}" if self.rel_err is not None else ""
        return f"{rate}  {self.config.text():60s} {err} {self.note}".rstrip()


def refusal(caps: DeviceCaps) -> str | None:
    """Why the probe cannot run on ``caps`` (None: it can)."""
    if FEATURE not in caps.features:
        return (f"no subgroup matrices on this device ({caps.name}: Dawn lists no "
                "chromium-experimental-subgroup-matrix)")
    if "shader-f16" not in caps.features:
        return f"no shader-f16 on this device ({caps.name}): the probe multiplies f16"
    if matrix_shape(caps) is None:
        cfgs = caps.extra.get("subgroup_matrix_configs") or []
        return f"no square f16 -> f32 subgroup-matrix shape on fixed-size subgroups ({cfgs})"
    return None


def matrix_shape(caps: DeviceCaps) -> tuple[int, int] | None:
    """(t, subgroup size): the largest square f16 -> f32 subgroup matrix (t x t x t) the
    device lists on subgroups of one fixed size, or None."""
    fits = [(int(c["m"]), int(c["min_subgroup_size"])) for c in
            caps.extra.get("subgroup_matrix_configs") or []
            if c.get("component_type") == "f16" and c.get("result_component_type") == "f32"
            and c.get("m") == c.get("n") == c.get("k")
            and c.get("min_subgroup_size") == c.get("max_subgroup_size")]
    return max(fits) if fits else None


# -- running it ------------------------------------------------------------------------
class _Buffers:
    """A, B (as stored) and C on the device, with the float64 product they must give."""

    def __init__(self, dev: Any, shape: tuple[int, int, int], bt: bool, seed: int = 0) -> None:
        m, n, k = shape
        rng = np.random.default_rng(seed)
        self.a = rng.standard_normal((m, k)).astype(np.float16)
        self.b = rng.standard_normal((k, n)).astype(np.float16)
        self.want = self.a.astype(np.float64) @ self.b.astype(np.float64)
        U = dev.wgpu.BufferUsage
        d = dev.device
        self.bufs = []
        for arr in (self.a, np.ascontiguousarray(self.b.T) if bt else self.b):
            buf = d.create_buffer(size=arr.nbytes, usage=U.STORAGE | U.COPY_DST)
            d.queue.write_buffer(buf, 0, arr.view(np.uint8).reshape(-1))
            self.bufs.append(buf)
        self.c_bytes = m * n * 4
        self.bufs.append(d.create_buffer(size=self.c_bytes, usage=U.STORAGE | U.COPY_SRC))
        self.shape = shape

    def result(self, dev: Any) -> np.ndarray:
        out = np.frombuffer(dev.read_buffer(self.bufs[2], self.c_bytes), dtype=np.float32)
        return out.reshape(self.shape[0], self.shape[1])

    def close(self) -> None:
        for b in self.bufs:
            b.destroy()


def pass_times(dev: Any, pipe: Any, group: Any, grid: tuple[int, int, int], repeats: int,
               samples: int) -> list[float]:
    """Seconds per pass of ``repeats`` dispatches, ``samples`` times (timestamps where the
    device has them, else submit to wait)."""
    ts = dev.has_timestamps
    d = dev.device
    qs = d.create_query_set(type=dev.wgpu.QueryType.timestamp, count=2 * samples) if ts else None
    secs: list[float] = []
    for s in range(samples):
        enc = d.create_command_encoder()
        marks = {"query_set": qs, "beginning_of_pass_write_index": 2 * s,
                 "end_of_pass_write_index": 2 * s + 1} if ts else None
        cp = enc.begin_compute_pass(timestamp_writes=marks) if ts else enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, group)
        for _ in range(repeats):
            cp.dispatch_workgroups(*grid)
        cp.end()
        t0 = time.perf_counter()
        dev.submit([enc.finish()])
        if not ts:
            dev.wait()
            secs.append(time.perf_counter() - t0)
    if qs is None:
        return secs
    U = dev.wgpu.BufferUsage
    nb = 16 * samples
    resolve = d.create_buffer(size=nb, usage=U.QUERY_RESOLVE | U.COPY_SRC)
    enc = d.create_command_encoder()
    enc.resolve_query_set(qs, 0, 2 * samples, resolve, 0)
    dev.submit([enc.finish()])
    try:
        ticks = np.frombuffer(dev.read_buffer(resolve, nb), dtype=np.uint64)
    finally:
        resolve.destroy()
        qs.destroy()
    return [float(ticks[2 * s + 1] - ticks[2 * s]) * 1e-9 for s in range(samples)]


def run(dev: Any, c: Config, shape: tuple[int, int, int] = SHAPE, *, repeats: int = 10,
        samples: int = 5, buffers: _Buffers | None = None, warmup_s: float = 0.2) -> Result:
    """Config ``c`` on a Dawn device with subgroup matrices (``dev``: a DawnDevice opened
    with the experimental feature): checked against float64, then timed (median of
    ``samples`` passes of ``repeats`` dispatches, after ``warmup_s`` of them: an idle GPU
    runs at low clocks). Raises RuntimeError where the device has no subgroup matrices."""
    why = refusal(dev.caps) or (None if FEATURE in _granted(dev) else
                                "this Dawn device was opened without the experimental feature")
    if why:
        raise RuntimeError(why)
    t, subgroup = matrix_shape(dev.caps) or (0, 0)
    bad = fits(c, shape, t, dev.caps, subgroup)
    if bad:
        return Result(c, None, note=f"skipped: {bad}")
    own = buffers is None
    bufs = buffers or _Buffers(dev, shape, c.bt)
    try:
        return _timed(dev, c, bufs, t, subgroup, repeats, samples, warmup_s)
    finally:
        if own:
            bufs.close()


def _granted(dev: Any) -> set[str]:
    from .probe import FEATURES

    return {FEATURES.get(f, f) for f in dev.features}


def _timed(dev: Any, c: Config, bufs: _Buffers, t: int, subgroup: int, repeats: int,
           samples: int, warmup_s: float) -> Result:
    m, n, k = bufs.shape
    try:
        pipe = dev.compile(f"gemm_probe[{c.text()}]", wgsl(c, bufs.shape, t, subgroup),
                           ("read", "read", "rw"))
    except KernelUnavailable as exc:
        return Result(c, None, note=f"compile failed: {str(exc)[:300]}")
    group = dev.device.create_bind_group(layout=dev.layout(("read", "read", "rw"))[0], entries=[
        {"binding": i, "resource": {"buffer": b}} for i, b in enumerate(bufs.bufs)])
    grid = (n // (c.sgn * c.tn * t), m // (c.sgm * c.tm * t), 1)
    pass_times(dev, pipe, group, grid, 1, 1)
    got = bufs.result(dev).astype(np.float64)
    err = float(np.abs(got - bufs.want).max() / max(float(np.abs(bufs.want).max()), 1e-30))
    if not err <= REL_TOL:
        return Result(c, None, err, note=f"WRONG: relative error {err:.2e} > {REL_TOL:g}")
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        pass_times(dev, pipe, group, grid, repeats, 1)
    secs = statistics.median(pass_times(dev, pipe, group, grid, repeats, samples))
    return Result(c, 2.0 * m * n * k * repeats / secs / 1e12, err)


def sweep(dev: Any, configs: list[Config], shape: tuple[int, int, int] = SHAPE, *,
          log: Callable[[str], None] = print, budget_s: float | None = None,
          **kw: Any) -> list[Result]:
    """Every config on ``dev`` (operands made once per B layout), logging each line; stops
    early, saying so, once ``budget_s`` is spent."""
    out: list[Result] = []
    made: dict[bool, _Buffers] = {}
    start = time.perf_counter()
    try:
        for c in configs:
            if budget_s is not None and time.perf_counter() - start > budget_s:
                log(f"(time budget of {budget_s:.0f} s spent: {len(configs) - len(out)} "
                    "configs not run)")
                break
            bufs = made.get(c.bt) or made.setdefault(c.bt, _Buffers(dev, shape, c.bt))
            r = run(dev, c, shape, buffers=bufs, **kw)
            log(r.line())
            out.append(r)
    finally:
        for b in made.values():
            b.close()
    return out


_PEAKS: dict[str, tuple[float | None, str]] = {}
_LOCK = threading.Lock()


def peak(dev: Any, configs: tuple[Config, ...] = TUNED) -> tuple[float | None, str]:
    """The best TFLOP/s of ``configs`` on ``dev`` and which config gave it (measured once
    per device and process), or None and why there is none."""
    with _LOCK:
        got = _PEAKS.get(dev.caps.id)
        if got is None:
            why = refusal(dev.caps)
            if why:
                got = (None, why)
            else:
                res = [r for r in sweep(dev, list(configs), log=lambda _: None) if r.tflops]
                best = max(res, key=lambda r: r.tflops or 0.0, default=None)
                got = ((best.tflops, f"GEMM probe {SHAPE}: {best.config.text()}") if best else
                       (None, "no GEMM probe config ran correctly on this device"))
            _PEAKS[dev.caps.id] = got
        return got
