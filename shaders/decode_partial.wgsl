// decode_partial: fused QK^T + online softmax + PV over one KV split (flash decoding).
// One workgroup = one (batch, kv head, split, tile of M query rows, chunk of GT query heads):
// the R = GT*M query vectors that share this kv head read each K/V tile once, from
// workgroup memory. Writes the contract's partial state of the split: o_t normalised over
// the split's visible keys and lse_t (0 and -inf for a split with no visible key).
//
// Per tile of BC keys, work is spread so that each value is converted and each exp taken once:
//   QK   HS lanes per key, each a slice of the head, all R query vectors (partial dots meet
//        in workgroup memory when HS > 1);
//   max  one lane per query vector finds the tile maximum and the rescale factor;
//   exp  one lane per (key, query vector);
//   PV   NS streams x PVW lanes: a lane owns CPL vec4 columns of the output for all R query
//        vectors and a stream takes every NS-th key; streams share the running maximum, so
//        their sums simply add up at the end.
// BLOCKS 1 (block_skip): tiles are the blocks of the masked-block list that the row tile's
// list keeps; with BAL 1 (op attention) the row's listed blocks are dealt out evenly over
// the splits instead of by key range (any partition of the keys reduces to the same
// result); with BAL 0 (op partial) a split keeps its key range, as the contract's partial
// states require. Blocks flagged all-zero skip the bias load.
// q and k rows are HD elements (HV vec4s, HG granules), v's and the output's VD (VV, VG).
// Prefix constants: M, GT, BC (keys per tile), WG (threads), PREFETCH, BAL.

const R: u32 = GT * M;
const HS: u32 = max(1u, WG / BC);         // QK lanes per key
const KW: u32 = WG / HS;                  // keys per QK pass
const KPT: u32 = BC / min(BC, KW);        // QK passes per tile
const CH: u32 = (HV + HS - 1u) / HS;      // vec4 chunks per QK lane
const PVW: u32 = min(WG, VV);             // PV lanes across v's head
const NS: u32 = WG / PVW;                 // PV streams
const CPL: u32 = (VV + PVW - 1u) / PVW;   // vec4 columns per PV lane
const NE: u32 = (BC * R + WG - 1u) / WG;  // (key, vector) elements per lane
const KS: u32 = HV + 1u;                  // padded K row stride: lanes read distinct banks
const NLD: u32 = (BC * HG + WG - 1u) / WG; // K granules each lane loads per tile
const NLV: u32 = (BC * VG + WG - 1u) / WG; // V granules each lane loads per tile
const QO: u32 = max(HV, VV);              // q_s row: a query, then a merged output

var<workgroup> q_s: array<vec4<f32>, R * QO>;    // scaled queries; the merged o at the end
var<workgroup> k_s: array<TS, BC * KS>;
var<workgroup> v_s: array<TS, BC * VV>;
var<workgroup> p_s: array<f32, BC * R>;          // [key][vector]: logits, then exp
var<workgroup> part_s: array<f32, BC * R * HS>;  // QK partial dots per head slice
var<workgroup> m_s: array<f32, R>;               // running maximum per vector
var<workgroup> mu_s: array<f32, R>;              // this tile's exp offset per vector
var<workgroup> al_s: array<f32, R>;              // this tile's rescale factor per vector
var<workgroup> l_s: array<f32, R>;               // merged denominators at the end

struct Wg {
  b: u32,
  kvh: u32,
  hc: u32,
  i0: u32,
  seq: Seq,
  klo: u32,
  khi: u32,
}

// Logit of query vector r against key j, or MASKED if j is invisible to it (or outside this
// split's keys). with_bias false: the tile's bias is known to be all 0.
fn vec_logit(w: Wg, r: u32, j: u32, dot_qk: f32, with_bias: bool) -> f32 {
  let gh = w.hc * GT + r / M;
  let i = w.i0 + r % M;
  let pos = row_pos(w.seq, i);
  if (gh < P.group_size && i < P.seq_len && j >= w.klo && j < w.khi
      && key_visible(i32(j), pos, w.seq)) {
    return logit_b(dot_qk, w.b, w.kvh * P.group_size + gh, i, j, pos, with_bias);
  }
  return MASKED;
}

