// flash_prefill: one workgroup owns Q_TILE query rows of one head and streams the keys with an
// online softmax (FlashAttention-2 order: S = QK^T, row max, P = exp, O += PV). Threads form
// Q_TILE / ROWS_PER_LANE row groups of ROW_LANES lanes: a lane owns ROWS_PER_LANE rows and the
// score columns tx, tx+ROW_LANES, ... of each step, and a share of the output columns.
//
// Keys arrive in units of KV_TILE keys and are consumed in inner steps of K_STEP keys
// (max_k_step: the ROWS_PER_LANE x LANE_KEYS scores a lane keeps in private memory). Variants,
// all from prefix constants (tiles.prefill_consts):
//   STAGED 1 ("workgroup"): a unit is a K/V tile staged in workgroup memory by the whole
//     workgroup (PREFETCH pipelines the next tile through registers), STEPS steps per tile;
//   STAGED 0 ("direct"): a unit is one step; each row group reads the step's K rows and V
//     rows straight from memory (together it reads each of them once), no staging;
//   O_SPLIT 1 ("half_workgroup"): of a lane's LANE_SLOTS output vec4 slots per row
//     (LANE_UNITS units of OUT_UNIT vec4s), WG_SLOTS = half, rounded up, live in workgroup
//     memory (o_s, each lane its own entries), the other REG_SLOTS in registers; O_SPLIT 0:
//     all LANE_SLOTS in registers;
//   BLOCKS 1: units are the listed blocks of the masked-block list (block_skip), each with
//     its all-zero flag (the bias is not loaded for those), instead of every unit in span.
// An output unit is OUT_UNIT vec4 columns: one vec4 (STAGED 1, read from v_s) or one load
// granule (STAGED 0, read from v); OUT_UNITS of them make v's row, and so the output's, of V_DIM
// elements (v_head_size); q's and k's are QK_DIM. Row maxima and sums are combined over the
// ROW_LANES lanes of a row group: lane_max()/lane_sum() (subgroup shuffles over SHUFFLE_LANES
// lanes in the subgroup variant), then workgroup memory for the LANE_GROUPS groups left.
// Prefix constants: Q_TILE, KV_TILE, K_STEP, STEPS (steps per unit), ROWS_PER_LANE, ROW_LANES,
// SHUFFLE_LANES, PREFETCH, STAGED, STAGED_KEYS (k_s / v_s rows: KV_TILE, or 1 when direct),
// O_SPLIT, OUT_UNIT, OUT_UNITS, LANE_UNITS, LANE_SLOTS, REG_SLOTS, WG_SLOTS, O_S_SIZE (o_s's
// length).

const LANE_KEYS: u32 = K_STEP / ROW_LANES;      // scores per lane and row in a step
const THREADS: u32 = (Q_TILE / ROWS_PER_LANE) * ROW_LANES;
const K_STRIDE: u32 = QK_VEC4S + 1u;            // padded K row stride: lanes read distinct banks
const LANE_GROUPS: u32 = ROW_LANES / SHUFFLE_LANES;     // lane groups left after the shuffles
// K and V granules each lane loads per tile
const K_LOADS: u32 = (KV_TILE * QK_GRANULES + THREADS - 1u) / THREADS;
const V_LOADS: u32 = (KV_TILE * V_GRANULES + THREADS - 1u) / THREADS;
const AHEAD: u32 = PREFETCH * STAGED;           // tiles in flight ahead of the compute
const O_REGS: u32 = max(REG_SLOTS, 1u);         // register accumulator vec4s per row

var<workgroup> q_s: array<vec4<f32>, Q_TILE * QK_VEC4S>;
var<workgroup> k_s: array<TS, STAGED_KEYS * K_STRIDE>;
var<workgroup> v_s: array<TS, STAGED_KEYS * V_VEC4S>;
var<workgroup> p_s: array<f32, Q_TILE * K_STEP>;
var<workgroup> red_s: array<f32, Q_TILE * LANE_GROUPS>;
var<workgroup> o_s: array<vec4<f32>, O_S_SIZE>;

