"""The WGSL matrix prefill's two forms beside Dawn's scalar prefill, and where the direct
form's time goes.

Times, in one process and alternating over ``--rounds`` rounds, Dawn's scalar prefill
(matrix_units=off), the staged matrix prefill (dawn.prefill.f16.mma: Q, K and V staged in
workgroup memory one f16 at a time) and the direct one (dawn.prefill.f16.mma_direct: Q loaded
by the matrix units straight from storage, K and V staged by the whole workgroup in 16-byte
granules) at several tiles (``--only``; a variant may carry source edits), each with its
largest error against the float64 reference; then the fastest direct tiles with one phase
compiled out at a time (bench/wgsl_mma_phases.py's source edits: wrong values, their error
printed to show the phase went). GPU time per launch (timestamp queries, median), f16 causal
GQA 32/8 H=128. Variants with source edits also take the kernel apart: its rare branches
(rescale, non-finite v) taken out or reshaped, the flags read with fewer barriers, V read
straight from storage (ci/results/h200_wgsl_mma_prefill_branches.txt). ``--tag`` labels the
lines, so that runs of two trees (this script copied
into each) can be told apart and alternated.

  python3 bench/wgsl_mma_prefill.py [--iters 40] [--rounds 2] [--seq 512,2048] [--only a,b]
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
from attnreg.backends.webgpu import program, wgsl_io
from bench.wgsl_mma_phases import LOGITS, Edit, _median_us, source_with

GQA = dict(num_heads=32, kv_num_heads=8, head_size=128, dtype="float16", causal=True)
ON = {"experimental_features": True, "matrix_units": "on"}
STAGED, DIRECT = "dawn.prefill.f16.mma", "dawn.prefill.f16.mma_direct"
EMULATE = False       # --emulate: the emulated builds (a check of this script on lavapipe)
PF = "flash_prefill_mma_direct"
HW = "mma_hw_direct"
NO_QK: Edit = (HW, "let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>"
               "(&k_s, ko, K_STRIDE);\n  return subgroupMatrixMultiplyAccumulate(a, bm, acc);",
               "return acc;")
NO_PV: Edit = (HW, "let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>"
               "(&v_s, vo, V_STRIDE);\n  return subgroupMatrixMultiplyAccumulate(a, bm, acc);",
               "return acc;")
NO_K: Edit = (PF, "    stage_k_units(kr, lid);\n", "")
NO_V: Edit = (PF, "    stage_v_units(vr, lid);\n", "")
# the logits of attn_common.wgsl's logit (its per-score feature tests) instead of plain_logit
FULL_LOGITS: Edit = ("mma_common", "if (PLAIN_LOGITS == 1u) {", "if (false) {")
# label -> (kernel or None for the scalar plan, params, source edits)
# The softmax's loops over a lane's scores written out by the builder (// @unroll), as the
# scalar prefill's are (the final build left them rolled, measured equal on another build).
UNROLLED: list[Edit] = [
    ("mma_common", "  for (var e = 0u; e < LANE_KEYS; e++) {\n    let jl",
     "  for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll\n    let jl"),
    ("mma_common", "  for (var e = 0u; e < LANE_KEYS; e++) {\n    let p = weight_of",
     "  for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll\n    let p = weight_of"),
    (PF, "  for (var e = 0u; e < LANE_KEYS; e++) {\n    best = max",
     "  for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll\n    best = max")]
VARIANTS: dict[str, tuple[str | None, dict[str, Any], list[Edit]]] = {
    "scalar": (None, {}, []),
    "staged-q32-kv32": (STAGED, {"mma": "hardware"}, []),
    "direct-q64-kv32": (DIRECT, {"mma": "hardware", "q_tile": 64, "kv_tile": 32}, []),
    "direct-q32-kv32": (DIRECT, {"mma": "hardware", "q_tile": 32, "kv_tile": 32}, []),
    "direct-q64-kv32-full-logits": (DIRECT, {"mma": "hardware", "q_tile": 64, "kv_tile": 32},
                                    [FULL_LOGITS]),
    "direct-q64-kv32-unrolled": (DIRECT, {"mma": "hardware", "q_tile": 64, "kv_tile": 32},
                                 UNROLLED),
    "direct-q16-kv64": (DIRECT, {"mma": "hardware", "q_tile": 16, "kv_tile": 64}, []),
}
# V read by the PV products straight from storage (v bound as halves, not staged): what v's
# staging costs; wrong only where a key a row cannot see has a non-finite v (0 * NaN), which
# the bench has not. (Built with 128 rows or 64 keys, Dawn still counted v_s: 55840 / 66336
# bytes of workgroup memory, over the 48 KiB.)
V_STORAGE: list[Edit] = [
    (HW, "fn mm_pv_left(acc: MAcc, a: MLeft, vo: u32) -> MAcc {",
     "fn mm_pv_left(acc: MAcc, a: MLeft, vo: u32, vp: u32) -> MAcc {"),
    (HW, "(&v_s, vo, V_STRIDE)", "(&v, vo, vp)"),
    (PF, "p3: MLeft, vo: u32) -> MAcc {", "p3: MLeft, vo: u32, vp: u32) -> MAcc {"),
    (PF, "mm_pv_left(acc, p0, vo);", "mm_pv_left(acc, p0, vo, vp);"),
    (PF, "vo + 16u * V_STRIDE);", "vo + 16u * vp, vp);"),
    (PF, "vo + 32u * V_STRIDE);", "vo + 32u * vp, vp);"),
    (PF, "vo + 48u * V_STRIDE);", "vo + 48u * vp, vp);"),
    (PF, "    let j0 = (u_first + it) * KV_TILE;\n",
     "    let j0 = (u_first + it) * KV_TILE;\n    let v_at = kv.vb + j0 * kv.vs;\n"),
    *[(PF, f"pv_col(o{c}, p0, p1, p2, p3, {16 * c}u)",
       f"pv_col(o{c}, p0, p1, p2, p3, v_at + {16 * c}u, kv.vs)") for c in range(8)],
    NO_V]
_TAKE = ("fn take_flags(lid: u32) -> u32 {\n  workgroupBarrier();\n  if (lid == 0u) {\n"
         "    flag_u = atomicExchange(&flag_a, 0u);\n  }\n"
         "  return workgroupUniformLoad(&flag_u);\n}")
_PAR: Edit = (PF, "    stage_k_units(kr, lid);\n", "    fpar = it % 2u;\n    stage_k_units(kr, lid);\n")
_TAKE2: Edit = (PF, "    let flags = take_flags(lid);", "    let flags = take_flags2(lid, it % 2u);")


def _parity_flags(decl: str, raise1: str, raise2: str, take: str) -> list[Edit]:
    """The flags in words by tile parity (``decl``, raised by ``raise1`` / ``raise2``),
    read by ``take`` (take_flags2): one workgroupUniformLoad, its own two barriers (the
    explicit one and the exchange go); lid 0 resets the next tile's words before it (their
    readers passed the last uniform load's barriers)."""
    return [("mma_common", "var<workgroup> flag_a: atomic<u32>;",
             decl + "\nvar<private> fpar: u32;"),
            ("mma_common", "atomicOr(&flag_a, 1u);", raise1),
            (PF, "atomicOr(&flag_a, 2u);", raise2),
            ("mma_common", _TAKE, "fn take_flags2(lid: u32, par: u32) -> u32 {\n" + take + "}"),
            _PAR, _TAKE2]


