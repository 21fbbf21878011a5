// flash_prefill: one workgroup owns BR query rows of one head and streams the keys with an
// online softmax (FlashAttention-2 order: S = QK^T, row max, P = exp, O += PV). Threads form
// BR/TR row groups of NCG lanes: a lane owns TR rows and the score columns tx, tx+NCG, ... of
// each step, and a share of the output columns.
//
// Keys arrive in units of BC keys and are consumed in inner steps of STEP keys (max_k_step:
// the TR x STEP/NCG scores a lane keeps in private memory). Variants, all from prefix
// constants (tiles.prefill_consts):
//   STAGE 1 ("workgroup"): a unit is a K/V tile staged in workgroup memory by the whole
//     workgroup (PREFETCH pipelines the next tile through registers), NSTEP steps per tile;
//   STAGE 0 ("direct"): a unit is one step; each row group reads the step's K rows and V
//     rows straight from memory (together it reads each of them once), no staging;
//   OUTW 1 ("half_workgroup"): of a lane's OSL output vec4 slots (OCU units of OW vec4s),
//     OSW = half, rounded up, live in workgroup memory (o_s, each lane its own entries), the
//     other OSR in registers; OUTW 0: all OSL in registers;
//   BLOCKS 1: units are the listed blocks of the masked-block list (block_skip), each with
//     its all-zero flag (the bias is not loaded for those), instead of every unit in span.
// An output unit is OW vec4 columns: one vec4 (STAGE 1, read from v_s) or one load granule
// (STAGE 0, read from v); v's rows and so the output's are VD elements (v_head_size), q's
// and k's HD. Row maxima and sums are combined over the NCG lanes of a row
// group: lane_max()/lane_sum() (subgroup shuffles over SGW lanes in the subgroup variant),
// then workgroup memory for the NCG/SGW groups left.
// Prefix constants: BR, BC, STEP, NSTEP, TR, NCG, SGW, PREFETCH, STAGE, KVS, OUTW, OW, NU,
// OCU, OSL, OSR, OSW, OSZ.

const TC: u32 = STEP / NCG;               // scores per lane and row in a step
const WG: u32 = (BR / TR) * NCG;
const KS: u32 = HV + 1u;                  // padded K row stride: lanes read distinct banks
const NG: u32 = NCG / SGW;                // lane groups left after the shuffles
const NLD: u32 = (BC * HG + WG - 1u) / WG; // K granules each lane loads per tile
const NLV: u32 = (BC * VG + WG - 1u) / WG; // V granules each lane loads per tile
const PRE: u32 = PREFETCH * STAGE;        // tiles in flight ahead of the compute
const ORN: u32 = max(OSR, 1u);            // register accumulator vec4s per row

var<workgroup> q_s: array<vec4<f32>, BR * HV>;
var<workgroup> k_s: array<TS, KVS * KS>;
var<workgroup> v_s: array<TS, KVS * VV>;
var<workgroup> p_s: array<f32, BR * STEP>;
var<workgroup> red_s: array<f32, BR * NG>;
var<workgroup> o_s: array<vec4<f32>, OSZ>;

// Combine one value per row over the NCG lanes of a row group (max or sum). Called in
// uniform control flow by every invocation (it holds a barrier when NG > 1).
fn rows_reduce(x: array<f32, TR>, ty: u32, tx: u32, is_max: bool) -> array<f32, TR> {
  var r = x;
  for (var a = 0u; a < TR; a++) {
    if (is_max) {
      r[a] = lane_max(r[a]);
    } else {
      r[a] = lane_sum(r[a]);
    }
  }
  if (NG > 1u) {
    if (tx % SGW == 0u) {
      for (var a = 0u; a < TR; a++) {
        red_s[(ty * TR + a) * NG + tx / SGW] = r[a];
      }
    }
    workgroupBarrier();
    for (var a = 0u; a < TR; a++) {
      var acc = red_s[(ty * TR + a) * NG];
      for (var g = 1u; g < NG; g++) {
        let y = red_s[(ty * TR + a) * NG + g];
        acc = select(acc + y, max(acc, y), is_max);
      }
      r[a] = acc;
    }
    workgroupBarrier();
  }
  return r;
}

