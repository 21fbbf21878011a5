// decode_pv: the second kernel of the unfused split-KV decode. For one KV split it turns the
// scores of decode_qk into probabilities with the split's statistics (p = exp(s - m)), sums
// p * v over the split's visible keys and normalises by l: the contract's partial state
// o_t, lse_t = m + log(l) (o_t = 0, lse_t = -inf for a split with no visible key), which
// the reduce merges.
// One workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of GROUP_TILE
// query heads): its query vectors (decode_common.wgsl) read each V tile once from workgroup
// memory. A score is read only where its key is visible to the row (decode_qk wrote exactly
// those), and V never past the valid length. PV as decode_partial's (decode_pv_common.wgsl):
// the streams meet in acc_s at the end.
// Of attn_common's inputs only v and the per-batch lengths are read here. v's rows, and so
// the partial states', are V_DIM elements (V_VEC4S vec4s, V_GRANULES granules).

const SUMS: u32 = 0u;                           // the sums are the split's statistics

var<workgroup> st_s: array<vec2<f32>, VECTORS>;             // (m, l) of each vector's split
var<workgroup> acc_s: array<vec4<f32>, VECTORS * V_VEC4S>;  // the streams' sums meet here

// Where decode_pv_common's streams meet (no sums: the split's l is in st_s).
fn merge_o(r: u32, c: u32, x: vec4<f32>, first: bool) {
  acc_s[r * V_VEC4S + c] = select(acc_s[r * V_VEC4S + c] + x, x, first);
}

fn merge_l(r: u32, x: f32, first: bool) {
}

fn merged_o(r: u32, c: u32) -> vec4<f32> {
  return acc_s[r * V_VEC4S + c];
}

fn merged_stats(r: u32) -> vec2<f32> {
  return st_s[r];
}

// The statistics (m, l) of the split for each query vector into st_s (MASKED, 0 for absent
// vectors).
fn load_stats(d: DecodeWg, lid: u32) {
  if (lid < VECTORS) {
    let gh = d.hc * GROUP_TILE + lid / M_TILE;
    let i = d.i0 + lid % M_TILE;
    var st = vec2<f32>(MASKED, 0.0);
    if (gh < P.group_size && i < P.seq_len) {
      let row = (d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i;
      st = stats[row * P.n_splits + d.t];
    }
    st_s[lid] = st;
  }
}

// p_s = exp(s - m) of the tile of keys j0.. for every (key, vector) the vector can see; 0
// elsewhere (its score is never read). Ends with p_s complete (a barrier).
fn tile_weights(d: DecodeWg, j0: u32, lid: u32) {
  for (var u = 0u; u < LANE_ELEMS; u++) {
    let e = lid + u * THREADS;
    if (e < KV_TILE * VECTORS) {
      let r = e % VECTORS;
      let j = j0 + e / VECTORS;
      let gh = d.hc * GROUP_TILE + r / M_TILE;
      let i = d.i0 + r % M_TILE;
      var p = 0.0;
      if (gh < P.group_size && i < P.seq_len && j < d.khi
          && key_visible(i32(j), row_pos(d.seq, i), d.seq)) {
        let m = st_s[r].x;
        let row = (d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i;
        p = weight_of(scores[row * P.capacity + j], select(m, 0.0, m <= MASKED));
      }
      p_s[e] = p;
    }
  }
  workgroupBarrier();
}

// The workgroup d's work (decode_common's main calls it).
fn decode_body(d: DecodeWg, lid: u32) {
  load_stats(d, lid);

  let sl = lid / PV_LANES;                     // PV stream and column lane
  let cl = lid % PV_LANES;
  var acc = Lanes();

  // Tile loop, software-pipelined as in decode_partial, its loads and staging written
  // out in the body as there.
  let n_tiles = select(0u, cdiv(d.khi - d.klo, KV_TILE), d.khi > d.klo);
  var vr: array<RG, V_LOADS>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with v_s/p_s
      for (var u = 0u; u < V_LOADS; u++) {
        stage_v(lid + u * THREADS, vr[u]);
      }
      workgroupBarrier();
    }
    let jf = d.klo + it * KV_TILE;
    for (var u = 0u; u < V_LOADS; u++) {
      let idx = lid + u * THREADS;
      vr[u] = RG();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < KV_TILE * V_GRANULES && jf + idx / V_GRANULES < d.khi) {
        vr[u] = raw_v(v_granule(d.b, d.kvh, jf + idx / V_GRANULES) + idx % V_GRANULES);
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with v_s/p_s
      for (var u = 0u; u < V_LOADS; u++) {
        stage_v(lid + u * THREADS, vr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = d.klo + (it - PREFETCH) * KV_TILE;
    tile_weights(d, j0, lid);
    let full = tile_full(d, j0, d.klo, d.khi);
    if (sl < STREAMS && full) {
      acc = pv_keys(acc, sl, cl, j0, true, d, array<VUnit, V_REGS>());
    } else if (sl < STREAMS) {
      acc = pv_keys(acc, sl, cl, j0, false, d, array<VUnit, V_REGS>());
    }
  }

  merge_streams(acc, sl, cl);
  write_partials(d, lid);
}