# one atomic word a parity
FLAGS_ATOMIC = _parity_flags(
    "var<workgroup> flag_a: array<atomic<u32>, 2>;", "atomicOr(&flag_a[fpar], 1u);",
    "atomicOr(&flag_a[fpar], 2u);",
    "  if (lid == 0u) {\n    atomicStore(&flag_a[1u - par], 0u);\n  }\n"
    "  return workgroupUniformLoad(&flag_a[par]);\n")
# plain words (flag 1 and flag 2 each a word a parity, set to 1 by any lane), the four read
# by one workgroupUniformLoad of the array
FLAGS_WORDS = _parity_flags(
    "var<workgroup> flag_w: array<u32, 4>;", "flag_w[fpar * 2u] = 1u;",
    "flag_w[fpar * 2u + 1u] = 1u;",
    "  if (lid == 0u) {\n    flag_w[2u - par * 2u] = 0u;\n    flag_w[3u - par * 2u] = 0u;\n  }\n"
    "  let f = workgroupUniformLoad(&flag_w);\n"
    "  return f[par * 2u] | (f[par * 2u + 1u] << 1u);\n")
# take_flags as one plain barrier (no atomic, no uniform load): what the flags cost (wrong
# where a rescale was due)
NO_FLAGS: Edit = ("mma_common", _TAKE,
                  "fn take_flags(lid: u32) -> u32 {\n  workgroupBarrier();\n  return 0u;\n}")
