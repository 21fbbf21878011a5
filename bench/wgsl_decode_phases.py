"""Where the WGSL split-KV decode's time goes (decode_partial, kv_staging "direct", the plan
`auto` makes): the bench's decode cases timed as planned, then with one part of the kernel
changed by editing its WGSL source:

  q from workgroup    every tile's q read from workgroup memory (decode_qk_common's q_s), as
  memory              before Q_IN_REGS held a lane's q in registers (also with K/V from L1)
  K/V from L1         every K/V load reads the first 1024 elements of its buffer (the same
                      instructions, cache-resident data): the compute and the load latency
                      the cache leaves, without DRAM traffic
  loads only          the tile's QK, softmax and PV replaced by a sum of the loaded units (no
                      barrier in the tile loop): the K/V streaming alone
  loads only K / V    loads only, of K or of V alone; "no scales": the units without their
                      quantized scales' loads
  loop skeleton       no K/V loads and no tile compute: queries staged, the empty tile loop,
                      the streams merged and the partials written, plus the reduce
  launches only       decode_partial returns at once: the pass's two launches and the reduce
  max one load        tile_weights' walk over the tile's logits for each vector's max cut to
                      one load (+ no exp barrier: its second barrier dropped too): what a lazy
                      reference max could save (ci/results/h200_wgsl_decode.txt)
  prefill empty       the prefill route's kernel returns at once (with --flag route=prefill):
                      the pass of one dispatch, the floor of any one-launch plan
  reduce max by       the reduce's max over its lanes by subgroupMax and one barrier instead
  subgroups           of a chain of eight (32-lane subgroups assumed: NVIDIA's)
  logits tested a     every logit through vec_logit's per-key tests, the plain tiles too
  key                 (decode_qk_common.wgsl's tile_plain off; computes right values)
  unrolled            every loop of decode_partial / decode_qk_common / decode_pv_common
                      marked // @unroll, so the program builder writes out those with a
                      constant bound (as the prefill's are); "unrolled QK" / "PV": one file
  QK / PV one vector  only query vector 0's FMAs of QK (or of PV) kept, every load and the
                      softmax as planned: what the per-vector FMAs cost
                      (ci/results/h200_wgsl_decode_bounds.txt)
  K / V unconverted   K's (V's) units used as their bits, unconverted (f16 and bf16 cases
                      only: their units are vec4<u32>): what the conversions to f32 cost
  no max/exp passes   tile_weights dropped (its two barriers too): PV weighs by the logits

Edited builds compute wrong values (their error is printed: the part really went), but for
the "unrolled" ones and "logits tested a key", which compute the plan's. GPU time per launch
and back to back ("one pass": the runtime's b2b, N launches recorded into one compute pass),
medians, one process; run it once more with ATTNREG_WGSL_CHECKS=none to see what
the bounds checks (Tint's robustness, naga's checks) cost.

--flag NAME=VALUE sets a session flag, --param NAME=INT a kernel parameter (split_size=47):
ci/results/h200_wgsl_decode_fixed_costs.txt used them.

  python3 -m bench.wgsl_decode_phases [--iters 40] [--backends dawn,webgpu]   (device tool)
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Mapping
from typing import Any

import attnreg
from attnreg import testing
from attnreg.backends.webgpu import program, unroll
from attnreg.tools.bench import _inputs
from attnreg.tools.bench_suites import SUITES
from bench.wgsl_mma_phases import Edit, source_with

DP, QK, PV = "decode_partial", "decode_qk_common", "decode_pv_common"
COMPUTE = """    tile_logits(w, j0, cur.y == 1u, tile_plain(d, j0, tiles.x, tiles.y), lid, kc);
    tile_weights(lid);
    if (st < STREAMS) {
      acc = pv_tile(acc, st, cl, j0, tile_full(d, j0, tiles.x, tiles.y), d, vc);
    }"""
FOLD = """    for (var u = 0u; u < K_REGS; u++) {
      for (var s = 0u; s < UNIT_VEC4S; s++) {
        acc.l[0] += dot(ku_part(kc[u].x, s), vec4<f32>(1.0)) * scale_of_k(kc[u].s);
      }
    }
    for (var u = 0u; u < V_REGS; u++) {
      for (var s = 0u; s < PV_UNIT; s++) {
        acc.l[0] += dot(vu_part(vc[u].x, s), vec4<f32>(1.0)) * scale_of_v(vc[u].s);
      }
    }"""
K_LOAD = "g = KUnit(ku_k(e), ku_scale_k(e));"
V_LOAD = "g = VUnit(vu_v(e, gi), vu_scale_v(e, gi));"
L1 = [(QK, K_LOAD, "g = KUnit(ku_k(e % 1024u), ku_scale_k(e % 1024u));"),
      (PV, V_LOAD, "g = VUnit(vu_v(e % 1024u, gi), vu_scale_v(e % 1024u, gi));")]
NO_LOADS = [(QK, K_LOAD, "g = KUnit();"), (PV, V_LOAD, "g = VUnit();")]
ONE = "vec2<u32>(0x3f800000u, 0u)"      # a scale of 1.0 as loaded
NO_SCALES = [(QK, K_LOAD, f"g = KUnit(ku_k(e), {ONE});"),
             (PV, V_LOAD, f"g = VUnit(vu_v(e, gi), {ONE});")]
# Two tiles' loads in flight during a tile's compute (instead of one): three register tiles
# in rotation, the loop written out three times so no register tile is copied (a copy would
# wait for its loads).
RING = """fn ring_load_k(d: DecodeWg, tiles: vec4<u32>, lid: u32, t: u32) -> array<KUnit, K_REGS> {
  var k: array<KUnit, K_REGS>;
  let live = t < tiles.z;
  let jf = select(0u, tile_of(min(t, tiles.z - 1u), tiles.x, tiles.w).x, live);
  for (var u = 0u; u < K_REGS; u++) {
    k[u] = k_reg(u, lid, d.b, d.kvh, jf, tiles.x, tiles.y, live);
  }
  return k;
}

