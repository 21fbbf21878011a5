// decode_mma: split-KV decode partials whose two products run on matrix units, through the mm_*
// primitive (mma_hw.wgsl: subgroup matrices; mma_emu.wgsl: the same contract in software). One
// workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of GROUP_TILE query
// heads): its VECTORS = GROUP_TILE * M_TILE <= 16 query vectors are the 16 rows of one matrix
// tile (row r: head hc*GROUP_TILE + r/M_TILE of the group, query row i0 + r%M_TILE; rows past
// VECTORS are zero). Per tile of KV_TILE keys of the split, staged in workgroup memory by every
// lane (mma_common.wgsl):
//   S = Q K^T: subgroup g takes key tiles g, g+SUBGROUPS, .. (DEPTH_TILES products each) -> s_s;
//   softmax in scalar code (mma_common.wgsl): lane (row lid%16, part lid/16) takes LANE_KEYS of
//     the row's scores, applies the logit (attn_common.wgsl) and masks, writes P = exp(x - m)
//     as f16 to p_s;
//   O += P V: subgroup g owns output column tiles g, g+SUBGROUPS, .. (SG_TILES of them) in
//     registers.
// The running max is lazy, as in flash_prefill_mma. Non-finite v: staged as 0 and flagged; a
// slow path marks, per lane, the output columns of its row that see it. Writes the contract's
// partial state of the split: o_t normalised over the split's visible keys and lse_t (0 and
// -inf for a split with no visible key).
// Prefix constants: M_TILE, GROUP_TILE, KV_TILE, SUBGROUPS, THREADS (32 SUBGROUPS), DEPTH_TILES
// (QK_DIM/16: QK's depth tiles), OUT_TILES (V_DIM/16: output column tiles), KEY_TILES
// (KV_TILE/16), SG_TILES (OUT_TILES/SUBGROUPS), ROW_LANES (THREADS/16), LANE_KEYS
// (KV_TILE/ROW_LANES), Q_STRIDE, K_STRIDE, V_STRIDE, S_STRIDE, P_STRIDE, MASK_WORDS (words of a
// lane's column mask).

const VECTORS: u32 = GROUP_TILE * M_TILE;

var<workgroup> q_s: array<f16, 16u * Q_STRIDE>;
var<workgroup> k_s: array<f16, KV_TILE * K_STRIDE>;
var<workgroup> v_s: array<f16, KV_TILE * V_STRIDE>;
// The scores, then each subgroup's 16 x 16 O scratch (x_at: past the scores, so it shares
// nothing live; mma_hw's and mma_emu's scratch functions take s_s).
var<workgroup> s_s: array<f32, 16u * S_STRIDE + SUBGROUPS * 256u>;
var<workgroup> p_s: array<f16, 16u * P_STRIDE>;
var<workgroup> red_s: array<f32, 16u * ROW_LANES>;
var<workgroup> alpha_s: array<f32, 16u>;

// (query head of the group, query row) of matrix-tile row r; x past the group or y past
// seq_len for rows no query fills.
fn tile_row(hc: u32, i0: u32, r: u32) -> vec2<u32> {
  if (r >= VECTORS) {
    return vec2<u32>(P.group_size, P.seq_len);
  }
  return vec2<u32>(hc * GROUP_TILE + r / M_TILE, i0 + r % M_TILE);
}

// vbad with the bits of the output columns this lane writes (8 of each of its subgroup's
// tiles) set where a key of the tile j0.. that its row sees has a non-finite v: the slow path
// of a tile that raised flag 2.
fn mark_bad_v(bad: array<u32, MASK_WORDS>, d: DecodeWg, j0: u32, hi: u32, pos: i32, sg: u32,
              hf: u32) -> array<u32, MASK_WORDS> {
  var vbad = bad;
  for (var jl = 0u; jl < KV_TILE; jl++) {
    let j = j0 + jl;
    if (j < hi && key_visible(i32(j), pos, d.seq)) {
      for (var t = 0u; t < SG_TILES; t++) {
        for (var c = 0u; c < 8u; c++) {
          if (is_bad_f16(v_elem(d.b, d.kvh, j, (sg + t * SUBGROUPS) * 16u + hf * 8u + c))) {
            let bit = t * 8u + c;
            vbad[bit / 32u] |= 1u << (bit % 32u);
          }
        }
      }
    }
  }
  return vbad;
}