// Combine one value per row over the ROW_LANES lanes of a row group (max or sum). Called in
// uniform control flow by every invocation (it holds a barrier when LANE_GROUPS > 1).
fn rows_reduce(x: array<f32, ROWS_PER_LANE>, ty: u32, tx: u32, is_max: bool
               ) -> array<f32, ROWS_PER_LANE> {
  var r = x;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    if (is_max) {
      r[a] = lane_max(r[a]);
    } else {
      r[a] = lane_sum(r[a]);
    }
  }
  if (LANE_GROUPS > 1u) {
    if (tx % SHUFFLE_LANES == 0u) {
      for (var a = 0u; a < ROWS_PER_LANE; a++) {
        red_s[(ty * ROWS_PER_LANE + a) * LANE_GROUPS + tx / SHUFFLE_LANES] = r[a];
      }
    }
    workgroupBarrier();
    for (var a = 0u; a < ROWS_PER_LANE; a++) {
      var acc = red_s[(ty * ROWS_PER_LANE + a) * LANE_GROUPS];
      for (var g = 1u; g < LANE_GROUPS; g++) {
        let y = red_s[(ty * ROWS_PER_LANE + a) * LANE_GROUPS + g];
        acc = select(acc + y, max(acc, y), is_max);
      }
      r[a] = acc;
    }
    workgroupBarrier();
  }
  return r;
}

// Index of a lane's workgroup-memory output slot c (c < WG_SLOTS) for one row.
fn osi(row: u32, tx: u32, c: u32) -> u32 {
  return (row * ROW_LANES + tx) * WG_SLOTS + c;
}

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_k.
fn stage_k(idx: u32, kg: GV) {
  if (idx < KV_TILE * QK_GRANULES) {
    let ks = tile_at(idx, K_STRIDE, QK_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      k_s[ks + s] = ts_part(kg, s);
    }
  }
}

fn stage_v(idx: u32, vg: GV) {
  if (idx < KV_TILE * V_GRANULES) {
    let vs = tile_at(idx, V_VEC4S, V_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      v_s[vs + s] = ts_part(vg, s);
    }
  }
}