fn ring_load_v(d: DecodeWg, tiles: vec4<u32>, st: u32, cl: u32, t: u32) -> array<VUnit, V_REGS> {
  var v: array<VUnit, V_REGS>;
  let live = t < tiles.z;
  let jf = select(0u, tile_of(min(t, tiles.z - 1u), tiles.x, tiles.w).x, live);
  for (var u = 0u; u < V_REGS; u++) {
    v[u] = v_reg(u, st, cl, d.b, d.kvh, jf, tiles.x, tiles.y, live);
  }
  return v;
}

fn ring_tile(acc: Lanes, d: DecodeWg, w: Wg, tiles: vec4<u32>, lid: u32, st: u32, cl: u32,
             t: u32, kc: array<KUnit, K_REGS>, vc: array<VUnit, V_REGS>) -> Lanes {
  let cur = tile_of(t, tiles.x, tiles.w);
  tile_logits(w, cur.x, cur.y == 1u, tile_plain(d, cur.x, tiles.x, tiles.y), lid, kc);
  tile_weights(lid);
  if (st < STREAMS) {
    return pv_tile(acc, st, cl, cur.x, tile_full(d, cur.x, tiles.x, tiles.y), d, vc);
  }
  return acc;
}

fn direct_tiles(d: DecodeWg, w: Wg, tiles: vec4<u32>, lid: u32, st: u32, cl: u32) -> Lanes {
  var acc = Lanes();
  var ka = ring_load_k(d, tiles, lid, 0u);
  var va = ring_load_v(d, tiles, st, cl, 0u);
  var kb = ring_load_k(d, tiles, lid, 1u);
  var vb = ring_load_v(d, tiles, st, cl, 1u);
  var kd: array<KUnit, K_REGS>;
  var vd: array<VUnit, V_REGS>;
  for (var it = 0u; it < tiles.z; it += 3u) {
    kd = ring_load_k(d, tiles, lid, it + 2u);
    vd = ring_load_v(d, tiles, st, cl, it + 2u);
    acc = ring_tile(acc, d, w, tiles, lid, st, cl, it, ka, va);
    if (it + 1u < tiles.z) {
      ka = ring_load_k(d, tiles, lid, it + 3u);
      va = ring_load_v(d, tiles, st, cl, it + 3u);
      acc = ring_tile(acc, d, w, tiles, lid, st, cl, it + 1u, kb, vb);
    }
    if (it + 2u < tiles.z) {
      kb = ring_load_k(d, tiles, lid, it + 4u);
      vb = ring_load_v(d, tiles, st, cl, it + 4u);
      acc = ring_tile(acc, d, w, tiles, lid, st, cl, it + 2u, kd, vd);
    }
  }
  return acc;
}

"""


def _direct_fn() -> str:
    """decode_partial.wgsl's direct_tiles, as written (RING replaces it)."""
    text = program.load(DP)
    return text[text.index("fn direct_tiles("):text.index('// kv_staging "workgroup": K/V tiles')]


