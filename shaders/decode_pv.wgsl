// decode_pv: the second kernel of the unfused split-KV decode. For one KV split it turns the
// scores of decode_qk into probabilities with the split's statistics (p = exp(s - m)), sums
// p * v over the split's visible keys and normalises by l: the contract's partial state
// o_t, lse_t = m + log(l) (o_t = 0, lse_t = -inf for a split with no visible key), which
// the reduce merges.
// One workgroup = one (batch, kv head, split, tile of M query rows, chunk of GT query heads):
// the R = GT*M query vectors read each V tile once from workgroup memory. A score is read
// only where its key is visible to the row (decode_qk wrote exactly those), and V never past
// the valid length. PV as in decode_partial: NS streams x PVW lanes, a lane owning CPL vec4
// columns for all R vectors; the streams meet in workgroup memory at the end.
// Of attn_common's inputs only v and the per-batch lengths are read here. v's rows, and so
// the partial states', are VD elements (VV vec4s, VG granules).
// Prefix constants: M, GT, BC (keys per tile), WG (threads), PREFETCH.

const R: u32 = GT * M;
const PVW: u32 = min(WG, VV);             // PV lanes across the head
const NS: u32 = WG / PVW;                 // PV streams
const CPL: u32 = (VV + PVW - 1u) / PVW;   // vec4 columns per PV lane
const NE: u32 = (BC * R + WG - 1u) / WG;  // (key, vector) elements per lane
const NLD: u32 = (BC * VG + WG - 1u) / WG; // V granules each lane loads per tile

var<workgroup> v_s: array<TS, BC * VV>;
var<workgroup> p_s: array<f32, BC * R>;          // [key][vector] probabilities
var<workgroup> st_s: array<vec2<f32>, R>;        // (m, l) of each vector's split
var<workgroup> acc_s: array<vec4<f32>, R * VV>;  // the streams' sums meet here

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_kv.
fn stage_v(idx: u32, vg: GV) {
  if (idx < BC * VG) {
    let at = tile_at(idx, VV, VG);
    for (var s = 0u; s < GS; s++) {
      v_s[at + s] = ts_part(vg, s);
    }
  }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M, GT);
  if (!d.ok) {
    return;
  }

  if (lid < R) {
    let gh = d.hc * GT + lid / M;
    let i = d.i0 + lid % M;
    var st = vec2<f32>(MASKED, 0.0);
    if (gh < P.group_size && i < P.seq_len) {
      st = stats[((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t];
    }
    st_s[lid] = st;
  }

  let sl = lid / PVW;                     // PV stream and column lane
  let cl = lid % PVW;
  var o: array<array<vec4<f32>, CPL>, R>;
  for (var r = 0u; r < R; r++) {
    for (var u = 0u; u < CPL; u++) {
      o[r][u] = vec4<f32>(0.0);
    }
  }

  let n_tiles = select(0u, cdiv(d.khi - d.klo, BC), d.khi > d.klo);
  var vr: array<GV, NLD>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with v_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_v(lid + u * WG, vr[u]);
      }
      workgroupBarrier();
    }
    let jf = d.klo + it * BC;
    for (var u = 0u; u < NLD; u++) {
      let idx = lid + u * WG;
      vr[u] = GV();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < BC * VG && jf + idx / VG < d.khi) {
        vr[u] = load_v(v_granule(d.b, d.kvh, jf + idx / VG) + idx % VG);
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with v_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_v(lid + u * WG, vr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = d.klo + (it - PREFETCH) * BC;

    // p = exp(s - m) for every (key, vector) the vector can see; 0 elsewhere (unread).
    for (var u = 0u; u < NE; u++) {
      let e = lid + u * WG;
      if (e < BC * R) {
        let r = e % R;
        let j = j0 + e / R;
        let gh = d.hc * GT + r / M;
        let i = d.i0 + r % M;
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
    // M == 1: the rows share one position, so no tile has an edge (the branch folds away)
    let full = M == 1u || all_see(j0, j0 + BC, vec2<i32>(i32(d.klo), i32(d.khi)), d.seen_all);
    if (sl < NS && full) {
      for (var n = 0u; n < (BC + NS - 1u) / NS; n++) {
        let jj = sl + NS * n;
        if (jj < BC) {
          let vv = tile_values(jj, cl);
          for (var r = 0u; r < R; r++) {
            let p = p_s[jj * R + r];
            for (var u = 0u; u < CPL; u++) {
              o[r][u] += p * vv[u];
            }
          }
        }
      }
    } else if (sl < NS) {
      for (var n = 0u; n < (BC + NS - 1u) / NS; n++) {
        let jj = sl + NS * n;
        if (jj < BC) {
          let vv = tile_values(jj, cl);
          for (var r = 0u; r < R; r++) {
            let p = p_s[jj * R + r];
            if (key_visible(i32(j0 + jj), row_pos(d.seq, d.i0 + r % M), d.seq)) {
              for (var u = 0u; u < CPL; u++) {
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
  for (var s = 0u; s < NS; s++) {
    if (sl == s) {
      for (var r = 0u; r < R; r++) {
        for (var u = 0u; u < CPL; u++) {
          let c = cl + PVW * u;
          if (c < VV) {
            acc_s[r * VV + c] = select(acc_s[r * VV + c] + o[r][u], o[r][u], s == 0u);
          }
        }
      }
    }
    workgroupBarrier();
  }

  for (var u = 0u; u < (R * VV + WG - 1u) / WG; u++) {
    let e = lid + u * WG;
    if (e < R * VV) {
      let r = e / VV;
      let c = e % VV;
      let gh = d.hc * GT + r / M;
      let i = d.i0 + r % M;
      if (gh < P.group_size && i < P.seq_len) {
        let st = st_s[r];
        let fin = finish_row(st.x, st.y, MASKED);
        let row = ((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t;
        o_parts[row * VV + c] = finite_or_nan4(acc_s[e] * fin.x);
        if (c == 0u) {
          lse_parts[row] = fin.y;
        }
      }
    }
  }
}
