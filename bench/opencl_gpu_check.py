"""The OpenCL check for a GPU machine in one command: the unified conformance cells
(attnreg.tools.cases: feature and covering cells of every OpenCL kernel on the device) in
worker processes, each taking whole kernels so programs build concurrently and once; again
with the NVIDIA-only knobs forced; then the variant measurements (bench/opencl_variants.py)
with the device otherwise idle. Everything lands in one folder::

    python3 -m bench.opencl_gpu_check --device H100 --out "$OUT"       # from the checkout
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attnreg
from attnreg.backends.opencl import device as ocl_device
from attnreg.backends.opencl import program as ocl_program
from attnreg.tools import cases
from attnreg.tools import conformance as conf

try:
    from bench import opencl_variants as variant_bench
except ImportError:               # run as a script (python3 bench/opencl_gpu_check.py)
    import opencl_variants as variant_bench  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent


def _kernels() -> list[attnreg.KernelInfo]:
    return attnreg.kernels("opencl")


def _order(k: attnreg.KernelInfo) -> tuple[bool, bool, bool, str]:
    """The newer variants first: one-launch decode, block skipping, the unfused decode."""
    return (k.family != "decode_fused", not k.params.get("block_skip"),
            k.family not in ("decode_qk", "decode_pv"), k.id)


FUSED = [k.id for k in _kernels() if k.family == "decode_fused"]
# f16 conversions (cvt) happen in every kernel that loads K/V; the reduce reads float32.
F16_KNOB = [k.id for k in sorted(_kernels(), key=_order)
            if "float16" in k.dtypes and k.family != "reduce"]
# (label, forced params, dtype, kernel ids)
SETS: list[tuple[str, dict[str, Any], str | None, list[str]]] = [
    ("default", {}, None, [k.id for k in sorted(_kernels(), key=_order)]),
    ("cvt-ptx", {"cvt": "ptx"}, "float16", F16_KNOB),
    ("fence-cl", {"fence": "cl"}, None, FUSED),
    ("fast", {"cvt": "ptx", "fast_exp": True, "prefetch": 2}, None,
     [k for k in FUSED if ".sg." in k]),
]


def _jobs(per_job: int = 2) -> list[tuple[str, dict[str, Any], str | None, list[str]]]:
    out = []
    for label, params, dtype, kernels in SETS:
        for i in range(0, len(kernels), per_job):
            out.append((label, params, dtype, kernels[i:i + per_job]))
    return out


def run_cells(device: str | None, kernels: list[str], params: dict[str, Any],
              dtype: str | None, quick: bool) -> dict[str, Any]:
    """The unified generator's cells of ``kernels`` on one OpenCL device, ``params`` forced
    on top of each cell's own, run against the float64 reference."""
    devs = [d for d in attnreg.registry.get().find_device("opencl", device) if d.available]
    cells = [dataclasses.replace(c, params=tuple(sorted({**dict(c.params), **params}.items())))
             for c in cases.cases(devs[:1], quick=quick)
             if c.kernel in kernels and (dtype is None or c.spec.dtype == dtype)]
    t0 = time.perf_counter()
    bad: list[str] = []
    skipped, worst = 0, 0.0
    for r in conf.run_matrix(cells):
        if r.status == "pass":
            worst = max(worst, r.max_abs_err)
        elif "could not be forced" in r.message and "workgroup storage" in r.message:
            skipped += 1      # the forced params need more local memory than the device has
        else:
            bad.append(f"{r.case.id}: {r.message[:500]}")
    return {"kernels": kernels, "params": params, "dtype": dtype, "cases": len(cells),
            "failed": len(bad), "skipped": skipped, "failures": bad,
            "worst_err": worst if math.isfinite(worst) else None,
            "seconds": round(time.perf_counter() - t0, 1)}