PARTIAL_EMPTY = (DP, "let tiles = tile_range(d);", "return;\n  let tiles = tile_range(d);")
PREFILL_EMPTY = ("flash_prefill", "  let w = prefill_wg(wid, nwg, Q_TILE);",
                 "  return;\n  let w = prefill_wg(wid, nwg, Q_TILE);")
REDUCE_EMPTY = ("reduce", "  let i = row % P.seq_len;", "  return;\n  let i = row % P.seq_len;")
# The reduce's max over its 256 lanes by subgroup max and one barrier instead of a chain of
# eight barriers (32-lane subgroups assumed: NVIDIA's; a measurement, right only there)
REDUCE_SG: Edit = ("reduce", """  red_s[lid] = x;
  workgroupBarrier();
  for (var step = THREADS / 2u; step > 0u; step = step / 2u) {
    if (lid < step) {
      let y = red_s[lid + step];
      red_s[lid] = select(red_s[lid] + y, max(red_s[lid], y), is_max);
    }
    workgroupBarrier();
  }
  let r = red_s[0];""", """  red_s[lid] = select(subgroupAdd(x), subgroupMax(x), is_max);
  workgroupBarrier();
  var r = red_s[0];
  for (var g = 32u; g < THREADS; g += 32u) {
    r = select(r + red_s[g], max(r, red_s[g]), is_max);
  }""")
# tile_weights' serial max (one lane per vector over the tile's keys) cut to one load, and
# its last barrier dropped (both wrong): what a lazy reference max could save
MAX_ONE: Edit = (DP, """    for (var jj = 0u; jj < KV_TILE; jj++) {
      mx = max(mx, p_s[jj * VECTORS + lid]);
    }""", "    mx = p_s[lid];")
EXP_BARRIER: Edit = (DP, """      p_s[e] = weight_of(p_s[e], mu_s[e % VECTORS]);
    }
  }
  workgroupBarrier();""", """      p_s[e] = weight_of(p_s[e], mu_s[e % VECTORS]);
    }
  }""")
# The direct decode's SLICES partial dots of a key met by subgroup shuffles (the slices of a
# key are consecutive lanes there) instead of through part_s and a barrier; lane h writes
# the logits of the vectors r with r % SLICES == h into p_s's half ps_at (only with
# P_DOUBLE: the previous tile's PV may still read p_s). Needs SLICES a power of two within
# a subgroup (the bench's decode cases: 4).
SHUFFLE_SLICES: Edit = ("decode_qk_common", """    for (var r = 0u; r < VECTORS; r++) {
      if (SLICES == 1u) {
        p_s[jj * VECTORS + r] = vec_logit(w, r, j0 + jj, sc[r], with_bias, plain);
      } else {
        part_s[(jj * VECTORS + r) * SLICES + h] = sc[r];
      }
    }
  }
  workgroupBarrier();
  if (SLICES > 1u) {""", """    for (var r = 0u; r < VECTORS; r++) {
      var x = sc[r];
      if (SLICES > 1u) { x += subgroupShuffleXor(x, 1u); }
      if (SLICES > 2u) { x += subgroupShuffleXor(x, 2u); }
      if (SLICES > 4u) { x += subgroupShuffleXor(x, 4u); }
      if (SLICES > 8u) { x += subgroupShuffleXor(x, 8u); }
      if (r % SLICES == h) {
        p_s[ps_at + jj * VECTORS + r] = vec_logit(w, r, j0 + jj, x, with_bias, plain);
      }
    }
  }
  workgroupBarrier();
  if (SLICES > 1u && DIRECT == 0u) {""")
