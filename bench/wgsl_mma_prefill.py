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
GQA 32/8 H=128. Variants with source edits undo, one at a time, what a stop kept (the grid's
heavy-first order, the softmax lanes' rotation, the logits' fast path, the non-finite v path
after the loop: ci/results/h200_wgsl_prefill_order.txt) or try what it did not (the rescale
two tiles a round trip, Q reloaded every tile), or cut the scalar prefill's NaN-safe logits
and weights or its edge steps (scalar-unguarded*, scalar-no-edge-steps); earlier stops'
variants are in the results files they wrote. ``--tag`` labels the lines, so that runs of two
trees (this script copied into each) can be told apart and alternated.

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
from attnreg.backends.webgpu import program
from bench.wgsl_mma_phases import LOGITS, LOGITS_FAST, Edit, _median_us, source_with

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
# The grid's order before 2026-11-28: row tiles last-first within each head, head after head
# (attn_common.wgsl's prefill_wg), so the last heads' heaviest causal tiles start late.
HEAD_ORDER: Edit = ("attn_common",
                    "  w.h = lin % P.num_heads;\n  w.b = (lin / P.num_heads) % P.batch;\n"
                    "  w.rt = w.n_rt - 1u - lin / (P.num_heads * P.batch);\n",
                    "  w.rt = w.n_rt - 1u - lin % w.n_rt;\n  w.h = (lin / w.n_rt) % P.num_heads;\n"
                    "  w.b = lin / (w.n_rt * P.num_heads);\n")
# The softmax lanes' walk over their scores unrotated (before 2026-11-28): rows r and r + 8
# and the row's other half in the same banks (mma_prefill_common.wgsl's lane_place).
NO_ROTATION: Edit = ("mma_prefill_common",
                     "let rot = ((lane % 16u) / ROT_DIV + (lane / 16u) * ROT_HF) % LANE_KEYS;",
                     "let rot = 0u;")
# lane_logits without its fast path for parts whose keys the row all sees (every key tested)
NO_FAST_LOGITS: Edit = ("mma_common", "if (PLAIN_LOGITS == 1u && live && all_seen) {",
                        "if (false) {")
# The scalar prefill's full steps through logit_b's feature tests (no plain_logit path)
SCALAR_NO_PLAIN: Edit = ("flash_prefill", "if (PLAIN_LOGITS == 1u && full) {", "if (false) {")
# The scalar prefill's logits with every key tested (its `full` steps too)
SCALAR_NO_FAST_LOGITS: list[Edit] = [
    SCALAR_NO_PLAIN, ("flash_prefill", "if (full || (i < P.seq_len", "if ((i < P.seq_len")]
# The scalar prefill's changes of 2026-11-28 (ninth session, h200_wgsl_scalar_prefill.txt),
# each undone: the p_s barrier on a staged tile's first step too; the full
# steps' V values through step_values' per-unit tests; the row reductions' shuffles held to
# SHUFFLE_LANES (workgroup memory for the rest) whatever the dispatch's subgroup size.
SCALAR_P_BARRIER: Edit = ("flash_prefill", "if ((STAGED == 0u || st > 0u) && !p_shuffled) {",
                          "if (!p_shuffled) {")
SCALAR_STEP_VALUES: Edit = ("flash_prefill_steps",
                            "if (STAGED == 0u || OUT_UNITS % ROW_LANES != 0u) {", "if (true) {")
SCALAR_NARROW: Edit = ("flash_prefill", "let wide = sg >= ROW_LANES;", "let wide = false;")
# the logits of attn_common.wgsl's logit (its per-score feature tests) instead of plain_logit
FULL_LOGITS: list[Edit] = [NO_FAST_LOGITS,
                           ("mma_common", "if (PLAIN_LOGITS == 1u) {", "if (false) {")]
