// decode_pv: the second kernel of the unfused split-KV decode. For one KV split it turns the
// scores of decode_qk into probabilities with the split's statistics (p = exp(s - m)), sums p *
// v over the split's visible keys and normalises by l: the contract's partial state o_t, lse_t
// = m + log(l) (o_t = 0, lse_t = -inf for a split with no visible key), which the reduce
// merges. One workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of
// GROUP_TILE query heads): the VECTORS = GROUP_TILE*M_TILE query vectors read each V tile once
// from workgroup memory. A score is read only where its key is visible to the row (decode_qk
// wrote exactly those), and V never past the valid length. PV as in decode_partial: STREAMS
// streams x PV_LANES lanes, a lane owning LANE_COLS vec4 columns for all VECTORS vectors; the
// streams meet in workgroup memory at the end. Of attn_common's inputs only v and the per-batch
// lengths are read here. v's rows, and so the partial states', are V_DIM elements (V_VEC4S
// vec4s, V_GRANULES granules). Prefix constants: M_TILE, GROUP_TILE, KV_TILE (keys per tile),
// THREADS (threads), PREFETCH.

const VECTORS: u32 = GROUP_TILE * M_TILE;
const PV_LANES: u32 = min(THREADS, V_VEC4S);             // PV lanes across the head
const STREAMS: u32 = THREADS / PV_LANES;                 // PV streams
const LANE_COLS: u32 = (V_VEC4S + PV_LANES - 1u) / PV_LANES;   // vec4 columns per PV lane
const LANE_ELEMS: u32 = (KV_TILE * VECTORS + THREADS - 1u) / THREADS;  // (key, vector) elements per lane
const V_LOADS: u32 = (KV_TILE * V_GRANULES + THREADS - 1u) / THREADS; // V granules each lane loads per tile

var<workgroup> v_s: array<TS, KV_TILE * V_VEC4S>;
var<workgroup> p_s: array<f32, KV_TILE * VECTORS>;          // [key][vector] probabilities
var<workgroup> st_s: array<vec2<f32>, VECTORS>;        // (m, l) of each vector's split
var<workgroup> acc_s: array<vec4<f32>, VECTORS * V_VEC4S>;  // the streams' sums meet here

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_kv.
fn stage_v(idx: u32, vg: GV) {
  if (idx < KV_TILE * V_GRANULES) {
    let at = tile_at(idx, V_VEC4S, V_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      v_s[at + s] = ts_part(vg, s);
    }
  }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M_TILE, GROUP_TILE);
  if (!d.ok) {
    return;
  }

  if (lid < VECTORS) {
    let gh = d.hc * GROUP_TILE + lid / M_TILE;
    let i = d.i0 + lid % M_TILE;
    var st = vec2<f32>(MASKED, 0.0);
    if (gh < P.group_size && i < P.seq_len) {
      st = stats[((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t];
    }
    st_s[lid] = st;
  }

  let sl = lid / PV_LANES;                     // PV stream and column lane
  let cl = lid % PV_LANES;
  var o: array<array<vec4<f32>, LANE_COLS>, VECTORS>;
  for (var r = 0u; r < VECTORS; r++) {
    for (var u = 0u; u < LANE_COLS; u++) {
      o[r][u] = vec4<f32>(0.0);
    }
  }

  let n_tiles = select(0u, cdiv(d.khi - d.klo, KV_TILE), d.khi > d.klo);
  var vr: array<GV, V_LOADS>;
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
      vr[u] = GV();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < KV_TILE * V_GRANULES && jf + idx / V_GRANULES < d.khi) {
        vr[u] = load_v(v_granule(d.b, d.kvh, jf + idx / V_GRANULES) + idx % V_GRANULES);
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

    // p = exp(s - m) for every (key, vector) the vector can see; 0 elsewhere (unread).
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

    // A tile on the causal diagonal or the window's edge of the row tile adds only the keys
    // each row sees (their weights of 0 must not meet the others' values).
    // M_TILE == 1: the rows share one position, so no tile has an edge (the branch folds away)
    let full = M_TILE == 1u || all_see(j0, j0 + KV_TILE, vec2<i32>(i32(d.klo), i32(d.khi)), d.seen_all);
    if (sl < STREAMS && full) {
      for (var n = 0u; n < (KV_TILE + STREAMS - 1u) / STREAMS; n++) {
        let jj = sl + STREAMS * n;
        if (jj < KV_TILE) {
          let vv = tile_values(jj, cl);
          for (var r = 0u; r < VECTORS; r++) {
            let p = p_s[jj * VECTORS + r];
            for (var u = 0u; u < LANE_COLS; u++) {
              o[r][u] += p * vv[u];
            }
          }
        }
      }
    } else if (sl < STREAMS) {
      for (var n = 0u; n < (KV_TILE + STREAMS - 1u) / STREAMS; n++) {
        let jj = sl + STREAMS * n;
        if (jj < KV_TILE) {
          let vv = tile_values(jj, cl);
          for (var r = 0u; r < VECTORS; r++) {
            let p = p_s[jj * VECTORS + r];
            if (key_visible(i32(j0 + jj), row_pos(d.seq, d.i0 + r % M_TILE), d.seq)) {
              for (var u = 0u; u < LANE_COLS; u++) {
                o[r][u] += p * vv[u];
              }
            }
          }
        }
      }
    }
  }

  // Streams add up in workgroup memory, then each sum is normalised by the split's l.
  workgroupBarrier();
  for (var s = 0u; s < STREAMS; s++) {
    if (sl == s) {
      for (var r = 0u; r < VECTORS; r++) {
        for (var u = 0u; u < LANE_COLS; u++) {
          let c = cl + PV_LANES * u;
          if (c < V_VEC4S) {
            acc_s[r * V_VEC4S + c] = select(acc_s[r * V_VEC4S + c] + o[r][u], o[r][u], s == 0u);
          }
        }
      }
    }
    workgroupBarrier();
  }

  for (var u = 0u; u < (VECTORS * V_VEC4S + THREADS - 1u) / THREADS; u++) {
    let e = lid + u * THREADS;
    if (e < VECTORS * V_VEC4S) {
      let r = e / V_VEC4S;
      let c = e % V_VEC4S;
      let gh = d.hc * GROUP_TILE + r / M_TILE;
      let i = d.i0 + r % M_TILE;
      if (gh < P.group_size && i < P.seq_len) {
        let st = st_s[r];
        let fin = finish_row(st.x, st.y, MASKED);
        let row = ((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t;
        o_parts[row * V_VEC4S + c] = finite_or_nan4(acc_s[e] * fin.x);
        if (c == 0u) {
          lse_parts[row] = fin.y;
        }
      }
    }
  }
}