// One granule of the register tile into workgroup memory, called from the unrolled loops of
// both pipeline orders. It takes the granule's values, never the register tile: a helper
// taking the tile by pointer made a driver keep it in local memory.
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

// (first key, bias needed) of tile it: consecutive tiles from klo, or listed blocks.
fn tile_of(it: u32, klo: u32, l_first: u32) -> vec2<u32> {
  if (BLOCKS == 1u) {
    let e = blk_entry(l_first + it);
    return vec2<u32>((e & 0x7fffffffu) * BC, 1u - (e >> 31u));
  }
  return vec2<u32>(klo + it * BC, 1u);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M, GT);
  if (!d.ok) {
    return;
  }
  var klo = d.klo;
  var khi = d.khi;
  var n_tiles = select(0u, cdiv(khi - klo, BC), khi > klo);
  var l_first = 0u;
  if (BLOCKS == 1u) {
    // GT is 1 when the bias differs per head, so one list row serves the workgroup.
    let row = blk_row(d.b, d.kvh * P.group_size + d.hc * GT, d.rt, d.n_rt);
    if (BAL == 1u) {
      klo = u32(d.span.x);
      khi = u32(d.span.y);
      let ls = blk_span(row, klo, khi, BC);
      let per = cdiv(ls.y - ls.x, P.n_splits);
      l_first = ls.x + min(d.t * per, ls.y - ls.x);
      n_tiles = ls.x + min((d.t + 1u) * per, ls.y - ls.x) - l_first;
    } else {
      let ls = blk_span(row, klo, khi, BC);
      l_first = ls.x;
      n_tiles = ls.y - ls.x;
    }
  }
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, klo, khi);

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
      q_s[r * QO + g * GS + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  if (lid < R) {
    m_s[lid] = MASKED;
  }

  let st = lid / PVW;                     // PV stream and column lane
  let cl = lid % PVW;
  var l: array<f32, R>;
  var o: array<array<vec4<f32>, CPL>, R>;
  for (var r = 0u; r < R; r++) {
    l[r] = 0.0;
    for (var u = 0u; u < CPL; u++) {
      o[r][u] = vec4<f32>(0.0);
    }
  }

  // Tile loop. With PREFETCH=1 it is software-pipelined: iteration it stores tile it-1
  // (already in registers) to workgroup memory, issues the loads of tile it, then computes
  // tile it-1, so the loads fly during the compute. PREFETCH=0: load, store, compute tile it.
  // The loads have a constant trip count (the compiler unrolls them and issues all before
  // the first use) and sit in main: a helper taking the register tile by pointer made a
  // driver keep it in local memory.
  var kr: array<GV, NLD>;
  var vr: array<GV, NLV>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/v_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_k(lid + u * WG, kr[u]);
      }
      for (var u = 0u; u < NLV; u++) {
        stage_v(lid + u * WG, vr[u]);
      }
      workgroupBarrier();
    }
    var jf = 0u;
    if (it < n_tiles) {
      jf = tile_of(it, klo, l_first).x;
    }
    for (var u = 0u; u < NLD; u++) {
      let idx = lid + u * WG;
      let jj = idx / HG;
      kr[u] = GV();
      if (VG == HG) {
        vr[u] = GV();
      }
      // only this split's keys, never past the valid length nor before kv_start
      if (idx < BC * HG && it < n_tiles && jf + jj >= klo && jf + jj < khi) {
        let at = kv_granule(d.b, d.kvh, jf + jj) + idx % HG;
        kr[u] = load_k(at);
        if (VG == HG) {                     // v's rows are k's: the same granules
          vr[u] = load_v(at);
        }
      }
    }
    if (VG != HG) {
      for (var u = 0u; u < NLV; u++) {
        let idx = lid + u * WG;
        let jj = idx / VG;
        vr[u] = GV();
        if (idx < BC * VG && it < n_tiles && jf + jj >= klo && jf + jj < khi) {
          vr[u] = load_v(v_granule(d.b, d.kvh, jf + jj) + idx % VG);
        }
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/v_s/p_s
      for (var u = 0u; u < NLD; u++) {
        stage_k(lid + u * WG, kr[u]);
      }
      for (var u = 0u; u < NLV; u++) {
        stage_v(lid + u * WG, vr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let cur = tile_of(it - PREFETCH, klo, l_first);
    let j0 = cur.x;
    let wb = cur.y == 1u;

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
          sc[r] += dot(q_s[r * QO + c], kc);
        }
      }
      for (var r = 0u; r < R; r++) {
        if (HS == 1u) {
          p_s[jj * R + r] = vec_logit(w, r, j0 + jj, sc[r], wb);
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
          p_s[e] = vec_logit(w, e % R, j0 + e / R, s, wb);
        }
      }
      workgroupBarrier();
    }

    // Tile maximum and rescale factor, one lane per query vector.
    if (lid < R) {
      var mx = MASKED;
      for (var jj = 0u; jj < BC; jj++) {
        mx = max(mx, p_s[jj * R + lid]);
      }
      let m_old = m_s[lid];
      let m_new = max(m_old, mx);
      // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
      let m_use = select(m_new, 0.0, m_new <= MASKED);
      m_s[lid] = m_new;
      mu_s[lid] = m_use;
      al_s[lid] = exp(m_old - m_use);
    }
    workgroupBarrier();
    for (var u = 0u; u < NE; u++) {
      let e = lid + u * WG;
      if (e < BC * R) {
        p_s[e] = weight_of(p_s[e], mu_s[e % R]);
      }
    }
    workgroupBarrier();

    // A tile on the causal diagonal or the window's edge of the row tile adds only the keys
    // each row sees (their weights of 0 must not meet the others' values).
    // M == 1: the rows share one position, so no tile has an edge (the branch folds away)
    let full = M == 1u || all_see(j0, j0 + BC, vec2<i32>(i32(klo), i32(khi)), d.seen_all);
    if (st < NS) {
      for (var r = 0u; r < R; r++) {
        let al = al_s[r];
        l[r] *= al;
        for (var u = 0u; u < CPL; u++) {
          o[r][u] *= al;
        }
      }
      if (full) {
        for (var n = 0u; n < (BC + NS - 1u) / NS; n++) {
          let jj = st + NS * n;
          if (jj < BC) {
            let vv = tile_values(jj, cl);
            for (var r = 0u; r < R; r++) {
              let p = p_s[jj * R + r];
              l[r] += p;
              for (var u = 0u; u < CPL; u++) {
                o[r][u] += p * vv[u];
              }
            }
          }
        }
      } else {
        for (var n = 0u; n < (BC + NS - 1u) / NS; n++) {
          let jj = st + NS * n;
          if (jj < BC) {
            let vv = tile_values(jj, cl);
            for (var r = 0u; r < R; r++) {
              let p = p_s[jj * R + r];
              l[r] += p;
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
  }

  // Streams add up (they share the running maximum) in q_s, which QK no longer needs.
  workgroupBarrier();
  for (var s = 0u; s < NS; s++) {
    if (st == s) {
      for (var r = 0u; r < R; r++) {
        for (var u = 0u; u < CPL; u++) {
          let c = cl + PVW * u;
          if (c < VV) {
            q_s[r * QO + c] = select(q_s[r * QO + c] + o[r][u], o[r][u], s == 0u);
          }
        }
        if (cl == 0u) {
          l_s[r] = select(l_s[r] + l[r], l[r], s == 0u);
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
        let fin = finish_row(m_s[r], l_s[r], MASKED);
        let row = ((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t;
        o_parts[row * VV + c] = finite_or_nan4(q_s[r * QO + c] * fin.x);
        if (c == 0u) {
          lse_parts[row] = fin.y;
        }
      }
    }
  }
}