# The rare rescale's branch taken out (wrong where a row's max moves after its first tile)
NO_RESCALE: Edit = (PF, "if ((flags & 1u) != 0u) {", "if (false) {")
# The non-finite v path as it was before 2026-11-28: flag 2 taken every tile, a lane's vbad
# bits marked in the key loop (the build marks them after the loop, if a tile raised it).
BAD_V_IN_LOOP: list[Edit] = [
    (PF, "    let flags = take_flags(lid, 2u);", "    let flags = take_flags(lid, 0u);"),
    (PF, "    let p0 = p_tile(pa, 0u);",
     "    if ((flags & 2u) != 0u) {\n      vbad = mark_bad_v(vbad, w, j0, lo, hi, at.pos, at.hf);\n"
     "    }\n    let p0 = p_tile(pa, 0u);"),
    (PF, "  let sa = sg * 16u * S_STRIDE;",
     "  var vbad: array<u32, MASK_WORDS>;\n  let sa = sg * 16u * S_STRIDE;"),
    (PF, "  var vbad: array<u32, MASK_WORDS>;    // output columns of this lane poisoned by a v "
     "(zeros)\n  if (seen_bad_v(lid)) {\n"
     "    vbad = mark_all_bad_v(w, u_first, n_units, lo, hi, at.pos, at.hf);\n  }\n", "")]
# Q's operands loaded from storage for every tile's products instead of held in 32
# registers across the key loop (right where no workgroup reaches past q's end: q_edge).
Q_EACH_TILE: list[Edit] = [
    (PF, "mm_store_s(s_tile(q0, q1, q2, q3, q4, q5, q6, q7, kc * 16u * K_STRIDE), sa + kc * 16u);",
     "mm_store_s(s_tile_q(qr, kc * 16u * K_STRIDE), sa + kc * 16u);"),
    (PF, "// acc + P V for the output column tile",
     "fn s_tile_q(qr: QRows, ko: u32) -> MAcc {\n  var a = mm_zero();\n"
     + "".join(f"  if (DEPTH_TILES > {t}u) {{ a = mm_qk_direct(a, mm_load_q(qr.at + {16 * t}u, "
               f"qr.st), ko + {16 * t}u); }}\n" for t in range(8))
     + "  return a;\n}\n\n// acc + P V for the output column tile")]
# The rescale's round trips two output tiles at a time (the subgroup's 16 score rows hold
# 2 x 256 floats where S_STRIDE >= 32): 4 rounds of 3 barriers instead of 8.
RESCALE_PAIRS: list[Edit] = [
    ("mma_common", "// Tile acc with its 16 rows times alpha_s",
     "fn rescale_pair(a: ptr<function, MAcc>, b: ptr<function, MAcc>, sg: u32, lane: u32,\n"
     "                a0: u32) {\n  let xo = x_at(sg);\n  mm_store_x(*a, xo);\n"
     "  mm_store_x(*b, xo + 256u);\n  workgroupBarrier();\n"
     "  for (var e = lane; e < 512u; e += 32u) {\n"
     "    s_s[xo + e] *= alpha_s[a0 + (e % 256u) / 16u];\n"
     "  }\n  workgroupBarrier();\n  *a = mm_load_x(xo);\n  *b = mm_load_x(xo + 256u);\n"
     "  workgroupBarrier();\n}\n\n// Tile acc with its 16 rows times alpha_s"),
    (PF, "      o0 = rescaled(o0, sg, lane, sg * 16u);\n"
         + "".join(f"      if (OUT_TILES > {c}u) {{ o{c} = rescaled(o{c}, sg, lane, sg * 16u); }}\n"
                   for c in range(1, 8)),
     "".join(f"      rescale_pair(&o{c}, &o{c + 1}, sg, lane, sg * 16u);\n" for c in (0, 2, 4, 6)))]
# The QK products of the tile's key tiles interleaved depth step by depth step (KEY_TILES
# independent chains of products in flight instead of one chain of DEPTH_TILES at a time).
QK_STEP = ("fn qk_step(s0: ptr<function, MAcc>, s1: ptr<function, MAcc>, s2: ptr<function, MAcc>,\n"
           "           s3: ptr<function, MAcc>, q: MLeft, t: u32) {\n"
           "  *s0 = mm_qk_direct(*s0, q, t * 16u);\n"
           + "".join(f"  if (KEY_TILES > {c}u) {{ *s{c} = mm_qk_direct(*s{c}, q, {16 * c}u * K_STRIDE"
                     f" + t * 16u); }}\n" for c in (1, 2, 3))
           + "}\n\n")
