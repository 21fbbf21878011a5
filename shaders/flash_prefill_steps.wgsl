// flash_prefill's constants, workgroup memory and helpers (its kernel, main: flash_prefill.wgsl,
// which follows this file in the program): the row groups' reductions, the staging stores of
// K/V granules, a lane's values of a step, the unit list; and the account of its variants:
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
//     its all-zero flag (the bias is not loaded for those), instead of every unit in span;
//   SLICED 1 (qk_layout "sliced", STAGED 1): the row group's lanes split the head dimension
//     for QK^T (SLICED below says how), KV_F32 1: K/V staged as f32.
// An output unit is OUT_UNIT vec4 columns: one vec4 (STAGED 1, read from v_s) or one load
// granule (STAGED 0, read from v); OUT_UNITS of them make v's row, and so the output's, of V_DIM
// elements (v_head_size); q's and k's are QK_DIM. Row maxima and sums are combined over the
// ROW_LANES lanes of a row group: lane_max()/lane_sum() (subgroup shuffles over SHUFFLE_LANES
// lanes in the subgroup variant), then workgroup memory for the LANE_GROUPS groups left, or
// more shuffles where this dispatch's subgroups hold a whole row group (rows_reduce's wide).
// Prefix constants: Q_TILE, KV_TILE, K_STEP, STEPS (steps per unit), ROWS_PER_LANE, ROW_LANES,
// SHUFFLE_LANES, PREFETCH, STAGED, STAGED_KEYS (k_s / v_s rows: KV_TILE, or 1 when direct),
// O_SPLIT, OUT_UNIT, OUT_UNITS, LANE_UNITS, LANE_SLOTS, REG_SLOTS, WG_SLOTS, O_S_SIZE (o_s's
// length), SLICED, SLICE_LEVELS (log2 ROW_LANES where SLICED, else 0), KV_F32.

const LANE_KEYS: u32 = K_STEP / ROW_LANES;      // scores per lane and row in a step
const THREADS: u32 = (Q_TILE / ROWS_PER_LANE) * ROW_LANES;
const K_STRIDE: u32 = QK_VEC4S + 1u;            // padded K row stride: lanes read distinct banks
const LANE_GROUPS: u32 = ROW_LANES / SHUFFLE_LANES;     // lane groups left after the shuffles
// K and V granules each lane loads per tile
const K_LOADS: u32 = (KV_TILE * QK_GRANULES + THREADS - 1u) / THREADS;
const V_LOADS: u32 = (KV_TILE * V_GRANULES + THREADS - 1u) / THREADS;
const AHEAD: u32 = PREFETCH * STAGED;           // tiles in flight ahead of the compute
const O_REGS: u32 = max(REG_SLOTS, 1u);         // register accumulator vec4s per row

// SLICED (tiles.py's qk_layout "sliced", STAGED 1 only): where this dispatch's subgroups hold
// whole row groups, a row group's ROW_LANES lanes split the head dimension instead of the keys:
// lane tx holds vec4s tx, tx+ROW_LANES, ... (SLICE_VEC4S of them) of its rows' q in registers
// and dots them with every key of a step; each ROW_LANES keys' partial dots are then
// reduce-scattered over the row group by shuffles, so the lane ends with the whole scores of
// keys tx, tx+ROW_LANES, ..., the keys it owns in the other layout, and the softmax and PV go
// on as there. Each K
// vec4 read from workgroup memory then feeds 4 x ROWS_PER_LANE FMAs with no q read beside it,
// and the row groups of a subgroup are interleaved (lane_place) so that lanes n and n^1 read
// the same K or V address, which NVIDIA returns in half the cycles
// (bench/wgsl_scalar_prefill_probe.py; ci/results/h200_wgsl_sliced_prefill.txt).
// q then needs no workgroup memory (q_s shrinks to one entry). Where the subgroups are
// narrower than a row group, the lanes own keys as in the other layout and read q from memory.
// KV_F32 (kv_stage "f32"): K/V tiles are staged as f32 (k_s32, v_s32), converted once at
// staging instead of at every read.
// The sliced QK's loop bounds, 1 where SLICED is 0 (so the program builder's unrolled copies
// of a block that never runs stay small: lavapipe compiles every line)
const KEY_GROUPS: u32 = 1u + SLICED * (LANE_KEYS - 1u);       // groups of ROW_LANES keys a step
const SLICE_LANES: u32 = 1u + SLICED * (ROW_LANES - 1u);      // keys a group
const SLICE_VEC4S: u32 = 1u + SLICED * ((QK_VEC4S + ROW_LANES - 1u) / ROW_LANES - 1u);  // q vec4s a lane
// The tiles a build does not use hold one entry (tiles.prefill_storage counts them).
const Q_S_SIZE: u32 = select(Q_TILE * QK_VEC4S, 1u, SLICED == 1u);
const K_S_SIZE: u32 = select(STAGED_KEYS * K_STRIDE, 1u, KV_F32 == 1u);
const V_S_SIZE: u32 = select(STAGED_KEYS * V_VEC4S, 1u, KV_F32 == 1u);
const K_S32_SIZE: u32 = select(1u, STAGED_KEYS * K_STRIDE, KV_F32 == 1u);
const V_S32_SIZE: u32 = select(1u, STAGED_KEYS * V_VEC4S, KV_F32 == 1u);

