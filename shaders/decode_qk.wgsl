// decode_qk: the first kernel of the unfused split-KV decode (FlashInfer's two-kernel form):
// QK^T over one KV split, written out as scores [B, Nq, S, C] float32 (the logits after
// softcap, bias and alibi; MASKED where a key is invisible), and the split's softmax
// statistics per query row: m = max logit, l = sum exp(s - m) (m = MASKED, l = 0 when the
// split has no visible key). decode_pv normalises and multiplies by V.
// One workgroup = one (batch, kv head, split, tile of M query rows, chunk of GT query
// heads), like decode_partial: the R = GT*M query vectors read each K tile once from
// workgroup memory; HS lanes per key each take a slice of the head (partial dots meet in
// workgroup memory when HS > 1). Scores are written for the keys [klo, khi) of the split
// that the row tile can see; decode_pv reads only keys visible to each row.
// Prefix constants: M, GT, BC (keys per tile), WG (threads), PREFETCH.

const R: u32 = GT * M;
const HS: u32 = max(1u, WG / BC);         // QK lanes per key
const KW: u32 = WG / HS;                  // keys per QK pass
const KPT: u32 = BC / min(BC, KW);        // QK passes per tile
const CH: u32 = (HV + HS - 1u) / HS;      // vec4 chunks per QK lane
const NE: u32 = (BC * R + WG - 1u) / WG;  // (key, vector) elements per lane
const KS: u32 = HV + 1u;                  // padded K row stride: lanes read distinct banks
const NLD: u32 = (BC * HG + WG - 1u) / WG; // K granules each lane loads per tile

var<workgroup> q_s: array<vec4<f32>, R * HV>;    // scaled queries
var<workgroup> k_s: array<TS, BC * KS>;
var<workgroup> p_s: array<f32, BC * R>;          // [key][vector] logits
var<workgroup> part_s: array<f32, BC * R * HS>;  // QK partial dots per head slice

struct Wg {
  b: u32,
  kvh: u32,
  hc: u32,
  i0: u32,
  seq: Seq,
  khi: u32,
}

// Row of query vector r in [B, Nq, S] order, or 0xffffffff when the vector is absent.
fn vec_row(w: Wg, r: u32) -> u32 {
  let gh = w.hc * GT + r / M;
  let i = w.i0 + r % M;
  if (gh < P.group_size && i < P.seq_len) {
    return (w.b * P.num_heads + w.kvh * P.group_size + gh) * P.seq_len + i;
  }
  return 0xffffffffu;
}

// Logit of query vector r against key j, or MASKED if j is invisible to it.
fn vec_logit(w: Wg, r: u32, j: u32, dot_qk: f32) -> f32 {
  let gh = w.hc * GT + r / M;
  let i = w.i0 + r % M;
  let pos = row_pos(w.seq, i);
  if (gh < P.group_size && i < P.seq_len && j < w.khi && key_visible(i32(j), pos, w.seq)) {
    return logit(dot_qk, w.b, w.kvh * P.group_size + gh, i, j, pos);
  }
  return MASKED;
}

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_kv.
fn stage_k(idx: u32, kg: GV) {
  if (idx < BC * HG) {
    let at = tile_at(idx, KS, HG);
    for (var s = 0u; s < GS; s++) {
      k_s[at + s] = ts_part(kg, s);
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
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, d.khi);

  // Query vector r is head hc*GT + r/M of the group, row i0 + r%M; absent ones load zeros.
  for (var u = 0u; u < (R * HG + WG - 1u) / WG; u++) {
    let idx = lid + u * WG;
    if (idx >= R * HG) {
      break;
    }
    let r = idx / HG;
    let g = idx % HG;
    let gh = d.hc * GT + r / M;
    let i = d.i0 + r % M;
    var gv = GV();
    if (gh < P.group_size && i < d.seq.rows) {     // padding rows' q is never read
      gv = load_q(q_granule(d.b, d.kvh * P.group_size + gh, i) + g);
    }
    for (var s = 0u; s < GS; s++) {
      q_s[r * HV + g * GS + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  workgroupBarrier();

  // Running statistics of vector lid (lanes lid < R), in private memory.
  var m_run = MASKED;
  var l_run = 0.0;

  // Tile loop, software-pipelined as in decode_partial (PREFETCH=1: store tile it-1, load
  // tile it, compute tile it-1).
  let n_tiles = select(0u, cdiv(d.khi - d.klo, BC), d.khi > d.klo);
  var kr: array<GV, NLD>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_k(lid + u * WG, kr[u]);
      }
      workgroupBarrier();
    }
    let jf = d.klo + it * BC;
    for (var u = 0u; u < NLD; u++) {
      let idx = lid + u * WG;
      kr[u] = GV();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < BC * HG && jf + idx / HG < d.khi) {
        kr[u] = load_k(kv_granule(d.b, d.kvh, jf + idx / HG) + idx % HG);
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_k(lid + u * WG, kr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = d.klo + (it - PREFETCH) * BC;

    // QK: lane (slice h, key jj); consecutive lanes take consecutive keys (distinct banks).
    let h = lid / min(BC, KW);
    for (var kk = 0u; kk < KPT; kk++) {
      let jj = lid % min(BC, KW) + KW * kk;
      var sc: array<f32, R>;
      for (var r = 0u; r < R; r++) {
        sc[r] = 0.0;
      }
      for (var cc = 0u; cc < CH; cc++) {
        let c = min(h * CH + cc, HV - 1u);
        let kc = select(vec4<f32>(0.0), ts_f32(k_s[jj * KS + c]), h * CH + cc < HV);
        for (var r = 0u; r < R; r++) {
          sc[r] += dot(q_s[r * HV + c], kc);
        }
      }
      for (var r = 0u; r < R; r++) {
        if (HS == 1u) {
          p_s[jj * R + r] = vec_logit(w, r, j0 + jj, sc[r]);
        } else {
          part_s[(jj * R + r) * HS + h] = sc[r];
        }
      }
    }
    workgroupBarrier();
    if (HS > 1u) {
      for (var u = 0u; u < NE; u++) {
        let e = lid + u * WG;
        if (e < BC * R) {
          var s = 0.0;
          for (var hh = 0u; hh < HS; hh++) {
            s += part_s[e * HS + hh];
          }
          p_s[e] = vec_logit(w, e % R, j0 + e / R, s);
        }
      }
      workgroupBarrier();
    }

    // Scores out, one lane per (key, vector) of the tile's keys below khi.
    for (var u = 0u; u < NE; u++) {
      let e = lid + u * WG;
      if (e < BC * R) {
        let row = vec_row(w, e % R);
        let j = j0 + e / R;
        if (row != 0xffffffffu && j < d.khi) {
          scores[row * P.capacity + j] = p_s[e];
        }
      }
    }
    // Statistics, one lane per query vector (online: rescale the sum to the new maximum).
    if (lid < R) {
      var mx = MASKED;
      for (var jj = 0u; jj < BC; jj++) {
        mx = max(mx, p_s[jj * R + lid]);
      }
      let m_new = max(m_run, mx);
      // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps the sum at 0.
      let m_use = select(m_new, 0.0, m_new <= MASKED);
      var lsum = l_run * exp(m_run - m_use);
      for (var jj = 0u; jj < BC; jj++) {
        lsum += weight_of(p_s[jj * R + lid], m_use);
      }
      m_run = m_new;
      l_run = lsum;
    }
  }

  if (lid < R) {
    let row = vec_row(w, lid);
    if (row != 0xffffffffu) {
      stats[row * P.n_splits + d.t] = vec2<f32>(m_run, l_run);
    }
  }
}