QK_INTERLEAVED: list[Edit] = [
    (PF, "// Scores of the subgroup's 16 rows against",
     QK_STEP + "// Scores of the subgroup's 16 rows against"),
    (PF, "    for (var kc = 0u; kc < KEY_TILES; kc++) {\n"
         "      mm_store_s(s_tile(q0, q1, q2, q3, q4, q5, q6, q7, kc * 16u * K_STRIDE), sa + kc * 16u);\n"
         "    }\n",
     "    var s0 = mm_zero(); var s1 = mm_zero(); var s2 = mm_zero(); var s3 = mm_zero();\n"
     "    qk_step(&s0, &s1, &s2, &s3, q0, 0u);\n    qk_step(&s0, &s1, &s2, &s3, q1, 1u);\n"
     + "".join(f"    if (DEPTH_TILES > {t}u) {{ qk_step(&s0, &s1, &s2, &s3, q{t}, {t}u); }}\n"
               for t in range(2, 8))
     + "    mm_store_s(s0, sa);\n"
     + "".join(f"    if (KEY_TILES > {c}u) {{ mm_store_s(s{c}, sa + {16 * c}u); }}\n"
               for c in (1, 2, 3)))]
# the direct form's tiles most variants are built with: NVIDIA's (rule
# dawn_matrix_prefill_rows_nvidia)
Q128: dict[str, Any] = {"mma": "hardware", "q_tile": 128, "kv_tile": 32}
# The sliced prefill's weights through p_s and its barriers, as the keys layout takes them,
# instead of shuffled from the lanes that own their keys
P_MEMORY: Edit = ("flash_prefill", "let p_shuffled = sliced && LANE_KEYS <= 2u;",
                  "let p_shuffled = false;")
# The scalar prefill's two PV loops over a step's keys (full steps, edge steps), by the line
# that opens them and the line after it
PV_LOOP = "for (var jj = 0u; jj < K_STEP; jj++) {"
PV_LOOP_NEXT = ("\n          let vv = full_values", "\n          let j = js + jj;")


def pv_loops(opening: str) -> list[Edit]:
    """Both PV loops opened by ``opening`` instead."""
    return [("flash_prefill", PV_LOOP + nxt, opening + nxt) for nxt in PV_LOOP_NEXT]


# The PV loops written out by the program builder
PV_UNROLLED = pv_loops(PV_LOOP + "  // @unroll")
SHOWN = ("q_tile", "kv_tile", "form", "qk_layout", "kv_stage", "row_lanes")
SCALAR = "dawn.prefill.f16.sg"
KEYS: dict[str, Any] = {"kv_staging": "workgroup", "qk_layout": "keys", "kv_stage": "native",
                        "row_lanes": 16, "q_tile": 32, "rows_per_thread": 2}
SLICED: dict[str, Any] = {"kv_staging": "workgroup", "qk_layout": "sliced", "kv_stage": "f32",
                          "row_lanes": 8, "q_tile": 64, "rows_per_thread": 2}
# The scalar prefill's NaN-safe logit and weight (attn_keys' plain_logit: inf / NaN dots
# made NaN, -inf made MASKED; attn_common's weight_of: NaN kept through exp) cut to the bare
# value and exp: what the poison tests cost a logit (wrong only on non-finite inputs)
UNGUARDED_WEIGHTS: Edit = ("attn_common", "return select(exp(x - m), x, is_nan(x));",
                           "return exp(x - m);")
UNGUARDED_LOGITS: Edit = ("attn_keys", "return select(max(d, MASKED), nan_f32(), "
                          "(bitcast<u32>(d) & 0x7f800000u) == 0x7f800000u);", "return d;")
# Every step through the full steps' PV loop, the causal diagonal's too: what the edge steps'
# per-(key, row) branches cost (right for finite inputs: an invisible key's weight is 0, and
# the branches are what keep a non-finite value of such a key out of the row)
NO_EDGE_STEPS: Edit = ("flash_prefill", "if (all_see(js, js + K_STEP, span, seen_all)) {",
                       "if (true) {")