// The lane's output units (tx, tx+ROW_LANES, ...) of the value of key j, step key jj of step st:
// from v_s (STAGED 1) or v (STAGED 0, zeros outside [lo, hi), the keys some row sees).
fn step_values(st: u32, jj: u32, j: u32, tx: u32, b: u32, kvh: u32, lo: u32, hi: u32
               ) -> array<vec4<f32>, LANE_SLOTS> {
  var vv: array<vec4<f32>, LANE_SLOTS>;
  for (var c = 0u; c < LANE_UNITS; c++) {
    let un = tx + ROW_LANES * c;
    for (var s = 0u; s < OUT_UNIT; s++) {
      vv[c * OUT_UNIT + s] = vec4<f32>(0.0);
    }
    if (un < OUT_UNITS) {
      if (STAGED == 1u) {
        vv[c] = ts_f32(v_s[(st * K_STEP + jj) * V_VEC4S + un]);
      } else if (j >= lo && j < hi) {
        let gv = load_v(v_granule(b, kvh, j) + un);
        for (var s = 0u; s < OUT_UNIT; s++) {
          vv[c * OUT_UNIT + s] = vec4<f32>(g_part(gv, s));
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
    return vec2<u32>((e & 0x7fffffffu) * KV_TILE, 1u - (e >> 31u));
  }
  return vec2<u32>((u_first + it) * KV_TILE, 1u);
}

// A lane's values of one inner step: ROWS_PER_LANE rows x LANE_KEYS keys (tx, tx+ROW_LANES..).
alias Scores = array<array<f32, LANE_KEYS>, ROWS_PER_LANE>;

// A lane's rows: running maximum, its part of the sum, its register output slots.
struct Rows {
  m: array<f32, ROWS_PER_LANE>,
  l: array<f32, ROWS_PER_LANE>,
  o: array<array<vec4<f32>, O_REGS>, ROWS_PER_LANE>,
}

// The workgroup's Q_TILE query rows, scaled, into q_s; padding rows' q is never read.
fn stage_queries(w: PrefillWg, lid: u32) {
  for (var u = 0u; u < (Q_TILE * QK_GRANULES + THREADS - 1u) / THREADS; u++) {
    let idx = lid + u * THREADS;
    if (idx >= Q_TILE * QK_GRANULES) {
      break;
    }
    let r = idx / QK_GRANULES;
    let g = idx % QK_GRANULES;
    var gv = GV();
    if (w.i0 + r < w.seq.rows) {
      gv = load_q(q_granule(w.b, w.h, w.i0 + r) + g);
    }
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      q_s[r * QK_VEC4S + g * GRANULE_VEC4S + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
}

// Keys [lo, hi) each of the lane's rows sees (row_span).
fn row_spans(w: PrefillWg, ty: u32) -> array<vec2<i32>, ROWS_PER_LANE> {
  var rk: array<vec2<i32>, ROWS_PER_LANE>;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    rk[a] = row_span(row_pos(w.seq, w.i0 + ty * ROWS_PER_LANE + a), w.seq);
  }
  return rk;
}

// A lane's rows before the first key (and its o_s slots zero).
fn start_rows(ty: u32, tx: u32) -> Rows {
  var r: Rows;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    r.m[a] = MASKED;
    r.l[a] = 0.0;
    for (var c = 0u; c < O_REGS; c++) {
      r.o[a][c] = vec4<f32>(0.0);
    }
    for (var c = 0u; c < WG_SLOTS; c++) {
      o_s[osi(ty * ROWS_PER_LANE + a, tx, c)] = vec4<f32>(0.0);
    }
  }
  return r;
}

// The units to visit, (first unit, unit count, first list entry): every unit meeting the
// span of keys the rows see, or the listed blocks there (BLOCKS 1).
fn unit_range(w: PrefillWg) -> vec3<u32> {
  let lo = u32(w.span.x);
  let hi = u32(w.span.y);
  let u_first = lo / KV_TILE;
  var n_units = select(0u, cdiv(hi, KV_TILE) - u_first, hi > lo);
  var l_first = 0u;
  if (BLOCKS == 1u) {
    let ls = blk_span(blk_row(w.b, w.h, w.rt, w.n_rt), lo, hi, KV_TILE);
    l_first = ls.x;
    n_units = ls.y - ls.x;
  }
  return vec3<u32>(u_first, n_units, l_first);
}

// S = QK^T for the lane's rows and the keys of step st (from js), accumulated in private
// memory: from k_s (STAGED 1) or straight from k (STAGED 0: only keys some row sees).
fn step_scores(st: u32, js: u32, ty: u32, tx: u32, b: u32, kvh: u32, lo: u32, hi: u32
               ) -> Scores {
  var sc: Scores;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    for (var e = 0u; e < LANE_KEYS; e++) {
      sc[a][e] = 0.0;
    }
  }
  if (STAGED == 1u) {
    for (var c = 0u; c < QK_VEC4S; c++) {
      var kc: array<vec4<f32>, LANE_KEYS>;
      for (var e = 0u; e < LANE_KEYS; e++) {
        kc[e] = ts_f32(k_s[(st * K_STEP + tx + ROW_LANES * e) * K_STRIDE + c]);
      }
      for (var a = 0u; a < ROWS_PER_LANE; a++) {
        let qa = q_s[(ty * ROWS_PER_LANE + a) * QK_VEC4S + c];
        for (var e = 0u; e < LANE_KEYS; e++) {
          sc[a][e] += dot(qa, kc[e]);
        }
      }
    }
  } else {
    var kb: array<u32, LANE_KEYS>;
    var ok: array<bool, LANE_KEYS>;
    for (var e = 0u; e < LANE_KEYS; e++) {
      let j = js + tx + ROW_LANES * e;
      ok[e] = j >= lo && j < hi;        // only keys some row sees
      kb[e] = 0u;
      if (ok[e]) {
        kb[e] = kv_granule(b, kvh, j);
      }
    }
    for (var g = 0u; g < QK_GRANULES; g++) {
      var kg: array<GV, LANE_KEYS>;
      for (var e = 0u; e < LANE_KEYS; e++) {
        kg[e] = GV();
        if (ok[e]) {
          kg[e] = load_k(kb[e] + g);
        }
      }
      for (var s = 0u; s < GRANULE_VEC4S; s++) {
        for (var a = 0u; a < ROWS_PER_LANE; a++) {
          let qa = q_s[(ty * ROWS_PER_LANE + a) * QK_VEC4S + g * GRANULE_VEC4S + s];
          for (var e = 0u; e < LANE_KEYS; e++) {
            sc[a][e] += dot(qa, vec4<f32>(g_part(kg[e], s)));
          }
        }
      }
    }
  }
  return sc;
}

// The step's scores as logits, MASKED where the row does not see the key; wb false: the
// unit's bias is known to be 0 (not loaded).
fn step_logits(raw: Scores, js: u32, ty: u32, tx: u32, w: PrefillWg, hi: u32, wb: bool
               ) -> Scores {
  var sc = raw;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    let i = w.i0 + ty * ROWS_PER_LANE + a;
    let pos = row_pos(w.seq, i);
    for (var e = 0u; e < LANE_KEYS; e++) {
      let j = js + tx + ROW_LANES * e;
      var x = MASKED;
      if (i < P.seq_len && j < hi && key_visible(i32(j), pos, w.seq)) {
        x = logit_b(sc[a][e], w.b, w.h, i, j, pos, wb);
      }
      sc[a][e] = x;
    }
  }
  return sc;
}

// The lane's maximum logit of each row.
fn rows_max(sc: Scores) -> array<f32, ROWS_PER_LANE> {
  var mx: array<f32, ROWS_PER_LANE>;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    var best = MASKED;
    for (var e = 0u; e < LANE_KEYS; e++) {
      best = max(best, sc[a][e]);
    }
    mx[a] = best;
  }
  return mx;
}

