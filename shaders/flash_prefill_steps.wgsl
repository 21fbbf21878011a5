// flash_prefill's constants, workgroup memory and helpers (its kernel, main, and the account of
// its variants: flash_prefill.wgsl, which follows this file in the program): the row groups'
// reductions, the staging stores of K/V granules, a lane's values of a step, the unit list.

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
// uniform control flow by every invocation (it holds a barrier when LANE_GROUPS > 1 and not
// wide). wide: this dispatch's subgroups hold whole row groups (subgroup_lanes() >=
// ROW_LANES, uniform), so shuffles finish the job past SHUFFLE_LANES and workgroup memory is
// not needed (NVIDIA: 16 lanes a row group in 32-lane subgroups; Dawn on the H200, S=2048:
// 2108-2111 us against 2146-2150 held to SHUFFLE_LANES, h200_wgsl_scalar_prefill.txt).
fn rows_reduce(x: array<f32, ROWS_PER_LANE>, ty: u32, tx: u32, is_max: bool, wide: bool
               ) -> array<f32, ROWS_PER_LANE> {
  var r = x;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    if (is_max) {
      r[a] = lane_max(r[a]);
    } else {
      r[a] = lane_sum(r[a]);
    }
  }
  if (wide) {
    for (var s = SHUFFLE_LANES; s < ROW_LANES; s = s << 1u) {
      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        let y = lane_xor(r[a], s);
        r[a] = select(r[a] + y, max(r[a], y), is_max);
      }
    }
  } else if (LANE_GROUPS > 1u) {
    if (tx % SHUFFLE_LANES == 0u) {
      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        red_s[(ty * ROWS_PER_LANE + a) * LANE_GROUPS + tx / SHUFFLE_LANES] = r[a];
      }
    }
    workgroupBarrier();
    for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
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
    for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
      k_s[ks + s] = ts_part(kg, s);
    }
  }
}

fn stage_v(idx: u32, vg: GV) {
  if (idx < KV_TILE * V_GRANULES) {
    let vs = tile_at(idx, V_VEC4S, V_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
      v_s[vs + s] = ts_part(vg, s);
    }
  }
}

// The lane's output units (tx, tx+ROW_LANES, ...) of the value of key j, step key jj of step st:
// from v_s (STAGED 1) or v (STAGED 0, zeros outside [lo, hi), the keys some row sees).
fn step_values(st: u32, jj: u32, j: u32, tx: u32, b: u32, kvh: u32, lo: u32, hi: u32
               ) -> array<vec4<f32>, LANE_SLOTS> {
  var vv: array<vec4<f32>, LANE_SLOTS>;
  for (var c = 0u; c < LANE_UNITS; c++) {  // @unroll
    let un = tx + ROW_LANES * c;
    for (var s = 0u; s < OUT_UNIT; s++) {  // @unroll
      vv[c * OUT_UNIT + s] = vec4<f32>(0.0);
    }
    if (un < OUT_UNITS) {
      if (STAGED == 1u) {
        vv[c] = ts_f32(v_s[(st * K_STEP + jj) * V_VEC4S + un]);
      } else if (j >= lo && j < hi) {
        let gv = load_v(v_granule(b, kvh, j) + un);
        for (var s = 0u; s < OUT_UNIT; s++) {  // @unroll
          vv[c * OUT_UNIT + s] = vec4<f32>(g_part(gv, s));
        }
      }
    }
  }
  return vv;
}

// step_values where every row sees every key of the step: a staged V row whose units the
// row group covers exactly is read with no per-unit tests (Dawn on the H200, S=2048: 2108-2111
// us against 2125-2126 through step_values; ci/results/h200_wgsl_scalar_prefill.txt).
fn full_values(st: u32, jj: u32, j: u32, tx: u32, b: u32, kvh: u32, lo: u32, hi: u32
               ) -> array<vec4<f32>, LANE_SLOTS> {
  if (STAGED == 0u || OUT_UNITS % ROW_LANES != 0u) {
    return step_values(st, jj, j, tx, b, kvh, lo, hi);
  }
  var vv: array<vec4<f32>, LANE_SLOTS>;
  for (var c = 0u; c < LANE_UNITS; c++) {  // @unroll
    vv[c] = ts_f32(v_s[(st * K_STEP + jj) * V_VEC4S + tx + ROW_LANES * c]);
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
