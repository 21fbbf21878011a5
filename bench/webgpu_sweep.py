"""Timing and tuning sweeps of the WebGPU kernels, built on WebGpuRuntime.timings().

`attnreg bench` times the default plans through the same timings(); this module adds what
tuning needs: forced parameters per case (tile sweeps), the split-KV stages timed apart,
and a correctness check of each timed variant. Run on a device machine as::

    python3 -m bench.webgpu_sweep --out results.json [--sweep] [--suite decode ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import attnreg
from attnreg import reference
from attnreg.spec import AttentionSpec
from attnreg.testing import random_qkv
from attnreg.tools import bench_suites

# Parameter sets tried per suite by --sweep (each must fit the device or it is reported).
# A "split_size" entry is passed as the session flag (the rule then derives n_splits).
SWEEPS: dict[str, list[dict[str, Any]]] = {
    "decode": [{"kv_tile": 32, "threads": 128}, {"kv_tile": 16, "threads": 64}],
    "prefill": [{"q_tile": 16, "kv_tile": 64, "rows_per_thread": 1}, {"prefetch": 0},
                {"kv_staging": "direct"}, {"kv_staging": "workgroup"},
                {"out_tile": "half_workgroup"}],
}
SWEEPS["long-context"] = SWEEPS["decode"]
SWEEPS["whisper"] = SWEEPS["decode"]


def measure(session: attnreg.Session, spec: AttentionSpec, inputs: Mapping[str, np.ndarray], *,
            params: Mapping[str, Any] | None = None, op: str = "attention", iters: int = 50,
            warmup: int = 5, warmup_s: float = 0.2, check: bool = True) -> dict[str, Any]:
    """Median GPU/wall microseconds, GB/s and TFLOP/s of one (spec, params) on the session's
    device; with check, the max error against the float64 reference."""
    p = dict(params or {})
    flags = {"split_size": p.pop("split_size")} if "split_size" in p else None
    params = p or None
    plan = session.plan(spec, op=op, params=params, flags=flags)
    rt: Any = session.runtime(plan)
    times = rt.timings(plan, inputs, iters=iters, warmup=warmup, warmup_s=warmup_s)
    nbytes, flops = bench_suites.traffic(spec)
    gpu = statistics.median(times["gpu_s"]) * 1e6 if times.get("gpu_s") else None
    wall = statistics.median(times["wall_s"]) * 1e6
    basis = gpu if gpu is not None else wall
    row: dict[str, Any] = {
        "spec": spec.short(), "op": op, "kernels": list(plan.kernels),
        "params": {k: v for s in plan.stages for k, v in s.params.items()},
        "gpu_us": gpu, "gpu_min_us": min(times["gpu_s"]) * 1e6 if gpu else None,
        "wall_us": wall, "gb_s": nbytes / basis / 1e3, "tflops": flops / basis / 1e6}
    if check and op == "attention":
        got = session.run(spec, inputs, params=params, flags=flags)
        want = reference.out_layout(spec, reference.attention(spec, inputs)[0])
        row["max_err"] = float(np.abs(got.astype(np.float64) - want).max())
    return row


def run(suites: Sequence[str], *, sweep: bool, iters: int, check: bool, quick: bool = False,
        checks: Sequence[str] = ("",), rounds: int = 1, warmup_s: float = 0.2,
        log: Any = print) -> list[dict[str, Any]]:
    """Time every case of the suites (and, with sweep, its parameter variants). Variants are
    timed in ``rounds`` interleaved passes and each keeps its best median, so that a busy
    moment on a shared GPU does not decide a comparison."""
    rows = []
    with attnreg.Session(backend="webgpu") as session:
        dev = session.runtime(session.plan(AttentionSpec(), op="attention")).caps
        log(f"device: {dev.label} limits={dev.limits} sg={dev.subgroup_min_size}.."
            f"{dev.subgroup_max_size} units={dev.compute_units}")
        for suite, case in bench_suites.suite_cases(suites, quick):
            spec = case.spec
            inputs = random_qkv(spec)
            variants = SWEEPS.get(suite, [{}]) if sweep else [{}]
            runs: list[tuple[str, dict[str, Any], str]] = []
            for mode in checks:
                runs.append((mode, {}, "attention"))
                if spec.seq_len <= 4:
                    runs.append((mode, {}, "partial"))
            runs += [("", v, "attention") for v in variants if v]
            best: dict[int, dict[str, Any]] = {}
            for rnd in range(rounds):
                for n, (mode, params, op) in enumerate(runs):
                    _set_checks(mode)
                    try:
                        row = measure(session, spec, inputs, params=params or None, op=op,
                                      iters=iters, warmup_s=warmup_s,
                                      check=check and not params and rnd == 0 and n == 0)
                    except Exception as exc:
                        row = {"spec": spec.short(), "op": op, "params": params,
                               "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    row.update(case=case.name, suite=suite, sweep=params, checks=mode)
                    old = best.get(n)
                    if old is None or (row.get("gpu_us") or row.get("wall_us") or 1e30) < \
                            (old.get("gpu_us") or old.get("wall_us") or 1e30):
                        row["max_err"] = row.get("max_err", (old or {}).get("max_err"))
                        row["rounds"] = (old or {}).get("rounds", []) + [row.get("gpu_us")]
                        best[n] = row
                    else:
                        old["rounds"].append(row.get("gpu_us"))
            for n in sorted(best):
                rows.append(best[n])
                log(json.dumps(best[n]))
    return rows


def _set_checks(mode: str) -> None:
    from attnreg.backends.webgpu.device import CHECKS_ENV

    if mode:
        os.environ[CHECKS_ENV] = mode
    else:
        os.environ.pop(CHECKS_ENV, None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", nargs="*", default=list(bench_suites.SUITES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the small cases (lavapipe)")
    ap.add_argument("--checks", default="", help="comma-separated WGSL check modes to compare "
                    "on the default plans (all, bounds, none)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup-s", type=float, default=0.2,
                    help="launch each case this long before timing it (GPU clocks ramp up)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rows = run(a.suite, sweep=a.sweep, iters=a.iters, check=not a.no_check, quick=a.quick,
               checks=a.checks.split(",") if a.checks else ("",), rounds=a.rounds, warmup_s=a.warmup_s)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