# p_s double-buffered (the halves alternate by tile, ps_at), so the direct decode's logits
# can go to p_s before any barrier of their tile (the previous tile's PV reads the other
# half): with SHUFFLE_SLICES, one barrier a tile fewer and no part_s round trip.
P_DOUBLE: list[Edit] = [
    ("decode_common", "var<workgroup> p_s: array<f32, KV_TILE * VECTORS>;",
     "var<workgroup> p_s: array<f32, 2u * KV_TILE * VECTORS>;\nvar<private> ps_at: u32;"),
    ("decode_qk_common", """  if (DIRECT == 1u && SLICES == 1u) {
    workgroupBarrier();
  }""", ""),
    (DP, "mx = max(mx, p_s[jj * VECTORS + lid]);", "mx = max(mx, p_s[ps_at + jj * VECTORS + lid]);"),
    (DP, "p_s[e] = weight_of(p_s[e], mu_s[e % VECTORS]);",
     "p_s[ps_at + e] = weight_of(p_s[ps_at + e], mu_s[e % VECTORS]);"),
    ("decode_pv_common", "let p = p_s[jj * VECTORS + r];", "let p = p_s[ps_at + jj * VECTORS + r];"),
    (DP, """      acc = pv_tile(acc, st, cl, j0, tile_full(d, j0, tiles.x, tiles.y), d, vc);
    }
""", """      acc = pv_tile(acc, st, cl, j0, tile_full(d, j0, tiles.x, tiles.y), d, vc);
    }
    ps_at = KV_TILE * VECTORS - ps_at;
"""),
]
# Every tile's q read from q_s again, as before decode_qk_common's Q_IN_REGS.
Q_SHARED = (QK, "if (Q_IN_REGS == 1u) {", "if (false) {")


def _marked(fname: str) -> list[Edit]:
    """Every loop of a kernel source marked ``// @unroll``: the program builder writes out
    those with a constant bound and no break or continue (backends/webgpu/unroll.py)."""
    lines = sorted(set(m.group(0) for m in re.finditer(
        r"for \(var (\w+) = 0u; \1 < [^;]+; \1\+\+\) \{\n", program.load(fname))))
    return [(fname, h, f"{h[:-1]}  {unroll.MARK}\n") for h in lines]


# One query vector's FMAs kept of QK's (the others' scores stay 0) or of PV's (the others'
# outputs stay 0), every load and the softmax as planned: what the per-vector FMAs cost.
QK_ONE: Edit = (QK, "t[r] += dot(q_r[(g * UNIT_VEC4S + s) * VECTORS + r], kc);",
                "if (r == 0u) { t[r] += dot(q_r[(g * UNIT_VEC4S + s) * VECTORS + r], kc); }")
PV_ONE: Edit = (PV, "a.o[r][u] += (p * col_scale(n, u, vt)) * vv[u];",
                "if (r == 0u) { a.o[r][u] += (p * col_scale(n, u, vt)) * vv[u]; }")
# K's / V's units used as their bits (bitcast, no conversion to f32), for the cases whose
# load units are vec4<u32> (f16, bf16; int8's V unit is not): what the conversions cost.
K_NOCVT: Edit = (QK, "let kc = ku_part(ku.x, s);",
                 "let kc = bitcast<vec4<f32>>(ku.x ^ vec4<u32>(s));")
V_NOCVT: Edit = (PV, "vv[u] = vu_part(vt[n * LANE_UNITS + u / PV_UNIT].x, u % PV_UNIT);",
                 "vv[u] = bitcast<vec4<f32>>(vt[n * LANE_UNITS + u / PV_UNIT].x "
                 "^ vec4<u32>(u % PV_UNIT));")
# The tile's max and exp passes (tile_weights: two barriers) dropped: PV weighs by the logits.
NO_WEIGHTS: Edit = (DP, """    tile_weights(lid);
    if (st < STREAMS) {""", """    if (st < STREAMS) {""")