def conformance(device: str, workers: int, deadline_s: float, tmp: Path,
                quick: bool = True) -> dict[str, Any]:
    """Run every job in a pool of worker processes; kill what is left at the deadline."""
    jobs = _jobs()
    t0 = time.perf_counter()
    running: list[tuple[subprocess.Popen[bytes], Path, tuple[Any, ...]]] = []
    done: list[dict[str, Any]] = []
    todo = list(enumerate(jobs))
    while todo or running:
        if todo and time.perf_counter() - t0 > deadline_s:
            done += [{"set": j[0], "kernels": j[3], "dtype": j[2], "error": "not started: "
                      "past the deadline"} for _, j in todo]
            todo = []
        while todo and len(running) < workers:
            n, job = todo.pop(0)
            _, params, dtype, kernels = job
            path = tmp / f"conf_{n}.json"
            cmd = [sys.executable, "-m", "bench.opencl_gpu_check", "--worker", "--device", device,
                   "--kernels", ",".join(kernels), "--params", json.dumps(params),
                   "--json", str(path)] + (["--dtype", dtype] if dtype else []) \
                + ([] if quick else ["--full"])
            running.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=ROOT,
                                             stderr=subprocess.PIPE), path, job))
        time.sleep(0.2)
        for item in list(running):
            proc, path, job = item
            late = time.perf_counter() - t0 > deadline_s
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
            err = proc.stderr.read().decode(errors="replace")[-800:] if proc.stderr else ""
            row: dict[str, Any] = {"set": job[0], "kernels": job[3], "dtype": job[2]}
            if path.exists():
                row.update(json.loads(path.read_text()))
            else:
                row["error"] = ("killed at the deadline " if late else "no result ") + err
            done.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "failures"}), flush=True)
            for f in row.get("failures", [])[:20]:
                print("FAIL", f, flush=True)
            running.remove(item)
    return {"seconds": round(time.perf_counter() - t0, 1),
            "cases": sum(r.get("cases", 0) for r in done),
            "failed": sum(r.get("failed", 0) for r in done),
            "jobs_without_result": sum("error" in r for r in done), "jobs": done}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="NVIDIA")
    ap.add_argument("--out", default="gpu_check")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 2))
    ap.add_argument("--conformance-s", type=float, default=100.0)
    ap.add_argument("--bench-s", type=float, default=150.0)
    ap.add_argument("--bench-args", default="", help="extra variant_bench arguments")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--full", action="store_true", help="the full matrix (default: quick)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", default="", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:          # one job of conformance(): its cells, a JSON summary
        row = run_cells(a.device, a.kernels.split(","), json.loads(a.params), a.dtype,
                        not a.full)
        Path(a.json).write_text(json.dumps(row, indent=1))
        return 1 if row["failed"] else 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path("/tmp/opencl_gpu_check")
    tmp.mkdir(parents=True, exist_ok=True)
    if not a.skip_conformance:
        summary = conformance(a.device, a.workers, a.conformance_s, tmp, not a.full)
        (out / "conformance.json").write_text(json.dumps(summary, indent=1))
        print(f"conformance: {summary['cases'] - summary['failed']}/{summary['cases']} pass, "
              f"{summary['jobs_without_result']} jobs without result, {summary['seconds']} s",
              flush=True)
    # ptxas statistics (registers, spills) for the measured kernels
    extra = ocl_program.EXTRA_ENV
    os.environ[extra] = (os.environ.get(extra, "") + " -cl-nv-verbose"
                         if "nvidia" in a.device.lower() or "h100" in a.device.lower()
                         else os.environ.get(extra, ""))
    rc = variant_bench.main(["--device", a.device, "--warmup-s", "1.0", "--deadline-s",
                             str(a.bench_s), "--out", str(out / "bench.json"),
                             *a.bench_args.split()])
    with open(out / "buildlog.txt", "w") as fh:
        for key, text in ocl_device.build_logs().items():
            lines = [ln for ln in text.splitlines() if any(w in ln for w in (
                "registers", "spill", "Compiling entry", "error", "stack"))]
            if lines:
                fh.write(f"== {' '.join(o for o in key.options if o.startswith('-D'))}\n")
                fh.write("\n".join(lines) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