// Index of a lane's workgroup-memory output slot c (c < OSW) for one row.
fn osi(row: u32, tx: u32, c: u32) -> u32 {
  return (row * NCG + tx) * OSW + c;
}

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_k.
fn stage_k(idx: u32, kg: GV) {
  if (idx < BC * HG) {
    let ks = tile_at(idx, KS, HG);
    for (var s = 0u; s < GS; s++) {
      k_s[ks + s] = ts_part(kg, s);
    }
  }
}

fn stage_v(idx: u32, vg: GV) {
  if (idx < BC * VG) {
    let vs = tile_at(idx, VV, VG);
    for (var s = 0u; s < GS; s++) {
      v_s[vs + s] = ts_part(vg, s);
    }
  }
}

// The lane's output units (tx, tx+NCG, ...) of the value of key j, step key jj of step st:
// from v_s (STAGE 1) or v (STAGE 0, zeros outside [lo, hi), the keys some row sees).
fn step_values(st: u32, jj: u32, j: u32, tx: u32, b: u32, kvh: u32, lo: u32, hi: u32
               ) -> array<vec4<f32>, OSL> {
  var vv: array<vec4<f32>, OSL>;
  for (var c = 0u; c < OCU; c++) {
    let un = tx + NCG * c;
    for (var s = 0u; s < OW; s++) {
      vv[c * OW + s] = vec4<f32>(0.0);
    }
    if (un < NU) {
      if (STAGE == 1u) {
        vv[c] = ts_f32(v_s[(st * STEP + jj) * VV + un]);
      } else if (j >= lo && j < hi) {
        let gv = load_v(v_granule(b, kvh, j) + un);
        for (var s = 0u; s < OW; s++) {
          vv[c * OW + s] = vec4<f32>(g_part(gv, s));
        }
      }
    }
  }
  return vv;
}

