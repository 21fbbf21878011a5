"""The WGSL kernels with and without the builder's unrolling (backends/webgpu/unroll.py), side
by side on one device: every case of the bench's decode, long-context, whisper and prefill
suites and the int8 / int4 long decodes, each timed with the shader's `// @unroll` loops
written out and left as loops, in alternating rounds (all shown; the ratio is of
their medians). GPU us per run (the plan's stages), median; err = max abs error against
the float64 reference of each build.

  python3 -m bench.unroll_ab [--backend dawn,webgpu] [--rounds 4] [--iters 20] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import attnreg
from attnreg import testing
from attnreg.backends.webgpu import program, unroll
from attnreg.tools import bench_suites
from bench.prefill_tiles import rolled, unroll_on

SUITES = ("decode", "long-context", "whisper", "prefill")


def _cases(quick: bool) -> list[bench_suites.Case]:
    cases = [c for _, c in bench_suites.suite_cases(SUITES, quick)]
    return cases + [c for _, c in bench_suites.suite_cases(["kv-dtypes"], quick)
                    if c.spec.kv_dtype is not None]


def _time(s: attnreg.Session, spec: attnreg.AttentionSpec, t: Any, want: Any,
          iters: int) -> tuple[float, float]:
    # programs are built again under the current hook (the build cache was cleared), so the
    # same plan on the same device runs the other build
    plan = s.plan(spec)
    err, _ = testing.compare(spec, s.run(spec, t), want)
    rt: Any = s.runtime(plan)
    tm = rt.timings(plan, t, iters=iters, warmup=5, warmup_s=0.3)
    return statistics.median(tm["gpu_s"] or tm["wall_s"]) * 1e6, err


def compare(backend: str, rounds: int, iters: int, quick: bool, log: Any = print) -> None:
    devs = [d for d in attnreg.devices(backend) if d.device_type != "cpu"] or \
        attnreg.devices(backend)
    dev = devs[0]
    log(f"\n## {backend}: {dev.name} ({dev.id}); GPU us per run, median of {iters}")
    log(f"{'case':28s} {'unrolled':>27s} {'rolled':>27s}  ratio  err (unrolled / rolled)")
    with attnreg.Session(backend=backend, device=dev.id, flags={"matrix_units": "off"}) as s:
        for case in _cases(quick):
            got: dict[str, list[float]] = {"on": [], "off": []}
            errs: dict[str, float] = {}
            t = testing.make_tensors(case.spec, 0)
            want = testing.expected(case.spec, t)
            for _ in range(rounds):
                for mode, hook in (("on", unroll_on), ("off", rolled)):
                    unroll.unroll = hook
                    program._BUILT.clear()
                    try:
                        us, errs[mode] = _time(s, case.spec, t, want, iters)
                        got[mode].append(us)
                    except Exception as exc:      # reported, not fatal
                        log(f"  {case.name} {mode}: {type(exc).__name__}: {str(exc)[:160]}")
                    finally:
                        unroll.unroll = unroll_on
            if got["on"] and got["off"]:
                on, off = statistics.median(got["on"]), statistics.median(got["off"])
                log(f"{case.name:28s} {' '.join(f'{u:6.1f}' for u in got['on']):>27s} "
                    f"{' '.join(f'{u:6.1f}' for u in got['off']):>27s}  {on / off:5.3f}  "
                    f"{errs['on']:.2g} / {errs['off']:.2g}")
            sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="dawn,webgpu")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="the small cases (lavapipe)")
    a = ap.parse_args(argv)
    for b in a.backend.split(","):
        compare(b, a.rounds, a.iters, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
