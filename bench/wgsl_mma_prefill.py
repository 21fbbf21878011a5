"""The WGSL matrix prefill's two forms beside Dawn's scalar prefill, and where the direct
form's time goes.

Times, in one process and alternating over ``--rounds`` rounds, Dawn's scalar prefill
(matrix_units=off), the staged matrix prefill (dawn.prefill.f16.mma: Q, K and V staged in
workgroup memory) and the direct one (dawn.prefill.f16.mma_direct: Q and K loaded by the
matrix units straight from storage) at several tiles, each with its largest error against
the float64 reference; then the fastest direct tiles with one phase compiled out at a time
(bench/wgsl_mma_phases.py's source edits: wrong values, their error printed to show the
phase went). GPU time per launch (timestamp queries, median), f16 causal GQA 32/8 H=128.

  python3 bench/wgsl_mma_prefill.py [--iters 40] [--rounds 2] [--seq 512,2048]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attnreg
from attnreg import testing
from attnreg.backends.webgpu import program
from bench.wgsl_mma_phases import LOGITS, Edit, _median_us, source_with

GQA = dict(num_heads=32, kv_num_heads=8, head_size=128, dtype="float16", causal=True)
ON = {"experimental_features": True, "matrix_units": "on"}
STAGED, DIRECT = "dawn.prefill.f16.mma", "dawn.prefill.f16.mma_direct"
# label -> (kernel or None for the scalar plan, params)
VARIANTS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "scalar (matrix_units=off)": (None, {}),
    "staged q32 kv32": (STAGED, {"mma": "hardware"}),
    "direct q64 kv32": (DIRECT, {"mma": "hardware", "q_tile": 64, "kv_tile": 32}),
    "direct q32 kv32": (DIRECT, {"mma": "hardware", "q_tile": 32, "kv_tile": 32}),
    "direct q16 kv32": (DIRECT, {"mma": "hardware", "q_tile": 16, "kv_tile": 32}),
    "direct q16 kv64": (DIRECT, {"mma": "hardware", "q_tile": 16, "kv_tile": 64}),
}
EMULATE = False       # --emulate: the emulated builds (a check of this script on lavapipe)
PF = "flash_prefill_mma_direct"
HW = "mma_hw_direct"
NO_QK: Edit = (HW, "let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>"
               "(&k, ko, ks);\n  return subgroupMatrixMultiplyAccumulate(a, bm, acc);",
               "return acc;")
NO_PV: Edit = (HW, "let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>"
               "(&v_s, vo, V_STRIDE);\n  return subgroupMatrixMultiplyAccumulate(a, bm, acc);",
               "return acc;")
NO_STAGE: Edit = (PF, "stage_v(w.b, w.kvh, j0, lo, hi, lid, vb);", "")
PHASES: dict[str, list[Edit]] = {
    "full kernel": [], "no QK product (nor K loads)": [NO_QK],
    "no PV product (nor P loads)": [NO_PV], "no matrix product at all": [NO_QK, NO_PV],
    "no V staging": [NO_STAGE], "no logits (scores used raw)": [LOGITS],
    "products and staging out": [NO_QK, NO_PV, NO_STAGE],
}


def _run(dev: str, spec: attnreg.AttentionSpec, t: Mapping[str, Any], want: Any,
         kernel: str | None, params: dict[str, Any], iters: int) -> tuple[float, float, str]:
    """(median us, max error, the stage's kernel and params)."""
    flags = ON if kernel else {"matrix_units": "off"}
    if kernel and EMULATE:
        params = {**params, "mma": "emulate"}
    with attnreg.Session(backend="dawn", device=dev, flags=flags) as s:
        kw: dict[str, Any] = {"kernel": kernel, "params": params} if kernel else {}
        plan = s.plan(spec, **kw)
        err, _ = testing.compare(spec, s.run(spec, t, **kw), want)
        st = plan.stages[0]
        shown = {k: v for k, v in st.params.items() if k in ("q_tile", "kv_tile", "form")}
        return _median_us(s, plan, t, iters), err, f"{' -> '.join(plan.kernels)} {shown}"


def _tflops(spec: attnreg.AttentionSpec, us: float) -> float:
    s, h = spec.seq_len, spec.head_size
    return 4 * spec.num_heads * h * s * (s + 1) / 2 / (us * 1e-6) / 1e12


def _side_by_side(dev: str, seqs: list[int], iters: int, rounds: int) -> dict[int, str]:
    """Every variant at every length, alternating; the fastest direct label per length."""
    best: dict[int, str] = {}
    for n in seqs:
        spec = attnreg.AttentionSpec(batch=1, seq_len=n, **GQA)
        t = testing.make_tensors(spec, 0)
        want = testing.expected(spec, t)
        print(f"\nS={n} ({_tflops(spec, 1e6) * 1e3:.2f} GFLOP causal)", flush=True)
        got: dict[str, list[float]] = {}
        for r in range(rounds):
            for label, (kernel, params) in VARIANTS.items():
                try:
                    us, err, what = _run(dev, spec, t, want, kernel, params, iters)
                except Exception as exc:  # a failing variant is reported
                    print(f"  round {r}  {label:28s} FAILED: {str(exc)[:300]}", flush=True)
                    continue
                got.setdefault(label, []).append(us)
                print(f"  round {r}  {label:28s} {us:9.1f} us  {_tflops(spec, us):5.1f} TFLOP/s"
                      f"  max err {err:.2g}  {what}", flush=True)
        direct = {k: statistics.median(v) for k, v in got.items() if k.startswith("direct")}
        if direct:
            best[n] = min(direct, key=lambda k: direct[k])
    return best


def _phases(dev: str, n: int, label: str, iters: int) -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=n, **GQA)
    t = testing.make_tensors(spec, 0)
    want = testing.expected(spec, t)
    kernel, params = VARIANTS[label]
    print(f"\nphases of {label}, S={n}:", flush=True)
    original = program.load
    for phase, edits in PHASES.items():
        program.load = source_with(edits)       # program.build caches by ``load``
        try:
            us, err, _ = _run(dev, spec, t, want, kernel, params, iters)
            print(f"  {phase:32s} {us:9.1f} us  max err {err:.2g}", flush=True)
        except Exception as exc:  # reported, as above
            print(f"  {phase:32s} FAILED: {str(exc)[:300]}", flush=True)
        finally:
            program.load = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", default="512,2048")
    ap.add_argument("--phases", type=int, default=2048, help="length of the phase account "
                    "(0: none)")
    ap.add_argument("--any-device", action="store_true", help="run on a CPU adapter too "
                    "(lavapipe: checks the script, with the emulated builds)")
    ap.add_argument("--emulate", action="store_true", help="the matrix kernels' emulated "
                    "builds (with --any-device: checks this script on lavapipe)")
    args = ap.parse_args()
    global EMULATE
    EMULATE = args.emulate
    devs = [d for d in attnreg.devices("dawn") if args.any_device or d.device_type != "cpu"]
    if not devs:
        print("no Dawn GPU adapter")
        return 1
    print(f"device: {devs[0].name} ({devs[0].id}); GPU time per launch, median of {args.iters}")
    best = _side_by_side(devs[0].id, [int(x) for x in args.seq.split(",")], args.iters,
                         args.rounds)
    if args.phases and args.phases in best:
        _phases(devs[0].id, args.phases, best[args.phases], args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