var<workgroup> q_s: array<vec4<f32>, Q_S_SIZE>;
var<workgroup> k_s: array<TS, K_S_SIZE>;
var<workgroup> v_s: array<TS, V_S_SIZE>;
var<workgroup> k_s32: array<vec4<f32>, K_S32_SIZE>;
var<workgroup> v_s32: array<vec4<f32>, V_S32_SIZE>;
var<workgroup> p_s: array<f32, Q_TILE * K_STEP>;
var<workgroup> red_s: array<f32, Q_TILE * LANE_GROUPS>;
var<workgroup> o_s: array<vec4<f32>, O_S_SIZE>;

// Combine one value per row over the ROW_LANES lanes of a row group (max or sum). Called in
// uniform control flow by every invocation (it holds a barrier when LANE_GROUPS > 1 and not
// wide). wide: this dispatch's subgroups hold whole row groups (subgroup_lanes() >=
// ROW_LANES, uniform), so shuffles finish the job past SHUFFLE_LANES and workgroup memory is
// not needed (NVIDIA: 16 lanes a row group in 32-lane subgroups; Dawn on the H200, S=2048:
// 2108-2111 us against 2146-2150 held to SHUFFLE_LANES, h200_wgsl_scalar_prefill.txt).
// xs: the lane distance between tx and tx+1 (lane_place's; 1 unless SLICED's layout).
fn rows_reduce(x: array<f32, ROWS_PER_LANE>, ty: u32, tx: u32, is_max: bool, wide: bool,
               xs: u32) -> array<f32, ROWS_PER_LANE> {
  var r = x;
  if (wide) {
    for (var s = 1u; s < ROW_LANES; s = s << 1u) {
      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        let y = lane_xor(r[a], s * xs);
        r[a] = select(r[a] + y, max(r[a], y), is_max);
      }
    }
    return r;
  }
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    if (is_max) {
      r[a] = lane_max(r[a]);
    } else {
      r[a] = lane_sum(r[a]);
    }
  }
  if (LANE_GROUPS > 1u) {
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

// One granule of the register tile (as loaded) into workgroup memory: by value, never the
// register tile, for the reason given at decode_partial's stage_k.
fn stage_k(idx: u32, kr: RG) {
  if (idx < KV_TILE * QK_GRANULES) {
    let kg = granule_of(kr);
    let ks = tile_at(idx, K_STRIDE, QK_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
      if (KV_F32 == 1u) {
        k_s32[ks + s] = vec4<f32>(g_part(kg, s));
      } else {
        k_s[ks + s] = ts_part(kg, s);
      }
    }
  }
}

fn stage_v(idx: u32, vr: RG) {
  if (idx < KV_TILE * V_GRANULES) {
    let vg = granule_of(vr);
    let vs = tile_at(idx, V_VEC4S, V_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
      if (KV_F32 == 1u) {
        v_s32[vs + s] = vec4<f32>(g_part(vg, s));
      } else {
        v_s[vs + s] = ts_part(vg, s);
      }
    }
  }
}

// The weight of step key jj for local row r: from p_s, or (shuffled, SLICED) from the lane of
// r's row group that owns key jj (lane0 + (jj % ROW_LANES) * xs), which holds it in its
// ws[jj / ROW_LANES]. shuffled is uniform, and so is jj: call in uniform control flow.
fn step_weight(ws: array<f32, LANE_KEYS>, r: u32, jj: u32, shuffled: bool, lane0: u32,
               xs: u32) -> f32 {
  if (!shuffled) {
    return p_s[r * K_STEP + jj];
  }
  var mine = 0.0;
  for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
    mine = select(mine, ws[e], jj / ROW_LANES == e);
  }
  return lane_shuffle(mine, lane0 + (jj % ROW_LANES) * xs);
}

// vec4 c of query row i of head h, batch b, scaled (SLICED reads q straight from memory).
fn q_vec(b: u32, h: u32, i: u32, c: u32) -> vec4<f32> {
  let gv = load_q(q_granule(b, h, i) + c / GRANULE_VEC4S);
  return vec4<f32>(g_part(gv, c % GRANULE_VEC4S)) * P.scale;
}

// Staged K vec4 i (K_STRIDE rows) and V vec4 i (V_VEC4S rows) as f32, from the tile KV_F32 picks.
fn k_at(i: u32) -> vec4<f32> {
  if (KV_F32 == 1u) {
    return k_s32[i];
  }
  return ts_f32(k_s[i]);
}

fn v_at(i: u32) -> vec4<f32> {
  if (KV_F32 == 1u) {
    return v_s32[i];
  }
  return ts_f32(v_s[i]);
}

// (row group, lane in it, lane distance between tx and tx+1) of invocation lid. SLICED where
// wide: the RGW = sg / ROW_LANES row groups of a subgroup interleaved, lane = tx * RGW + group,
// so lanes n and n^1 (same tx, other rows) read the same staged K/V address; otherwise
// consecutive lanes. Lanes of a subgroup are taken to be consecutive invocations, as
// rows_reduce's shuffles take them.
fn lane_place(lid: u32, sg: u32, wide: bool) -> vec3<u32> {
  if (SLICED == 1u && wide) {
    let rgw = sg / ROW_LANES;
    return vec3<u32>((lid / sg) * rgw + lid % rgw, (lid % sg) / rgw, rgw);
  }
  return vec3<u32>(lid / ROW_LANES, lid % ROW_LANES, 1u);
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
        vv[c] = v_at((st * K_STEP + jj) * V_VEC4S + un);
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
    vv[c] = v_at((st * K_STEP + jj) * V_VEC4S + tx + ROW_LANES * c);
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
