"""The OpenCL check for a GPU machine in one command: the conformance cases of every native
variant (worker processes, each taking whole variants so programs build concurrently and
once), again with the NVIDIA-only knobs forced, then the variant measurements
(variant_bench) with the device otherwise idle. Everything lands in one folder::

    python3 -m attnreg.backends.opencl.gpu_check --device H100 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import cases as ocases
from . import programs, variant_bench

FUSED = [v for v in ocases.VARIANTS if v.startswith("decode_fused") and "-emu" not in v]
F16_KNOB = FUSED + ["unfused-m1", "partial-unfused-m2", "decode_partial-sg-m1",
                    "decode_partial-sg-m4", "prefill-sg", "prefill-wgmem", "prefill-sg-paged",
                    "decode_partial-m4-bs-paged"]
# (label, forced params, dtype, variants)
NEW_FIRST = sorted((v for v in ocases.VARIANTS if "-emu" not in v
                    and v not in ("partial-m1", "reduce", "decode_partial-m2")),
                   key=lambda v: (not v.startswith("decode_fused"), "-bs" not in v,
                                  "-paged" not in v, "unfused" not in v, v))
SETS: list[tuple[str, dict[str, Any], str | None, list[str]]] = [
    ("default", {}, None, NEW_FIRST),
    ("cvt-ptx", {"cvt": "ptx"}, "float16", F16_KNOB),
    ("fence-cl", {"fence": "cl"}, None, FUSED),
    ("fast", {"cvt": "ptx", "fast_exp": True, "prefetch": 2}, None,
     [v for v in FUSED if "-sg" in v]),
]


def _jobs(per_job: int = 2) -> list[tuple[str, dict[str, Any], str | None, list[str]]]:
    out = []
    for label, params, dtype, variants in SETS:
        for i in range(0, len(variants), per_job):
            out.append((label, params, dtype, variants[i:i + per_job]))
    return out


def conformance(device: str, workers: int, deadline_s: float, tmp: Path) -> dict[str, Any]:
    """Run every job in a pool of worker processes; kill what is left at the deadline."""
    jobs = _jobs()
    t0 = time.perf_counter()
    running: list[tuple[subprocess.Popen[bytes], Path, tuple[Any, ...]]] = []
    done: list[dict[str, Any]] = []
    todo = list(enumerate(jobs))
    while todo or running:
        if todo and time.perf_counter() - t0 > deadline_s:
            done += [{"set": j[0], "variants": j[3], "dtype": j[2], "error": "not started: "
                      "past the deadline"} for _, j in todo]
            todo = []
        while todo and len(running) < workers:
            n, job = todo.pop(0)
            _, params, dtype, variants = job
            path = tmp / f"conf_{n}.json"
            cmd = [sys.executable, "-m", "attnreg.backends.opencl.cases", "--device", device,
                   "--variants", ",".join(variants), "--params", json.dumps(params),
                   "--json", str(path)] + (["--dtype", dtype] if dtype else [])
            running.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
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
            row: dict[str, Any] = {"set": job[0], "variants": job[3], "dtype": job[2]}
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
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path("/tmp/opencl_gpu_check")
    tmp.mkdir(parents=True, exist_ok=True)
    if not a.skip_conformance:
        conf = conformance(a.device, a.workers, a.conformance_s, tmp)
        (out / "conformance.json").write_text(json.dumps(conf, indent=1))
        print(f"conformance: {conf['cases'] - conf['failed']}/{conf['cases']} pass, "
              f"{conf['jobs_without_result']} jobs without result, {conf['seconds']} s", flush=True)
    # ptxas statistics (registers, spills) for the measured kernels
    os.environ[programs.EXTRA_ENV] = (os.environ.get(programs.EXTRA_ENV, "") + " -cl-nv-verbose"
                                      if "nvidia" in a.device.lower() or "h100" in a.device.lower()
                                      else os.environ.get(programs.EXTRA_ENV, ""))
    rc = variant_bench.main(["--device", a.device, "--warmup-s", "1.0", "--deadline-s",
                             str(a.bench_s), "--out", str(out / "bench.json"),
                             *a.bench_args.split()])
    with open(out / "buildlog.txt", "w") as fh:
        for key, text in programs.build_logs().items():
            lines = [ln for ln in text.splitlines() if any(w in ln for w in (
                "registers", "spill", "Compiling entry", "error", "stack"))]
            if lines:
                fh.write(f"== {' '.join(o for o in key.options if o.startswith('-D'))}\n")
                fh.write("\n".join(lines) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