# label -> (kernel or None for the scalar plan, params, source edits)
VARIANTS: dict[str, tuple[str | None, dict[str, Any], list[Edit]]] = {
    "scalar": (None, {}, []),
    "scalar-head-order": (None, {}, [HEAD_ORDER]),
    "scalar-no-fast-logits": (None, {}, SCALAR_NO_FAST_LOGITS),
    "scalar-no-plain-logits": (None, {}, [SCALAR_NO_PLAIN]),
    "scalar-p-barrier": (None, {}, [SCALAR_P_BARRIER]),
    "scalar-step-values": (None, {}, [SCALAR_STEP_VALUES]),
    "scalar-narrow-shuffles": (None, {}, [SCALAR_NARROW]),
    "scalar-before-ninth": (None, {}, [SCALAR_NO_PLAIN, SCALAR_P_BARRIER, SCALAR_STEP_VALUES,
                                       SCALAR_NARROW]),
    # the scalar prefill's layouts (rule dawn_sliced_prefill_nvidia picks "sliced" params)
    "scalar-keys": (SCALAR, KEYS, []),
    "scalar-keys-f32": (SCALAR, {**KEYS, "kv_stage": "f32"}, []),
    "scalar-sliced": (SCALAR, SLICED, []),
    "scalar-sliced-native": (SCALAR, {**SLICED, "kv_stage": "native"}, []),
    "scalar-sliced-q32": (SCALAR, {**SLICED, "q_tile": 32}, []),
    "scalar-sliced-q128": (SCALAR, {**SLICED, "q_tile": 128}, []),
    "scalar-sliced-kv16": (SCALAR, {**SLICED, "kv_tile": 16}, []),
    "scalar-sliced-step16": (SCALAR, {**SLICED, "max_k_step": 16}, []),
    "scalar-sliced-q128-kv32-step16": (SCALAR, {**SLICED, "q_tile": 128, "kv_tile": 32,
                                                "max_k_step": 16}, []),
    "scalar-sliced-q128-r4": (SCALAR, {**SLICED, "q_tile": 128, "rows_per_thread": 4,
                                       "kv_tile": 32, "max_k_step": 16}, []),
    "scalar-sliced-q128-r4-kv16": (SCALAR, {**SLICED, "q_tile": 128, "rows_per_thread": 4,
                                            "kv_tile": 16, "max_k_step": 16}, []),
    "scalar-sliced-q64-r4": (SCALAR, {**SLICED, "rows_per_thread": 4, "kv_tile": 32,
                                      "max_k_step": 16}, []),
    "scalar-pv-unrolled": (None, {}, PV_UNROLLED),
    "scalar-unguarded-weights": (None, {}, [UNGUARDED_WEIGHTS]),
    "scalar-unguarded-logits": (None, {}, [UNGUARDED_LOGITS]),
    "scalar-unguarded": (None, {}, [UNGUARDED_WEIGHTS, UNGUARDED_LOGITS]),
    "scalar-no-edge-steps": (None, {}, [NO_EDGE_STEPS]),
    "scalar-sliced-p-memory": (SCALAR, SLICED, [P_MEMORY]),
    "scalar-sliced-q128-p-memory": (SCALAR, {**SLICED, "q_tile": 128}, [P_MEMORY]),
    "staged-q32-kv32": (STAGED, {"mma": "hardware"}, []),
    "staged-no-rotation": (STAGED, {"mma": "hardware"}, [NO_ROTATION]),
    "direct-q128-kv32": (DIRECT, Q128, []),
    "direct-q64-kv32": (DIRECT, {"mma": "hardware", "q_tile": 64, "kv_tile": 32}, []),
    "direct-q32-kv32": (DIRECT, {"mma": "hardware", "q_tile": 32, "kv_tile": 32}, []),
    "direct-q16-kv64": (DIRECT, {"mma": "hardware", "q_tile": 16, "kv_tile": 64}, []),
    "direct-q128-head-order": (DIRECT, Q128, [HEAD_ORDER]),
    "q128-no-rotation": (DIRECT, Q128, [NO_ROTATION]),
    "q128-no-fast-logits": (DIRECT, Q128, [NO_FAST_LOGITS]),
    "q128-full-logits": (DIRECT, Q128, FULL_LOGITS),
    "q128-bad-v-in-loop": (DIRECT, Q128, BAD_V_IN_LOOP),
    "q128-no-rescale-path": (DIRECT, Q128, [NO_RESCALE]),
    "q128-rescale-pairs": (DIRECT, Q128, RESCALE_PAIRS),
    "q128-q-each-tile": (DIRECT, Q128, Q_EACH_TILE),
    "q128-qk-interleaved": (DIRECT, Q128, QK_INTERLEAVED),
}
PHASES: dict[str, list[Edit]] = {
    "full kernel": [], "no QK product (K from k_s)": [NO_QK],
    "no PV product (nor P loads)": [NO_PV], "no matrix product at all": [NO_QK, NO_PV],
    "no K staging (stores; loads dead)": [NO_K], "no V staging": [NO_V],
    "no K/V staging": [NO_K, NO_V], "no logits (scores used raw)": [LOGITS, LOGITS_FAST],
    "products and staging out": [NO_QK, NO_PV, NO_K, NO_V],
}