# The key loop split in two: an inner loop of tiles that raise no flag (its body free of the
# rare paths), left at the first tile that raises one; that tile's rescale / non-finite v
# path and its PV products in the outer loop, which then resumes the inner one.
def _split_loop() -> Edit:
    text = program.load(PF)
    old = text[text.index("  for (var it = 0u; it < n_units; it++) {"):
               text.index("  write_out(o0")]
    body = old[old.index("    let j0 = "):old.index("    // some row's reference max moved")]
    rare = old[old.index("    // some row's reference max moved"):old.index("    let p0 = p_tile")]
    pv = old[old.index("    let p0 = p_tile"):old.rindex("  }")]
    new = ("  var it = 0u;\n  loop {\n    if (it >= n_units) {\n      break;\n    }\n"
           "    var flags = 0u;\n    loop {\n      if (it >= n_units) {\n        break;\n      }\n"
           + body.replace("    let flags = take_flags(lid);", "    flags = take_flags(lid);")
           + "    if (flags != 0u) {\n      break;\n    }\n" + pv + "    it++;\n    }\n"
           "    if (it >= n_units) {\n      break;\n    }\n"
           "    let j0 = (u_first + it) * KV_TILE;\n" + rare + pv + "    it++;\n  }\n")
    return (PF, old, new)


# V loaded at the start of its own tile (not a tile ahead): 16 fewer registers held across
# the tile (a lane's V units of the next tile).
V_OWN_TILE: list[Edit] = [
    (PF, "  var vr = load_units(kv.vb, kv.vs, u_first * KV_TILE, lo, hi, lid, true);\n", ""),
    (PF, "    let vn = load_units(kv.vb, kv.vs, j0 + KV_TILE, lo, hi, lid, true);",
     "    let vr = load_units(kv.vb, kv.vs, j0, lo, hi, lid, true);"),
    (PF, "    vr = vn;\n", "")]
PATHS_OFF: list[Edit] = [(PF, "if ((flags & 1u) != 0u) {", "if (false) {"),
                         (PF, "if ((flags & 2u) != 0u) {", "if (false) {")]


# mark_bad_v's loops with trip counts the compiler cannot see (no unrolling: small code)
COMPACT_BAD_V: list[Edit] = [
    ("mma_prefill_common", "for (var jl = 0u; jl < KV_TILE; jl++) {",
     "for (var jl = 0u; jl < min(KV_TILE, P.seq_len + KV_TILE); jl++) {"),
    ("mma_prefill_common", "for (var d = 0u; d < 16u; d++) {",
     "for (var d = 0u; d < min(16u, P.seq_len + 16u); d++) {")]


