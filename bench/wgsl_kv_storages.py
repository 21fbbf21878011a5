"""The WebGPU plans with float16, int8 and int4 K/V side by side, beyond the bench's kv-dtypes
suite (which quantizes only the long decode): the scalar prefill (matrix_units=off), a
prefill after cached keys, and the staged decode of several query rows (whisper's shape).
GPU us per launch and back to back (medians), and each plan's max error against the float64
reference. ci/results/h200_wgsl_decode_int4_scales.txt (call 6) used it.

  python3 -m bench.wgsl_kv_storages [--backends dawn,webgpu] [--iters 20] [--cases 0,2]
                                    [--kv none,int8,int4]   (device tool)
"""
from __future__ import annotations

import argparse
import statistics

import attnreg
from attnreg import testing
from attnreg.tools.bench import _inputs

GQA = dict(num_heads=32, kv_num_heads=8, head_size=128, dtype="float16", causal=True)
CASES: list[tuple[str, attnreg.AttentionSpec, dict[str, str]]] = [
    ("prefill S=2048", attnreg.AttentionSpec(seq_len=2048, past_len=0, **GQA),
     {"matrix_units": "off"}),
    ("prefill S=1024 after 3072", attnreg.AttentionSpec(seq_len=1024, past_len=3072, **GQA),
     {"matrix_units": "off"}),
    ("staged decode S=4 T=1500", attnreg.AttentionSpec(
        seq_len=4, past_len=1496, num_heads=8, kv_num_heads=8, head_size=64, dtype="float16",
        causal=False), {}),
]


def _line(backend: str, spec: attnreg.AttentionSpec, flags: dict[str, str], iters: int) -> str:
    with attnreg.Session(backend=backend, flags=flags) as s:
        plan = s.plan(spec)
        t = _inputs(spec)      # the bench's inputs (quantized K/V with their scales)
        err, _ = testing.compare(spec, s.run(spec, t), testing.expected(spec, t))
        rt = s.runtime(plan)
        rt.launch(plan, t)
        tm = rt.timings(plan, t, iters=iters, warmup=5, warmup_s=0.5)
        gpu = statistics.median(tm["gpu_s"] or tm["wall_s"]) * 1e6
        b2b = statistics.median(tm["b2b_s"]) * 1e6
        p = plan.stages[0].params
        shown = {k: p[k] for k in ("q_tile", "qk_layout", "kv_staging", "kv_tile") if k in p}
        return f"{gpu:8.1f} us (b2b {b2b:8.1f})  err {err:.2g}  {plan.kernels} {shown}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backends", default="dawn,webgpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                    help="indices into CASES")
    ap.add_argument("--kv", default="none,int8,int4", help="K/V storages (none: the dtype's)")
    args = ap.parse_args()
    cases = [CASES[int(i)] for i in args.cases.split(",")]
    kvs = [None if k == "none" else k for k in args.kv.split(",")]
    for backend in args.backends.split(","):
        for name, base, flags in cases:
            for kv in kvs:
                spec = base.replace(kv_dtype=kv)
                try:
                    line = _line(backend, spec, flags, args.iters)
                except Exception as exc:  # a failing plan is reported, the rest still run
                    line = f"FAILED {str(exc)[:200]}"
                print(f"{backend:7s} {name:26s} {kv!s:5s} {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
