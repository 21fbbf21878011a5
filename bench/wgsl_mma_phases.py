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
from attnreg import shaders, testing
from attnreg.backends.webgpu import program

# An edit: (source file, text, replacement). The softmax's logits are in mma_common.wgsl,
# which both kernels include.
Edit = tuple[str, str, str]
PF, DEC, COMMON = "flash_prefill_mma", "decode_mma", "mma_common"
QK_PF = (PF, "acc = mm_qk(acc, sg * 16u * Q_STRIDE + dc * 16u, kc * 16u * K_STRIDE + dc * 16u);",
         "")
PV_PF = (PF, "acc = mm_pv(acc, sg * 16u * P_STRIDE + kc * 16u, kc * 16u * V_STRIDE + c * 16u);",
         "")
QK_DEC = (DEC, "acc = mm_qk(acc, dc * 16u, kc * 16u * K_STRIDE + dc * 16u);", "")
PV_DEC = (DEC, "acc = mm_pv(acc, kc * 16u, kc * 16u * V_STRIDE + (sg + t * SUBGROUPS) * 16u);",
          "")
LOGITS = (COMMON, "let d = s_s[rr * S_STRIDE + jl] * P.scale;", "let d = 0.0;")
# the same in lane_logits' fast path (parts whose keys the row all sees)
LOGITS_FAST = (COMMON, "let xv = plain_logit(s_s[rr * S_STRIDE + part * LANE_KEYS + (e + rot) % LANE_KEYS]\n"
               "                           * P.scale);", "let xv = 0.0;")


def _phases(qk: Edit, pv: Edit, bound: Edit, staging: Edit) -> dict[str, list[Edit]]:
    """A kernel's phases -> the edits that take each out."""
    return {"full kernel": [], "PV loop bound constant": [bound], "no QK product": [qk],
            "no PV product": [pv], "no matrix product at all": [qk, pv],
            "no K/V staging": [staging], "no logits (scores used raw)": [LOGITS, LOGITS_FAST]}


EDITS: dict[str, dict[str, list[Edit]]] = {
    PF: _phases(QK_PF, PV_PF, (PF, "min(OUT_TILES, P.seq_len + OUT_TILES)", "OUT_TILES"),
                (PF, "stage_tiles(w.b, w.kvh, j0, lo, hi, lid);", "")),
    DEC: _phases(QK_DEC, PV_DEC, (DEC, "min(SG_TILES, P.seq_len + SG_TILES)", "SG_TILES"),
                 (DEC, "stage_tiles(d.b, d.kvh, j0, 0u, hi, lid);", "")),
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


def source_with(edits: list[Edit]) -> Callable[[str], str]:
    """program.load with ``edits`` applied. Only the kernel sources (shaders.FAMILIES) pass
    through program.load; an edit of a piece file (prefix, storage, kv_units) would silently
    change nothing, so it is refused."""
    original = program.load
    pieces = [f for f, _, _ in edits if f not in shaders.FAMILIES]
    if pieces:
        raise SystemExit(f"edits of {sorted(set(pieces))}: not kernel sources program.load "
                         "reads; the edit would change nothing")

    def load(name: str) -> str:
        text = original(name)
        for fname, old, new in edits:
            if name == fname:
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
            program.load = source_with(edits)
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