UNROLLED = [*_marked(DP), *_marked(QK), *_marked(PV)]
VARIANTS: dict[str, list[Edit]] = {
    "as_planned": [],
    "logits tested a key": [(QK, "return PLAIN_LOGITS == 1u && j0 >= klo", "return false && j0 >= klo")],
    "max one load": [MAX_ONE],
    "max one + no exp barrier": [MAX_ONE, EXP_BARRIER],
    "shuffles + double p_s": [SHUFFLE_SLICES, *P_DOUBLE],
    "q from workgroup memory": [Q_SHARED],
    "K/V from L1": L1,
    "K/V from L1 + q from workgroup memory": [*L1, Q_SHARED],
    "loads only": [(DP, COMPUTE, FOLD)],
    "loop skeleton": [(DP, COMPUTE, FOLD), *NO_LOADS],
    "loads only K": [(DP, COMPUTE, FOLD), NO_LOADS[1]],
    "loads only V": [(DP, COMPUTE, FOLD), NO_LOADS[0]],
    "loads only no scales": [(DP, COMPUTE, FOLD), *NO_SCALES],
    "2 tiles in flight": [(DP, _direct_fn(), RING)],
    "launches only": [PARTIAL_EMPTY],
    "reduce empty": [REDUCE_EMPTY],
    "reduce max by subgroups": [REDUCE_SG],
    "both empty": [PARTIAL_EMPTY, REDUCE_EMPTY],
    "prefill empty": [PREFILL_EMPTY],
    "unrolled": UNROLLED,
    "unrolled QK": _marked(QK),
    "unrolled PV": _marked(PV),
    "unrolled + K/V from L1": [*UNROLLED, *L1],
    "QK one vector": [QK_ONE],
    "PV one vector": [PV_ONE],
    "QK and PV one vector": [QK_ONE, PV_ONE],
    "QK and PV one vector + K/V from L1": [QK_ONE, PV_ONE, *L1],
    "K unconverted": [K_NOCVT],
    "V unconverted": [V_NOCVT],
    "K/V unconverted": [K_NOCVT, V_NOCVT],
    "K/V unconverted + K/V from L1": [K_NOCVT, V_NOCVT, *L1],
    "no max/exp passes": [NO_WEIGHTS],
    "no max/exp passes + K/V from L1": [NO_WEIGHTS, *L1],
}
# Launches for this long before each timing: an idle H100 drops its clocks while the next
# variant compiles, and 0.1 s of launches left the L=32768 cases timed 2-3x slow.
WARM_S = 0.6
CASES = ("decode-f16-L8192", "decode-f16-L32768", "whisper-S4-T1500",
         "decode-f16-int8-L32768", "decode-f16-int4-L32768")


def _median_us(sess: attnreg.Session, plan: attnreg.Plan, inputs: Mapping[str, Any],
               iters: int) -> tuple[float, float]:
    """(per launch, back to back in one pass) GPU microseconds, medians."""
    rt = sess.runtime(plan)
    rt.launch(plan, inputs)
    t = rt.timings(plan, inputs, iters=iters, warmup=5, warmup_s=WARM_S)
    return (statistics.median(t["gpu_s"] or t["wall_s"]) * 1e6,
            statistics.median(t["b2b_s"]) * 1e6)


def _one(backend: str, dev: Any, spec: attnreg.AttentionSpec, t: Mapping[str, Any],
         want: Any, iters: int, flags: Mapping[str, str], params: Mapping[str, int]) -> str:
    """One variant (program.load already edited) timed: its line's figures."""
    with attnreg.Session(backend=backend, device=dev.id, flags=dict(flags)) as s:
        plan = s.plan(spec, params=params)
        err, _ = testing.compare(spec, s.run(spec, t, params=params), want)
        us, b2b = _median_us(s, plan, t, iters)
        prm = {k: v for k, v in plan.stages[0].params.items()
               if k in ("kv_tile", "threads", "n_splits", "kv_staging", "m_tile", "group_tile")}
        return (f"{us:8.1f} us  one pass {b2b:7.1f} us  err {err:.2g}  "
                f"{' -> '.join(plan.kernels)} {prm}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--backends", default="dawn,webgpu", help="WebGPU backends (the edits "
                    "are WGSL's, and the timing warms up by the WebGPU runtime's warmup_s)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cases", default=",".join(CASES), help="bench suite case names")
    ap.add_argument("--cpu", action="store_true", help="take a CPU adapter too (a local check)")
    ap.add_argument("--flag", action="append", default=[], metavar="NAME=VALUE",
                    help="session flag, repeatable (e.g. route=prefill)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=INT",
                    help="kernel parameter, repeatable (e.g. split_size=1500)")
    args = ap.parse_args()
    flags = dict(f.split("=", 1) for f in args.flag)
    params = {k: int(v) for k, v in (p.split("=", 1) for p in args.param)}
    specs = {c.name: c.spec for cases in SUITES.values() for c in cases}
    original = program.load
    for backend in args.backends.split(","):
        devs = [d for d in attnreg.devices(backend) if args.cpu or d.device_type != "cpu"]
        if not devs:
            print(f"{backend}: no GPU adapter")
            continue
        dev = devs[0]
        print(f"\n{backend} {dev.name} ({dev.id}); GPU us per launch, median of {args.iters}")
        for name in args.cases.split(","):
            spec = specs[name]
            t = _inputs(spec)   # the bench's inputs (quantized K/V with their scales)
            want = testing.expected(spec, t)
            for variant in args.variants.split(","):
                program.load = source_with(VARIANTS[variant])
                try:
                    line = _one(backend, dev, spec, t, want, args.iters, flags, params)
                    print(f"  {name:24s} {variant:14s} {line}", flush=True)
                finally:
                    program.load = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