// The Q tile: its rows (tile_row) from q, absent and padding rows zero.
fn stage_queries(d: DecodeWg, lid: u32) {
  for (var idx = lid; idx < 16u * QK_GRANULES; idx += THREADS) {
    let r = idx / QK_GRANULES;
    let qr = tile_row(d.hc, d.i0, r);
    stage_q_granule(r, idx % QK_GRANULES, q_granule(d.b, d.kvh * P.group_size + qr.x, qr.y),
                    qr.x < P.group_size && qr.y < d.seq.rows);
  }
}

// Row rr's maximum logit of the tile, over its lanes' maxima (red_s).
fn row_max(rr: u32) -> f32 {
  var m_tile = MASKED;
  for (var p = 0u; p < ROW_LANES; p++) {
    m_tile = max(m_tile, red_s[rr * ROW_LANES + p]);
  }
  return m_tile;
}

// The row's factor (alpha_s[rr]) and lse_t (lse_parts[row], where live) from its lanes'
// parts of the sum; no sink: the reduce adds it. Called by every lane.
fn finish_lane_row(ml: vec2<f32>, rr: u32, part: u32, row: u32, live: bool) {
  workgroupBarrier();
  red_s[rr * ROW_LANES + part] = ml.y;
  workgroupBarrier();
  var lsum = 0.0;
  for (var p = 0u; p < ROW_LANES; p++) {
    lsum += red_s[rr * ROW_LANES + p];
  }
  let fin = finish_row(ml.x, lsum, MASKED);
  if (part == 0u) {
    alpha_s[rr] = fin.x;
    if (live) {
      lse_parts[row] = fin.y;
    }
  }
}

// Where subgroup sg's O scratch lies in s_s.
fn x_at(sg: u32) -> u32 {
  return 16u * S_STRIDE + sg * 256u;
}

// Output tile t (column tile sg + t * SUBGROUPS) of o_t through the subgroup's scratch: lane
// (row rr, hf) writes 8 of its columns, times the row's factor (alpha_s), NaN where vbad says
// a non-finite v was seen. Called by every lane.
fn write_tile(acc: MAcc, t: u32, vbad: array<u32, MASK_WORDS>, row: u32, rr: u32, hf: u32,
              sg: u32, live: bool) {
  let xo = x_at(sg);
  mm_store_x(acc, xo);
  workgroupBarrier();
  if (live) {
    for (var u = 0u; u < 2u; u++) {
      var o4 = vec4<f32>(0.0);
      for (var e = 0u; e < 4u; e++) {
        o4[e] = s_s[xo + rr * 16u + hf * 8u + u * 4u + e] * alpha_s[rr];
        let bit = t * 8u + u * 4u + e;
        if ((vbad[bit / 32u] & (1u << (bit % 32u))) != 0u) {
          o4[e] = nan_f32();
        }
      }
      o_parts[row * V_VEC4S + (sg + t * SUBGROUPS) * 4u + hf * 2u + u] = finite_or_nan4(o4);
    }
  }
  workgroupBarrier();
}

