"""What WGSL's matrix units deliver: the subgroup-matrix GEMM probe (backends/dawn/gemm_probe.py)
swept over its tiles on every Dawn adapter with subgroup matrices.

f16 A and B, f32 C = A B, L2-sized operands (default 2048^3), each config checked against
the float64 product before it is timed (median GPU time of passes of back-to-back
dispatches). Swept: result matrices per subgroup (tm x tn, unrolled as separate
variables), subgroups per workgroup, operands straight from storage or staged through
workgroup memory (keys per block, row padding), and B stored transposed (how attention
reads K). The best few configs are gemm_probe.TUNED, which `attnreg bench` runs; a device
without subgroup matrices says so and exits 0.

  python3 -m bench.gemm_probe [--quick | --focus | --tuned] [--size 2048] [--budget-s 120]
  (on the GPU machine, with .gpu set up)
"""
from __future__ import annotations

import argparse
import itertools
import sys

import attnreg
from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import gemm_probe

TILES = ((1, 1), (2, 2), (2, 4), (4, 2), (4, 4))
SUBGROUPS = ((1, 1), (2, 2), (2, 4), (4, 2))
STAGING = ((0, 0), (32, 8), (64, 8))
# --focus: around the first sweep's best on the H100 (4x2 accumulators, 2x4 subgroups, 32 keys
# staged): more subgroups, registers prefetching the next block, other block depths and pads.
FOCUS_TILES = ((4, 2), (2, 2), (2, 4), (4, 4))
FOCUS_SUBGROUPS = ((2, 4), (4, 4), (2, 2))
FOCUS_STAGING = ((32, 8, False), (32, 8, True), (16, 8, True), (64, 8, True))
FOCUS_PADS = ((32, 0, False), (32, 16, False), (32, 0, True), (32, 16, True))


def configs(quick: bool = False, focus: bool = False) -> list[gemm_probe.Config]:
    C = gemm_probe.Config
    if focus:
        grid = [C(tm, tn, sgm, sgn, stage=st, pad=pad, prefetch=pf)
                for (tm, tn), (sgm, sgn), (st, pad, pf)
                in itertools.product(FOCUS_TILES, FOCUS_SUBGROUPS, FOCUS_STAGING)]
        return grid + [C(4, 2, 2, 4, stage=st, pad=pad, prefetch=pf) for st, pad, pf in FOCUS_PADS]
    tiles = ((1, 1), (2, 4)) if quick else TILES
    subgroups = ((2, 2),) if quick else SUBGROUPS
    staging = ((0, 0), (32, 8)) if quick else STAGING
    return [C(tm, tn, sgm, sgn, stage=st, pad=pad, bt=bt)
            for (tm, tn), (sgm, sgn), (st, pad), bt
            in itertools.product(tiles, subgroups, staging, (False, True))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.gemm_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="a few configs")
    which.add_argument("--focus", action="store_true", help="around the full sweep's best")
    which.add_argument("--tuned", action="store_true",
                       help="gemm_probe.TUNED only (what `attnreg bench` runs)")
    ap.add_argument("--size", type=int, default=gemm_probe.SHAPE[0], help="M = N = K")
    ap.add_argument("--repeats", type=int, default=10, help="dispatches per timed pass")
    ap.add_argument("--samples", type=int, default=5, help="timed passes per config (median)")
    ap.add_argument("--warmup-s", type=float, default=0.1, help="busy time before each config")
    ap.add_argument("--budget-s", type=float, default=None, help="stop the sweep after this")
    ap.add_argument("--top", type=int, default=8, help="configs listed at the end")
    a = ap.parse_args(argv)
    shape = (a.size, a.size, a.size)
    for caps in attnreg.devices("dawn"):
        if not caps.available:
            print(f"dawn: {caps.reason}")
            continue
        why = gemm_probe.refusal(caps)
        if why:
            print(f"{caps.id} {caps.name}: {why}")
            continue
        dev = ddevice.get(caps, experimental=True)
        t, sg = gemm_probe.matrix_shape(caps) or (0, 0)
        print(f"{caps.id} {caps.name}: f16 {t}x{t}x{t} -> f32 on {sg}-lane subgroups, "
              f"C[{shape[0]}x{shape[1]}] = A B over K={shape[2]}, {a.repeats} dispatches a pass",
              flush=True)
        todo = list(gemm_probe.TUNED) if a.tuned else configs(a.quick, a.focus)
        res = gemm_probe.sweep(dev, todo, shape, repeats=a.repeats, samples=a.samples,
                               budget_s=a.budget_s, warmup_s=a.warmup_s,
                               log=lambda s: print(s, flush=True))
        ok = sorted((r for r in res if r.tflops), key=lambda r: -(r.tflops or 0.0))
        print(f"\nbest of {len(ok)} correct configs ({len(res) - len(ok)} skipped, failed or wrong):")
        for r in ok[:a.top]:
            print(r.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
