"""Timing and tuning sweeps of the OpenCL kernels, built on OpenCLRuntime.timings().

`attnreg bench` times the default plans through the same timings(); this module adds the
per-kernel view used for tuning: forced kernels and parameters per case, the stages of a
split-KV plan timed apart, and the max error of each timed variant. On a device machine::

    python3 -m bench.opencl_sweep --device h100 --sweep --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import attnreg
from attnreg import reference
from attnreg.backends.opencl import device as ocl_device
from attnreg.spec import AttentionSpec
from attnreg.testing import random_qkv
from attnreg.tools import bench_suites

# Forced (kernel-suffix, params) per suite for --sweep; "" = the plan the rules choose.
SWEEPS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "decode": [("", {}), ("", {"prefetch": 2}), ("", {"prefetch": 2, "wg": 256, "split_size": 512}),
               ("", {"wg": 256, "split_size": 512}), ("", {"prefetch": 2, "split_size": 256}),
               ("", {"prefetch": 2, "wg": 64}), ("m1", {"wg": 64, "kv_tile": 16})],
    "prefill": [("", {}), ("wgmem", {}), ("sg", {"block_m": 16}), ("sg.m4", {}),
                ("sg.m4", {"prefetch": 2})],
}
SWEEPS["long-context"] = SWEEPS["decode"]
SWEEPS["whisper"] = SWEEPS["decode"]


def kv_bytes(spec: AttentionSpec) -> int:
    """K and V bytes that must be read once (valid keys only)."""
    return 2 * spec.batch * spec.kv_num_heads * spec.total_len * spec.head_size * spec.itemsize


def _kernel_id(spec: AttentionSpec, suffix: str) -> str | None:
    if not suffix:
        return None
    tag = "f16" if spec.dtype == "float16" else "f32"
    if suffix.startswith(("m", "sg.m")):
        return f"opencl.decode_partial.{tag}.{suffix}"
    return f"opencl.prefill.{tag}.{suffix}"


def measure(session: attnreg.Session, spec: AttentionSpec, inputs: Mapping[str, np.ndarray], *,
            kernel: str | None = None, params: Mapping[str, Any] | None = None,
            iters: int = 50, warmup: int = 5, want: np.ndarray | None = None) -> dict[str, Any]:
    """Median GPU/wall microseconds, effective K+V GB/s and TFLOP/s of one plan; with
    ``want`` (the reference output), the max error against it."""
    plan = session.plan(spec, kernel=kernel, params=params)
    rt: Any = session.runtime(plan)
    times = rt.timings(plan, inputs, iters=iters, warmup=warmup)
    _, flops = bench_suites.traffic(spec)
    gpu = statistics.median(times["gpu_s"]) * 1e6
    wall = statistics.median(times["wall_s"]) * 1e6
    row: dict[str, Any] = {
        "spec": spec.short(), "kernels": list(plan.kernels),
        "params": {k: v for s in plan.stages for k, v in s.params.items()},
        "gpu_us": round(gpu, 2), "gpu_min_us": round(min(times["gpu_s"]) * 1e6, 2),
        "wall_us": round(wall, 2), "kv_gb_s": round(kv_bytes(spec) / gpu / 1e3, 1),
        "tflops": round(flops / gpu / 1e6, 3),
        "stage_us": {k: round(statistics.median(v) * 1e6, 2)
                     for k, v in times.get("stage_gpu_s", {}).items()},
        "kernel_info": times.get("kernels", {})}
    if want is not None:
        got = session.run(spec, inputs, kernel=kernel, params=params)
        row["max_err"] = float(np.abs(got.astype(np.float64) - want).max())
    return row


def run(suites: Sequence[str], *, device: str | None = None, sweep: bool = False,
        iters: int = 50, check: bool = True, quick: bool = False,
        log: Any = print) -> list[dict[str, Any]]:
    """Every case of the suites (attnreg.tools.bench_suites' tables) on one OpenCL device."""
    rows: list[dict[str, Any]] = []
    with attnreg.Session(backend="opencl", device=device) as session:
        dev = session.plan(AttentionSpec()).caps
        log(f"device: {dev.label} vendor={dev.vendor} arch={dev.architecture} "
            f"units={dev.compute_units} limits={dev.limits}")
        for suite, case in bench_suites.suite_cases(suites, quick):
            spec = case.spec
            inputs = random_qkv(spec)
            want = reference.out_layout(spec, reference.attention(spec, inputs)[0]) \
                if check else None
            for suffix, params in (SWEEPS.get(suite, [("", {})]) if sweep else [("", {})]):
                try:
                    row = measure(session, spec, inputs, kernel=_kernel_id(spec, suffix),
                                  params=params or None, iters=iters, want=want)
                except Exception as exc:   # a variant that cannot run is reported, not fatal
                    row = {"spec": spec.short(), "error": f"{type(exc).__name__}: {exc}"[:400]}
                row.update(case=case.name, forced=suffix, sweep=params, device=dev.slug)
                rows.append(row)
                log(json.dumps(row))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="device id or part of its name")
    ap.add_argument("--suite", action="append", choices=sorted(bench_suites.SUITES))
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEPS variants")
    ap.add_argument("--quick", action="store_true", help="small cases (CPU devices)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--binaries", default=None, help="directory for the built binaries")
    ap.add_argument("--logs", default=None, help="file for the compiler logs")
    a = ap.parse_args(argv)
    rows = run(a.suite or list(bench_suites.SUITES), device=a.device, sweep=a.sweep,
               iters=a.iters, check=not a.no_check, quick=a.quick)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    if a.logs:
        with open(a.logs, "w") as fh:
            for key, text in ocl_device.build_logs().items():
                fh.write(f"== {' '.join(key.options)}\n{text.strip()}\n")
    if a.binaries:
        os.makedirs(a.binaries, exist_ok=True)
        for n, (key, blob) in enumerate(ocl_device.binaries().items()):
            tag = "_".join(o.split("=")[-1] for o in key.options if o.startswith("-D"))
            with open(os.path.join(a.binaries, f"p{n:03d}_{tag}.bin"), "wb") as fh:
                fh.write(blob)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