# The scalar prefill's phases (the sliced plan: rule dawn_sliced_prefill_nvidia), each edit
# wrong values: the sliced QK's dots and their K loads out (the reduce-scatter kept); the PV
# loops run no key; the K/V tiles never stored (their loads dead).
SCALAR_NO_QK: Edit = ("flash_prefill", "if (SLICE_VEC4S * ROW_LANES == QK_VEC4S || c < QK_VEC4S) {",
                      "if (false) {")
SCALAR_NO_PV = pv_loops("for (var jj = 0u; jj < 0u; jj++) {")
SCALAR_NO_STAGING: list[Edit] = [
    ("flash_prefill", "stage_k(lid + u * THREADS, kr[u]);", ""),
    ("flash_prefill", "stage_v(lid + u * THREADS, vr[u]);", "")]
SCALAR_PHASES: dict[str, list[Edit]] = {
    "full kernel": [], "no QK dots (K loads out)": [SCALAR_NO_QK], "no PV": SCALAR_NO_PV,
    "neither": [SCALAR_NO_QK, *SCALAR_NO_PV],
    "neither, no K/V staging": [SCALAR_NO_QK, *SCALAR_NO_PV, *SCALAR_NO_STAGING]}


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
        shown = {k: v for k, v in st.params.items() if k in SHOWN}
        return _median_us(s, plan, t, iters), err, f"{' -> '.join(plan.kernels)} {shown}"


def _run_edited(dev: str, spec: attnreg.AttentionSpec, t: Mapping[str, Any], want: Any,
                label: str, edits: list[Edit], iters: int) -> tuple[float, float, str]:
    """_run of variant ``label`` built from its sources with ``edits`` (and its own)."""
    kernel, params, own = VARIANTS[label]
    original = program.load
    program.load = source_with(own + edits)     # program.build caches by ``load``
    try:
        return _run(dev, spec, t, want, kernel, params, iters)
    finally:
        program.load = original


def _tflops(spec: attnreg.AttentionSpec, us: float) -> float:
    s, h = spec.seq_len, spec.head_size
    return 4 * spec.batch * spec.num_heads * h * s * (s + 1) / 2 / (us * 1e-6) / 1e12


def _side_by_side(dev: str, seqs: list[int], labels: list[str], iters: int, rounds: int,
                  tag: str, batch: int = 1) -> dict[int, str]:
    """Every variant at every length, alternating; the fastest direct label per length."""
    best: dict[int, str] = {}
    for n in seqs:
        spec = attnreg.AttentionSpec(batch=batch, seq_len=n, **GQA)
        t = testing.make_tensors(spec, 0)
        want = testing.expected(spec, t)
        print(f"\nB={batch} S={n} ({_tflops(spec, 1e6) * 1e3:.2f} GFLOP causal)", flush=True)
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


def _phases(dev: str, n: int, label: str, iters: int,
            table: Mapping[str, list[Edit]] = PHASES) -> None:
    spec = attnreg.AttentionSpec(batch=1, seq_len=n, **GQA)
    t = testing.make_tensors(spec, 0)
    want = testing.expected(spec, t)
    print(f"\nphases of {label}, S={n}:", flush=True)
    for phase, edits in table.items():
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
    ap.add_argument("--only", default="scalar,direct-q128-kv32,direct-q64-kv32",
                    help=f"comma-separated variants, of {list(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=1, help="sequences a launch (B): B=2 at "
                    "S=512 shows whether one wave of 128 workgroups left the SMs idle")
    ap.add_argument("--tag", default="", help="printed before each line (which tree)")
    ap.add_argument("--phases", type=int, default=2048, help="length of the phase account "
                    "(0: none)")
    ap.add_argument("--scalar-phases", type=int, default=0, help="length of the scalar "
                    "prefill's phase account (the plan of matrix_units=off; 0: none)")
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
                         args.iters, args.rounds, args.tag + " " if args.tag else "", args.batch)
    if args.phases and args.phases in best:
        _phases(devs[0].id, args.phases, best[args.phases], args.iters)
    if args.scalar_phases:
        _phases(devs[0].id, args.scalar_phases, "scalar", args.iters, SCALAR_PHASES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