// The rows after the step's softmax: the running maximum moved to mx (the rows' step max),
// the weights P = exp(x - m) of the lane's logits into p_s, the sums and the output
// rescaled. p_s's previous readers must be done.
fn step_weights(rows: Rows, sc: Scores, mx: array<f32, ROWS_PER_LANE>, ty: u32, tx: u32
                ) -> Rows {
  var r = rows;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    let m_new = max(r.m[a], mx[a]);
    // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
    let m_use = select(m_new, 0.0, m_new <= MASKED);
    let alpha = exp(r.m[a] - m_use);
    r.m[a] = m_new;
    var psum = 0.0;
    for (var e = 0u; e < LANE_KEYS; e++) {
      let p = weight_of(sc[a][e], m_use);
      psum += p;
      p_s[(ty * ROWS_PER_LANE + a) * K_STEP + tx + ROW_LANES * e] = p;
    }
    r.l[a] = r.l[a] * alpha + psum;
    for (var c = 0u; c < O_REGS; c++) {
      r.o[a][c] *= alpha;
    }
    for (var c = 0u; c < WG_SLOTS; c++) {
      o_s[osi(ty * ROWS_PER_LANE + a, tx, c)] *= alpha;
    }
  }
  return r;
}

// The rows plus P V over the step's keys, on the lane's output units tx, tx+ROW_LANES, ...;
// full: every row takes every key (the step lies where all rows see), else each row only
// the keys it sees (rk: on the causal diagonal or a window's edge).
fn step_pv(rows: Rows, st: u32, js: u32, ty: u32, tx: u32, b: u32, kvh: u32, lo: u32,
           hi: u32, rk: array<vec2<i32>, ROWS_PER_LANE>, full: bool) -> Rows {
  // Both calls pass full as a literal, so each inlined call is the loop it needs.
  if (full) {
    return step_keys(rows, st, js, ty, tx, b, kvh, lo, hi, rk, true);
  }
  return step_keys(rows, st, js, ty, tx, b, kvh, lo, hi, rk, false);
}

fn step_keys(rows: Rows, st: u32, js: u32, ty: u32, tx: u32, b: u32, kvh: u32, lo: u32,
             hi: u32, rk: array<vec2<i32>, ROWS_PER_LANE>, full: bool) -> Rows {
  var r = rows;
  for (var jj = 0u; jj < K_STEP; jj++) {
    let j = js + jj;
    let vv = step_values(st, jj, j, tx, b, kvh, lo, hi);
    for (var a = 0u; a < ROWS_PER_LANE; a++) {
      // a branch per (key, row), not a select per element: the edge steps then cost what
      // the full ones do
      if (full || (i32(j) >= rk[a].x && i32(j) < rk[a].y)) {
        let p = p_s[(ty * ROWS_PER_LANE + a) * K_STEP + jj];
        for (var c = 0u; c < REG_SLOTS; c++) {
          r.o[a][c] += p * vv[c];
        }
        for (var c = 0u; c < WG_SLOTS; c++) {
          let at = osi(ty * ROWS_PER_LANE + a, tx, c);
          o_s[at] += p * vv[REG_SLOTS + c];
        }
      }
    }
  }
  return r;
}