# the direct form's tiles most variants are built with
Q64: dict[str, Any] = {"mma": "hardware", "q_tile": 64, "kv_tile": 32}
# the non-finite v path's branch on the flag and the lane's row (before 2026-11-28: a branch
# per lane; the build's is on the flag alone)
BAD_V_PER_ROW: Edit = (PF, "if ((flags & 2u) != 0u) {",
                       "if ((flags & 2u) != 0u && at.i < P.seq_len) {")


VARIANTS.update({
    "direct-q128-kv32": (DIRECT, {"mma": "hardware", "q_tile": 128, "kv_tile": 32}, []),
    "bad-v-per-row": (DIRECT, Q64, [BAD_V_PER_ROW]),
    "bad-v-per-row-no-rescale": (DIRECT, Q64,
                                 [BAD_V_PER_ROW, PATHS_OFF[0]]),
    "rescale-always": (DIRECT, Q64,
                       [(PF, "if ((flags & 1u) != 0u) {", "if (true) {")]),
    "compact-bad-v": (DIRECT, Q64, COMPACT_BAD_V),
    "compact-bad-v-per-row-no-rescale": (DIRECT, {"mma": "hardware", "q_tile": 64,
                                                  "kv_tile": 32},
                                         [*COMPACT_BAD_V, BAD_V_PER_ROW, PATHS_OFF[0]]),
    "v-own-tile": (DIRECT, Q64, V_OWN_TILE),
    "v-own-tile-paths-off": (DIRECT, Q64,
                             V_OWN_TILE + PATHS_OFF),
    "split-loop": (DIRECT, Q64, [_split_loop()]),
    "direct-q64-kv32-noflags": (DIRECT, Q64,
                                [NO_FLAGS]),
    "no-rescale-path": (DIRECT, Q64, PATHS_OFF[:1]),
    "no-bad-v-path": (DIRECT, Q64, PATHS_OFF[1:]),
    "both-paths-off": (DIRECT, Q64, PATHS_OFF),
    "atomic-paths-off": (DIRECT, Q64,
                         FLAGS_ATOMIC + PATHS_OFF),
    "rescale-no-barriers": (DIRECT, Q64,
                            [("mma_common", "  mm_store_x(acc, xo);\n  workgroupBarrier();\n"
                              "  for (var e = lane; e < 256u; e += 32u) {\n"
                              "    s_s[xo + e] *= alpha_s[a0 + e / 16u];\n  }\n"
                              "  workgroupBarrier();\n  let got = mm_load_x(xo);\n"
                              "  workgroupBarrier();",
                              "  mm_store_x(acc, xo);\n"
                              "  for (var e = lane; e < 256u; e += 32u) {\n"
                              "    s_s[xo + e] *= alpha_s[a0 + e / 16u];\n  }\n"
                              "  let got = mm_load_x(xo);")]),
    "flags-atomic": (DIRECT, Q64, FLAGS_ATOMIC),
    "flags-words": (DIRECT, Q64, FLAGS_WORDS),
    "vstore-q64-kv32": (DIRECT, Q64, V_STORAGE),
})
PHASES: dict[str, list[Edit]] = {
    "full kernel": [], "no QK product (K from k_s)": [NO_QK],
    "no PV product (nor P loads)": [NO_PV], "no matrix product at all": [NO_QK, NO_PV],
    "no K staging (stores; loads dead)": [NO_K], "no V staging": [NO_V],
    "no K/V staging": [NO_K, NO_V], "no logits (scores used raw)": [LOGITS],
    "products and staging out": [NO_QK, NO_PV, NO_K, NO_V],
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


def _run_edited(dev: str, spec: attnreg.AttentionSpec, t: Mapping[str, Any], want: Any,
                label: str, edits: list[Edit], iters: int) -> tuple[float, float, str]:
    """_run of variant ``label`` built from its sources with ``edits`` (and its own)."""
    kernel, params, own = VARIANTS[label]
    original = program.load, program.declarations, wgsl_io.helpers
    program.load = source_with(own + edits)     # program.build caches by ``load``
    if label.startswith("vstore"):
        _v_as_halves()
    try:
        return _run(dev, spec, t, want, kernel, params, iters)
    finally:
        program.load, program.declarations, wgsl_io.helpers = original


def _v_as_halves() -> None:
    """The vstore variants' build: v bound as an array of halves beside q."""
    decl, helpers = program.declarations, wgsl_io.helpers

    def declarations(family: str, aux: frozenset[str], spec: attnreg.AttentionSpec,
                     wide: bool = False, halves: frozenset[str] = frozenset()) -> str:
        return decl(family, aux, spec, wide, halves | {"v"} if "q" in halves else halves)

    def with_v(spec: attnreg.AttentionSpec, bound: frozenset[str], wide: bool = False,
               halves: frozenset[str] = frozenset()) -> str:
        return helpers(spec, bound, wide, halves | {"v"} if "q" in halves else halves)

    program.declarations, wgsl_io.helpers = declarations, with_v


def _tflops(spec: attnreg.AttentionSpec, us: float) -> float:
    s, h = spec.seq_len, spec.head_size
    return 4 * spec.num_heads * h * s * (s + 1) / 2 / (us * 1e-6) / 1e12


def _side_by_side(dev: str, seqs: list[int], labels: list[str], iters: int, rounds: int,
                  tag: str) -> dict[int, str]:
    """Every variant at every length, alternating; the fastest direct label per length."""
    best: dict[int, str] = {}
    for n in seqs:
        spec = attnreg.AttentionSpec(batch=1, seq_len=n, **GQA)
        t = testing.make_tensors(spec, 0)
        want = testing.expected(spec, t)
        print(f"\nS={n} ({_tflops(spec, 1e6) * 1e3:.2f} GFLOP causal)", flush=True)
        got: dict[str, list[float]] = {}
        for r in range(rounds):
            for label in labels:
                try:
                    us, err, what = _run_edited(dev, spec, t, want, label, [], iters)
                except Exception as exc:  # a failing variant is reported
                    print(f"  {tag}round {r}  {label:28s} FAILED: {str(exc)[:300]}", flush=True)
                    continue
                got.setdefault(label, []).append(us)
                print(f"  {tag}round {r}  {label:28s} {us:9.1f} us  {_tflops(spec, us):5.1f} "
                      f"TFLOP/s  max err {err:.2g}  {what}", flush=True)
        direct = {k: statistics.median(v) for k, v in got.items() if k.startswith("direct")}
        if direct:
            best[n] = min(direct, key=lambda k: direct[k])
    return best


def _phases(dev: str, n: int, label: str, iters: int) -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=n, **GQA)
    t = testing.make_tensors(spec, 0)
    want = testing.expected(spec, t)
    print(f"\nphases of {label}, S={n}:", flush=True)
    for phase, edits in PHASES.items():
        try:
            us, err, _ = _run_edited(dev, spec, t, want, label, edits, iters)
            print(f"  {phase:34s} {us:9.1f} us  max err {err:.2g}", flush=True)
        except Exception as exc:  # reported, as above
            print(f"  {phase:34s} FAILED: {str(exc)[:300]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", default="512,2048")
    ap.add_argument("--only", default="scalar,staged-q32-kv32,direct-q64-kv32,direct-q32-kv32",
                    help=f"comma-separated variants, of {list(VARIANTS)}")
    ap.add_argument("--tag", default="", help="printed before each line (which tree)")
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
    labels = [x for x in args.only.split(",") if x]
    unknown = [x for x in labels if x not in VARIANTS]
    if unknown:
        ap.error(f"--only: unknown variants {unknown}; known: {list(VARIANTS)}")
    best = _side_by_side(devs[0].id, [int(x) for x in args.seq.split(",")], labels,
                         args.iters, args.rounds, args.tag + " " if args.tag else "")
    if args.phases and args.phases in best:
        _phases(devs[0].id, args.phases, best[args.phases], args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