fn kernel_body(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, sg: u32, lane: u32) {
  let d = decode_wg(wid, nwg, M_TILE, GROUP_TILE);
  if (!d.ok) {
    return;
  }
  let rr = lid % 16u;                  // this lane's row (softmax, output)
  let part = lid / 16u;                // which LANE_KEYS scores of the row
  let hf = lane / 16u;                 // which 8 columns of its subgroup's tiles it writes
  let ri = tile_row(d.hc, d.i0, rr);
  let live = ri.x < P.group_size && ri.y < P.seq_len;
  let h = d.kvh * P.group_size + ri.x;
  let i = ri.y;
  let pos = row_pos(d.seq, i);
  let lo = d.klo;
  let hi = d.khi;

  stage_queries(d, lid);

  var o: array<MAcc, SG_TILES>;
  for (var t = 0u; t < SG_TILES; t++) {
    o[t] = mm_zero();
  }
  var ml = vec2<f32>(MASKED, 0.0);     // the row's max, this lane's part of its sum
  var vbad: array<u32, MASK_WORDS>;    // output columns of this lane poisoned by a v (zeros)

  if (lid == 0u) {
    atomicStore(&flag_a[0], 0u);        // as in flash_prefill_mma: before stage_tiles' barrier
  }
  let n_tiles = select(0u, cdiv(hi - lo, KV_TILE), hi > lo);
  for (var it = 0u; it < n_tiles; it++) {
    let j0 = lo + it * KV_TILE;
    stage_tiles(d.b, d.kvh, j0, 0u, hi, lid);   // the tiles start at lo

    // S = Q K^T: this subgroup's key tiles. Both bounds are read at run time (they equal KEY_TILES
    // / SUBGROUPS and DEPTH_TILES): with constant bounds, head_size 32 (DEPTH_TILES 2) gave wrong
    // products on the H100 (43 of 52 cells failed; all pass with these bounds), like the PV loop
    // below.
    for (var u = 0u; u < min(KEY_TILES / SUBGROUPS, P.seq_len + KEY_TILES / SUBGROUPS); u++) {
      let kc = sg + u * SUBGROUPS;
      var acc = mm_zero();
      for (var dc = 0u; dc < min(DEPTH_TILES, P.seq_len + DEPTH_TILES); dc++) {
        acc = mm_qk(acc, dc * 16u, kc * 16u * K_STRIDE + dc * 16u);
      }
      mm_store_s(acc, kc * 16u);
    }
    workgroupBarrier();

    // The softmax of this lane's part of the row.
    let x = lane_logits(rr, part, j0, hi, live, d.b, h, i, pos, d.seq, 0u);
    workgroupBarrier();
    ml = lane_weights(x, ml, row_max(rr), rr * P_STRIDE + part * LANE_KEYS, rr, part, 0u);
    let flags = take_flags(lid, 0u);

    if ((flags & 1u) != 0u) {
      // Some row's reference max moved: O rows *= alpha, tile by tile through the O scratch (x_at).
      for (var t = 0u; t < SG_TILES; t++) {
        o[t] = rescaled(o[t], sg, lane, 0u);
      }
    }
    if ((flags & 2u) != 0u && live) {
      vbad = mark_bad_v(vbad, d, j0, hi, pos, sg, hf);
    }

    // O += P V on this subgroup's column tiles. The bound is read at run time (it equals
    // SG_TILES), as in flash_prefill_mma: fully unrolled short chains gave wrong products on the
    // H100 (Dawn/Tint + NVIDIA's Vulkan driver).
    for (var t = 0u; t < min(SG_TILES, P.seq_len + SG_TILES); t++) {
      var acc = o[t];
      for (var kc = 0u; kc < KEY_TILES; kc++) {
        acc = mm_pv(acc, kc * 16u, kc * 16u * V_STRIDE + (sg + t * SUBGROUPS) * 16u);
      }
      o[t] = acc;
    }
  }

  let row = ((d.b * P.num_heads + h) * P.seq_len + i) * P.n_splits + d.t;
  finish_lane_row(ml, rr, part, row, live);
  // o_t, tile by tile through the O scratch (x_at).
  for (var t = 0u; t < SG_TILES; t++) {
    write_tile(o[t], t, vbad, row, rr, hf, sg, live);
  }
}