// The lane's rows out: each lane summed only its own columns, so the row sum is the sum over
// the row group (rows_reduce: called by every lane).
fn write_rows(rows: Rows, w: PrefillWg, ty: u32, tx: u32) {
  let l = rows_reduce(rows.l, ty, tx, false);
  for (var a = 0u; a < ROWS_PER_LANE; a++) {
    let i = w.i0 + ty * ROWS_PER_LANE + a;
    if (i < P.seq_len) {
      let fin = finish_row(rows.m[a], l[a], row_sink(w.h, w.seq, i));
      let base = out_vec4(w.b, w.h, i);
      for (var c = 0u; c < LANE_SLOTS; c++) {
        let un = tx + ROW_LANES * (c / OUT_UNIT);
        if (un < OUT_UNITS) {
          var acc = vec4<f32>(0.0);
          if (c < REG_SLOTS) {
            acc = rows.o[a][c];
          } else {
            acc = o_s[osi(ty * ROWS_PER_LANE + a, tx, c - REG_SLOTS)];
          }
          store_out(base + un * OUT_UNIT + c % OUT_UNIT, finite_or_nan4(acc * fin.x));
        }
      }
      if (P.return_lse != 0u && tx == 0u) {
        lse[(w.b * P.num_heads + w.h) * P.seq_len + i] = fin.y;
      }
    }
  }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let w = prefill_wg(wid, nwg, Q_TILE);
  if (!w.ok) {
    return;
  }
  let ty = lid / ROW_LANES;
  let tx = lid % ROW_LANES;
  let seen_all = common_span(w.seq, w.i0, min(w.i0 + Q_TILE, P.seq_len) - 1u);
  let rk = row_spans(w, ty);                  // the keys each of the lane's rows sees
  let lo = u32(w.span.x);
  let hi = u32(w.span.y);

  stage_queries(w, lid);
  workgroupBarrier();     // q_s is read by every lane (STAGED 0 has no staging barrier first)
  var rows = start_rows(ty, tx);
  let units = unit_range(w);

  // Unit loop, with STAGED 1 pipelined as decode_partial's tile loop (which says why its
  // loads and staging are written out here): with PREFETCH, tile it-1 is staged, tile it's
  // loads issued, then tile it-1 computed while they fly.
  var kr: array<GV, K_LOADS>;
  var vr: array<GV, V_LOADS>;
  for (var it = 0u; it < units.y + AHEAD; it++) {
    if (STAGED == 1u) {
      if (AHEAD == 1u && it > 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < K_LOADS; u++) {
          stage_k(lid + u * THREADS, kr[u]);
        }
        for (var u = 0u; u < V_LOADS; u++) {
          stage_v(lid + u * THREADS, vr[u]);
        }
        workgroupBarrier();
      }
      var jf = 0u;
      if (it < units.y) {
        jf = unit_of(it, units.x, units.z).x;
      }
      for (var u = 0u; u < K_LOADS; u++) {     // only keys some row sees
        let g = kv_granules(lid + u * THREADS, w.b, w.kvh, jf, lo, hi, it < units.y);
        kr[u] = g.k;
        if (V_GRANULES == QK_GRANULES) {
          vr[u] = g.v;
        }
      }
      if (V_GRANULES != QK_GRANULES) {
        for (var u = 0u; u < V_LOADS; u++) {
          vr[u] = v_granules(lid + u * THREADS, w.b, w.kvh, jf, lo, hi, it < units.y);
        }
      }
      if (AHEAD == 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < K_LOADS; u++) {
          stage_k(lid + u * THREADS, kr[u]);
        }
        for (var u = 0u; u < V_LOADS; u++) {
          stage_v(lid + u * THREADS, vr[u]);
        }
        workgroupBarrier();
      }
      if (it < AHEAD) {
        continue;
      }
    }
    let cur = unit_of(it - AHEAD, units.x, units.z);    // (first key, bias needed)
    for (var st = 0u; st < STEPS; st++) {
      let js = cur.x + st * K_STEP;           // first key of this step
      let sc = step_logits(step_scores(st, js, ty, tx, w.b, w.kvh, lo, hi), js, ty, tx, w, hi,
                           cur.y == 1u);
      let mx = rows_reduce(rows_max(sc), ty, tx, true);
      workgroupBarrier();     // the previous step's readers are done with p_s
      rows = step_weights(rows, sc, mx, ty, tx);
      workgroupBarrier();
      rows = step_pv(rows, st, js, ty, tx, w.b, w.kvh, lo, hi, rk,
                     all_see(js, js + K_STEP, w.span, seen_all));
    }
  }
  write_rows(rows, w, ty, tx);
}
