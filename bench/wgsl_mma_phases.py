"""Where the WGSL matrix kernels' time goes on a GPU with subgroup matrices (Dawn).

Times dawn.prefill.f16.mma and dawn.decode_partial.f16.mma (hardware builds) beside Dawn's
scalar kernels for the same specs, then again with one phase of the matrix kernel compiled
out by editing its WGSL source: the QK product, the PV product, both, the K/V staging into
workgroup memory, the softmax's logits, the runtime bound of the PV loop. The edited builds
compute wrong results (their error is printed to show the phase really went); the time each
removal saves is that phase's share. GPU time, median, one process.

  python3 bench/wgsl_mma_phases.py [--iters 40]        (device tool, with .gpu set up)
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import attnreg
from attnreg import testing
from attnreg.backends.webgpu import program

QK_PF = "acc = mm_qk(acc, sg * 16u * QST + dc * 16u, kc * 16u * KST + dc * 16u);"
PV_PF = "acc = mm_pv(acc, sg * 16u * PST + kc * 16u, kc * 16u * VST + c * 16u);"
QK_DEC = "acc = mm_qk(acc, dc * 16u, kc * 16u * KST + dc * 16u);"
PV_DEC = "acc = mm_pv(acc, kc * 16u, kc * 16u * VST + (sg + t * NSG) * 16u);"
LOGIT_DEC = "xv = logit(s_s[rr * SST + jl] * P.scale, d.b, h, i, j, pos);"
LOGIT_PF = "xv = logit(s_s[rr * SST + jl] * P.scale, b, h, i, j, pos);"


def _phases(bound: str, tile: str, qk: str, pv: str, stage: str, logit: str
            ) -> dict[str, list[tuple[str, str]]]:
    """phase -> the (text, replacement) edits that take it out of one kernel's source: the PV
    loop's runtime bound ``bound`` (min with the constant ``tile``), the statements qk, pv and
    logit, and the K/V staging test that starts with ``stage``."""
    return {
        "full kernel": [],
        "PV loop bound constant": [(bound, tile)],
        "no QK product": [(qk, "")],
        "no PV product": [(pv, "")],
        "no matrix product at all": [(qk, ""), (pv, "")],
        "no K/V staging": [(stage, stage.replace("if (", "if (false && ", 1))],
        "no logits (scores used raw)": [(logit, "xv = 0.0;")],
    }


# source file -> phase -> (text, replacement) edits
EDITS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "flash_prefill_mma": _phases("min(NOC, P.seq_len + NOC)", "NOC", QK_PF, PV_PF,
                                 "if (stage_granule(b", LOGIT_PF),
    "decode_mma": _phases("min(TPS, P.seq_len + TPS)", "TPS", QK_DEC, PV_DEC,
                          "if (stage_granule(d.b", LOGIT_DEC),
}
GQA = dict(num_heads=32, kv_num_heads=8, head_size=128, dtype="float16", causal=True)
CASES: list[tuple[str, str, attnreg.AttentionSpec, dict[str, Any]]] = [
    ("flash_prefill_mma", "prefill S=512", attnreg.AttentionSpec(batch=1, seq_len=512, **GQA), {}),
    ("decode_mma", "decode L=8192 (256-key splits)",
     attnreg.AttentionSpec(batch=1, seq_len=1, past_len=8191, **GQA), {"split_size": 256}),
    ("decode_mma", "prefix pass 16 rows x 4096 keys (16/4 heads)", attnreg.AttentionSpec(
        batch=1, seq_len=16, past_len=4080, num_heads=16, kv_num_heads=4, head_size=128,
        dtype="float16", return_lse=True), {}),
]


def _median_us(sess: attnreg.Session, plan: attnreg.Plan, inputs: Mapping[str, Any],
               iters: int) -> float:
    rt = sess.runtime(plan)
    rt.launch(plan, inputs)
    t = rt.timings(plan, inputs, iters=iters, warmup=5)
    return statistics.median(t["gpu_s"] or t["wall_s"]) * 1e6


def _source_with(fname: str, edits: list[tuple[str, str]]) -> Callable[[str], str]:
    original = program.load

    def load(name: str) -> str:
        text = original(name)
        if name == fname:
            for old, new in edits:
                if old not in text:
                    raise SystemExit(f"{fname}.wgsl no longer contains {old!r}: update EDITS")
                text = text.replace(old, new)
        return text
    return load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    devs = [d for d in attnreg.devices("dawn") if d.device_type != "cpu"]
    if not devs:
        print("no Dawn GPU adapter")
        return 1
    dev = devs[0]
    print(f"device: {dev.name} ({dev.id}); GPU time, median of {args.iters}")
    original = program.load
    for fname, label, spec, params in CASES:
        t = testing.make_tensors(spec, 0)
        want = testing.expected(spec, t)
        with attnreg.Session(backend="dawn", device=dev.id, flags={"matrix_units": "off"}) as s:
            plan = s.plan(spec)
            print(f"\n{label}: scalar {' -> '.join(plan.kernels)} "
                  f"{_median_us(s, plan, t, args.iters):.1f} us")
        kernel = f"dawn.{'prefill' if fname == 'flash_prefill_mma' else 'decode_partial'}.f16.mma"
        for phase, edits in EDITS[fname].items():
            # program.build keys its cache by ``load``: each edit builds its own programs
            program.load = _source_with(fname, edits)
            try:
                with attnreg.Session(backend="dawn", device=dev.id, flags={
                        "experimental_features": True, "matrix_units": "on"}) as s:
                    prm = {**params, "mma": "hardware"}
                    plan = s.plan(spec, kernel=kernel, params=prm)
                    err, _ = testing.compare(spec, s.run(spec, t, kernel=kernel, params=prm), want)
                    us = _median_us(s, plan, t, args.iters)
                    shown = {k: v for k, v in plan.stages[0].params.items() if k != "mma"}
                    print(f"  {phase:30s} {us:8.1f} us  max err {err:.2g}  {shown}")
            finally:
                program.load = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