// (first key, bias needed) of unit it: contiguous units from u_first, or listed blocks.
fn unit_of(it: u32, u_first: u32, l_first: u32) -> vec2<u32> {
  if (BLOCKS == 1u) {
    let e = blk_entry(l_first + it);
    return vec2<u32>((e & 0x7fffffffu) * BC, 1u - (e >> 31u));
  }
  return vec2<u32>((u_first + it) * BC, 1u);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let w = prefill_wg(wid, nwg, BR);
  if (!w.ok) {
    return;
  }
  let rt = w.rt;
  let n_rt = w.n_rt;
  let h = w.h;
  let b = w.b;
  let kvh = w.kvh;
  let sq = w.seq;
  let ty = lid / NCG;
  let tx = lid % NCG;
  let i0 = w.i0;
  let span = w.span;
  let seen_all = common_span(sq, i0, min(i0 + BR, P.seq_len) - 1u);
  var rk: array<vec2<i32>, TR>;            // the keys each of the lane's rows sees
  for (var a = 0u; a < TR; a++) {
    rk[a] = row_span(row_pos(sq, i0 + ty * TR + a), sq);
  }
  let lo = u32(span.x);
  let hi = u32(span.y);

  for (var u = 0u; u < (BR * HG + WG - 1u) / WG; u++) {
    let idx = lid + u * WG;
    if (idx >= BR * HG) {
      break;
    }
    let r = idx / HG;
    let g = idx % HG;
    var gv = GV();
    if (i0 + r < sq.rows) {               // padding rows' q is never read
      gv = load_q(q_granule(b, h, i0 + r) + g);
    }
    for (var s = 0u; s < GS; s++) {
      q_s[r * HV + g * GS + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  workgroupBarrier();     // q_s is read by every lane (STAGE 0 has no staging barrier first)

  var m: array<f32, TR>;
  var l: array<f32, TR>;
  var o: array<array<vec4<f32>, ORN>, TR>;
  for (var a = 0u; a < TR; a++) {
    m[a] = MASKED;
    l[a] = 0.0;
    for (var c = 0u; c < ORN; c++) {
      o[a][c] = vec4<f32>(0.0);
    }
    for (var c = 0u; c < OSW; c++) {
      o_s[osi(ty * TR + a, tx, c)] = vec4<f32>(0.0);
    }
  }

  // The units to visit: every unit meeting [span.x, span.y), or the listed blocks there.
  let u_first = u32(span.x) / BC;
  var n_units = select(0u, cdiv(hi, BC) - u_first, hi > u32(span.x));
  var l_first = 0u;
  if (BLOCKS == 1u) {
    let ls = blk_span(blk_row(b, h, rt, n_rt), u32(span.x), hi, BC);
    l_first = ls.x;
    n_units = ls.y - ls.x;
  }

  // Unit loop. STAGE 1 with PREFETCH: iteration it stores tile it-1 (already in registers)
  // to workgroup memory, issues the loads of tile it, then computes tile it-1, so the loads
  // fly during the compute. The loads have a constant trip count (the compiler unrolls them
  // and issues all before the first use) and sit in main: a helper taking the register
  // tile by pointer made a driver keep it in local memory.
  var kr: array<GV, NLD>;
  var vr: array<GV, NLV>;
  for (var it = 0u; it < n_units + PRE; it++) {
    if (STAGE == 1u) {
      if (PRE == 1u && it > 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < NLD; u++) {
          stage_k(lid + u * WG, kr[u]);
        }
        for (var u = 0u; u < NLV; u++) {
          stage_v(lid + u * WG, vr[u]);
        }
        workgroupBarrier();
      }
      var jf = 0u;
      if (it < n_units) {
        jf = unit_of(it, u_first, l_first).x;
      }
      for (var u = 0u; u < NLD; u++) {
        let idx = lid + u * WG;
        let jj = idx / HG;
        kr[u] = GV();
        if (VG == HG) {
          vr[u] = GV();
        }
        // only keys some row sees: never past the valid length, never left of the window
        // or of kv_start
        if (idx < BC * HG && it < n_units && jf + jj >= lo && jf + jj < hi) {
          let at = kv_granule(b, kvh, jf + jj) + idx % HG;
          kr[u] = load_k(at);
          if (VG == HG) {                   // v's rows are k's: the same granules
            vr[u] = load_v(at);
          }
        }
      }
      if (VG != HG) {
        for (var u = 0u; u < NLV; u++) {
          let idx = lid + u * WG;
          let jj = idx / VG;
          vr[u] = GV();
          if (idx < BC * VG && it < n_units && jf + jj >= lo && jf + jj < hi) {
            vr[u] = load_v(v_granule(b, kvh, jf + jj) + idx % VG);
          }
        }
      }
      if (PRE == 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < NLD; u++) {
          stage_k(lid + u * WG, kr[u]);
        }
        for (var u = 0u; u < NLV; u++) {
          stage_v(lid + u * WG, vr[u]);
        }
        workgroupBarrier();
      }
      if (it < PRE) {
        continue;
      }
    }
    let cur = unit_of(it - PRE, u_first, l_first);
    let wb = cur.y == 1u;

    for (var st = 0u; st < NSTEP; st++) {
      let js = cur.x + st * STEP;           // first key of this step

      // S = QK^T for the lane's TR rows and TC keys, accumulated in private memory.
      var sc: array<array<f32, TC>, TR>;
      for (var a = 0u; a < TR; a++) {
        for (var e = 0u; e < TC; e++) {
          sc[a][e] = 0.0;
        }
      }
      if (STAGE == 1u) {
        for (var c = 0u; c < HV; c++) {
          var kc: array<vec4<f32>, TC>;
          for (var e = 0u; e < TC; e++) {
            kc[e] = ts_f32(k_s[(st * STEP + tx + NCG * e) * KS + c]);
          }
          for (var a = 0u; a < TR; a++) {
            let qa = q_s[(ty * TR + a) * HV + c];
            for (var e = 0u; e < TC; e++) {
              sc[a][e] += dot(qa, kc[e]);
            }
          }
        }
      } else {
        var kb: array<u32, TC>;
        var ok: array<bool, TC>;
        for (var e = 0u; e < TC; e++) {
          let j = js + tx + NCG * e;
          ok[e] = j >= lo && j < hi;        // only keys some row sees
          kb[e] = 0u;
          if (ok[e]) {
            kb[e] = kv_granule(b, kvh, j);
          }
        }
        for (var g = 0u; g < HG; g++) {
          var kg: array<GV, TC>;
          for (var e = 0u; e < TC; e++) {
            kg[e] = GV();
            if (ok[e]) {
              kg[e] = load_k(kb[e] + g);
            }
          }
          for (var s = 0u; s < GS; s++) {
            for (var a = 0u; a < TR; a++) {
              let qa = q_s[(ty * TR + a) * HV + g * GS + s];
              for (var e = 0u; e < TC; e++) {
                sc[a][e] += dot(qa, vec4<f32>(g_part(kg[e], s)));
              }
            }
          }
        }
      }

      var mx: array<f32, TR>;
      for (var a = 0u; a < TR; a++) {
        let i = i0 + ty * TR + a;
        let pos = row_pos(sq, i);
        var best = MASKED;
        for (var e = 0u; e < TC; e++) {
          let j = js + tx + NCG * e;
          var x = MASKED;
          if (i < P.seq_len && j < hi && key_visible(i32(j), pos, sq)) {
            x = logit_b(sc[a][e], b, h, i, j, pos, wb);
          }
          sc[a][e] = x;
          best = max(best, x);
        }
        mx[a] = best;
      }
      mx = rows_reduce(mx, ty, tx, true);
      workgroupBarrier();     // the previous step's readers are done with p_s

      for (var a = 0u; a < TR; a++) {
        let m_new = max(m[a], mx[a]);
        // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
        let m_use = select(m_new, 0.0, m_new <= MASKED);
        let alpha = exp(m[a] - m_use);
        m[a] = m_new;
        var psum = 0.0;
        for (var e = 0u; e < TC; e++) {
          let p = weight_of(sc[a][e], m_use);
          psum += p;
          p_s[(ty * TR + a) * STEP + tx + NCG * e] = p;
        }
        l[a] = l[a] * alpha + psum;
        for (var c = 0u; c < ORN; c++) {
          o[a][c] *= alpha;
        }
        for (var c = 0u; c < OSW; c++) {
          o_s[osi(ty * TR + a, tx, c)] *= alpha;
        }
      }
      workgroupBarrier();

      // O += P V over the step's keys; the lane's output units are tx, tx+NCG, ... A step
      // on the causal diagonal or the window's edge adds only the keys each row sees.
      if (all_see(js, js + STEP, span, seen_all)) {
        for (var jj = 0u; jj < STEP; jj++) {
          let vv = step_values(st, jj, js + jj, tx, b, kvh, lo, hi);
          for (var a = 0u; a < TR; a++) {
            let p = p_s[(ty * TR + a) * STEP + jj];
            for (var c = 0u; c < OSR; c++) {
              o[a][c] += p * vv[c];
            }
            for (var c = 0u; c < OSW; c++) {
              let at = osi(ty * TR + a, tx, c);
              o_s[at] += p * vv[OSR + c];
            }
          }
        }
      } else {
        for (var jj = 0u; jj < STEP; jj++) {
          let j = js + jj;
          let vv = step_values(st, jj, j, tx, b, kvh, lo, hi);
          for (var a = 0u; a < TR; a++) {
            // a branch per (key, row), not a select per element: the edge steps then
            // cost what the full ones do
            if (i32(j) >= rk[a].x && i32(j) < rk[a].y) {
              let p = p_s[(ty * TR + a) * STEP + jj];
              for (var c = 0u; c < OSR; c++) {
                o[a][c] += p * vv[c];
              }
              for (var c = 0u; c < OSW; c++) {
                let at = osi(ty * TR + a, tx, c);
                o_s[at] += p * vv[OSR + c];
              }
            }
          }
        }
      }
    }
  }

  // Each lane summed only its own columns: the row sum is the sum over the row group.
  l = rows_reduce(l, ty, tx, false);
  for (var a = 0u; a < TR; a++) {
    let i = i0 + ty * TR + a;
    if (i < P.seq_len) {
      let fin = finish_row(m[a], l[a], row_sink(h, sq, i));
      let base = out_vec4(b, h, i);
      for (var c = 0u; c < OSL; c++) {
        let un = tx + NCG * (c / OW);
        if (un < NU) {
          var acc = vec4<f32>(0.0);
          if (c < OSR) {
            acc = o[a][c];
          } else {
            acc = o_s[osi(ty * TR + a, tx, c - OSR)];
          }
          store_out(base + un * OW + c % OW, finite_or_nan4(acc * fin.x));
        }
      }
      if (P.return_lse != 0u && tx == 0u) {
        lse[(b * P.num_heads + h) * P.seq_len + i] = fin.y;
      }
    }
  }
}
