// What both forms of the matrix prefill share (flash_prefill_mma: Q, K and V staged one f16 at
// a time; flash_prefill_mma_direct: Q read straight from storage, K and V staged in 16-byte
// granules): their workgroup memory but q_s, where a lane works, its logits, the non-finite v
// slow path, the row's closing factor and lse, and the output written tile by tile through
// the subgroup's O scratch. The softmax lanes: lane (row rr, half hf) of a subgroup, 2 lanes
// a row (ROW_LANES), each with half of the row's scores and every other 16-column output tile.

var<workgroup> k_s: array<f16, KV_TILE * K_STRIDE>;
var<workgroup> v_s: array<f16, KV_TILE * V_STRIDE>;
var<workgroup> s_s: array<f32, Q_TILE * S_STRIDE>;
var<workgroup> p_s: array<f16, Q_TILE * P_STRIDE>;
var<workgroup> red_s: array<f32, Q_TILE * ROW_LANES>;
var<workgroup> alpha_s: array<f32, Q_TILE>;

// Where subgroup sg's 16 x 16 O scratch lies in s_s (mm_store_x / mm_load_x): its own 16 rows
// of scores (S_STRIDE >= 16), dead from its softmax's last read to its next QK store (the
// scratch is used between take_flags' barrier and the next tile, and after the loop). The
// 8 KB a separate array took at q_tile 128 are what let 128 rows fit 48 KiB: 835.8-847.9 us
// against 1413.3-1422.5 at q_tile 64 (S=2048, H200, h200_wgsl_mma_prefill_branches.txt).
// (An earlier build sharing s_s at sg * 256, other subgroups' rows, gave wrong products on
// the H100; this placement was right on the H200.)
fn x_at(sg: u32) -> u32 {
  return sg * 16u * S_STRIDE;
}

// vbad with the bits of the output columns of this lane's row (its half's column tiles c =
// hf, hf+2, ..) set where a key of the tile j0.. that the row sees has a non-finite v: the
// slow path of a tile that raised flag 2.
fn mark_bad_v(bad: array<u32, MASK_WORDS>, w: PrefillWg, j0: u32, lo: u32, hi: u32, pos: i32,
              hf: u32) -> array<u32, MASK_WORDS> {
  var vbad = bad;
  for (var jl = 0u; jl < KV_TILE; jl++) {
    let j = j0 + jl;
    if (j >= lo && j < hi && key_visible(i32(j), pos, w.seq)) {
      for (var c = hf; c < OUT_TILES; c += 2u) {
        for (var d = 0u; d < 16u; d++) {
          if (is_bad_f16(v_elem(w.b, w.kvh, j, c * 16u + d))) {
            let bit = (c / 2u) * 16u + d;
            vbad[bit / 32u] |= 1u << (bit % 32u);
          }
        }
      }
    }
  }
  return vbad;
}

// The row's factor (alpha_s[rr]) and lse from the sum over both halves (called by every
// lane).
fn finish_lane_row(ml: vec2<f32>, w: PrefillWg, rr: u32, hf: u32, i: u32) {
  workgroupBarrier();
  red_s[rr * ROW_LANES + hf] = ml.y;
  workgroupBarrier();
  let fin = finish_row(ml.x, red_s[rr * ROW_LANES] + red_s[rr * ROW_LANES + 1u],
                       row_sink(w.h, w.seq, i));
  if (hf == 0u) {
    alpha_s[rr] = fin.x;
    if (P.return_lse != 0u && i < P.seq_len) {
      lse[(w.b * P.num_heads + w.h) * P.seq_len + i] = fin.y;
    }
  }
}

// Output column tile c through the subgroup's O scratch: written by the lanes of half c % 2 (row
// rr), times the row's factor (alpha_s), NaN where vbad says a non-finite v was seen; base:
// the row's first out vec4. Called by every lane.
fn write_tile(acc: MAcc, c: u32, vbad: array<u32, MASK_WORDS>, base: u32, rr: u32, hf: u32,
              sg: u32, lane: u32, live: bool) {
  let xo = x_at(sg);
  mm_store_x(acc, xo);
  workgroupBarrier();
  if (c % 2u == hf && live) {
    for (var u = 0u; u < 4u; u++) {
      var o4 = vec4<f32>(0.0);
      for (var e = 0u; e < 4u; e++) {
        o4[e] = s_s[xo + (lane % 16u) * 16u + u * 4u + e] * alpha_s[rr];
        let bit = (c / 2u) * 16u + u * 4u + e;
        if ((vbad[bit / 32u] & (1u << (bit % 32u))) != 0u) {
          o4[e] = nan_f32();
        }
      }
      store_out(base + c * 4u + u, finite_or_nan4(o4));
    }
  }
  workgroupBarrier();
}

// Where a lane works: its row in the workgroup (rr: softmax, output), which half of the row's
// scores and output column tiles (hf), the query row i and its position, and the rotation of
// its walk over its scores (rot: lane_logits). (The workgroup's
// key span stays out of it: a struct holding a lane's values is not uniform to WGSL's
// analysis, and the key loop's bounds must be.)
struct LanePlace {
  rr: u32,
  hf: u32,
  i: u32,
  pos: i32,
  rot: u32,
}

// rot = (lane's row in its subgroup / ROT_DIV + hf * ROT_HF) % LANE_KEYS, the prefix's
// constants chosen by backends/webgpu/mma.py for these strides so that the 32 lanes' reads of
// s_s (and writes of p_s) at one step fall in distinct banks where they can: without it
// the lanes of rows r and r + 8 (and of the other half) share banks, 4-way (S_STRIDE = KV_TILE
// + 4) to 16-way (unpadded) conflicts on every score.
fn lane_place(w: PrefillWg, sg: u32, lane: u32) -> LanePlace {
  let rr = sg * 16u + lane % 16u;
  let i = w.i0 + rr;
  let rot = ((lane % 16u) / ROT_DIV + (lane / 16u) * ROT_HF) % LANE_KEYS;
  return LanePlace(rr, lane / 16u, i, row_pos(w.seq, i), rot);
}

// The logits of this lane's half of its row for the tile of keys j0.. (mma_common.wgsl).
fn place_logits(at: LanePlace, j0: u32, hi: u32, w: PrefillWg) -> array<f32, LANE_KEYS> {
  return lane_logits(at.rr, at.hf, j0, hi, at.i < P.seq_len, w.b, w.h, at.i, at.pos, w.seq,
                     at.rot);
}
