// decode_partial: fused QK^T + online softmax + PV over one KV split (flash decoding). One
// workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of GROUP_TILE query
// heads): the VECTORS = GROUP_TILE*M_TILE query vectors that share this kv head read each K/V
// tile once, from workgroup memory. Writes the contract's partial state of the split: o_t
// normalised over the split's visible keys and lse_t (0 and -inf for a split with no visible
// key).
// Per tile of KV_TILE keys, work is spread so that each value is converted and each exp taken
// once:
//   QK   SLICES lanes per key, each a slice of the head, all VECTORS query vectors (partial
//     dots meet
//        in workgroup memory when SLICES > 1);
//   max  one lane per query vector finds the tile maximum and the rescale factor;
//   exp  one lane per (key, query vector);
//   PV   STREAMS streams x PV_LANES lanes: a lane owns LANE_COLS vec4 columns of the output for
//     all VECTORS query
//        vectors and a stream takes every STREAMS-th key; streams share the running maximum, so
//        their sums simply add up at the end.
// BLOCKS 1 (block_skip): tiles are the blocks of the masked-block list that the row tile's list
// keeps; with BALANCE 1 (op attention) the row's listed blocks are dealt out evenly over the
// splits instead of by key range (any partition of the keys reduces to the same result); with
// BALANCE 0 (op partial) a split keeps its key range, as the contract's partial states require.
// Blocks flagged all-zero skip the bias load. q and k rows are QK_DIM elements (QK_VEC4S vec4s,
// QK_GRANULES granules), v's and the output's V_DIM (V_VEC4S, V_GRANULES). Prefix constants:
// M_TILE, GROUP_TILE, KV_TILE (keys per tile), THREADS (threads), PREFETCH, BALANCE.

const VECTORS: u32 = GROUP_TILE * M_TILE;
const SLICES: u32 = max(1u, THREADS / KV_TILE);         // QK lanes per key
const PASS_KEYS: u32 = THREADS / SLICES;                  // keys per QK pass
const PASSES: u32 = KV_TILE / min(KV_TILE, PASS_KEYS);        // QK passes per tile
const SLICE_VEC4S: u32 = (QK_VEC4S + SLICES - 1u) / SLICES;      // vec4 chunks per QK lane
const PV_LANES: u32 = min(THREADS, V_VEC4S);             // PV lanes across v's head
const STREAMS: u32 = THREADS / PV_LANES;                 // PV streams
const LANE_COLS: u32 = (V_VEC4S + PV_LANES - 1u) / PV_LANES;   // vec4 columns per PV lane
const LANE_ELEMS: u32 = (KV_TILE * VECTORS + THREADS - 1u) / THREADS;  // (key, vector) elements per lane
const K_STRIDE: u32 = QK_VEC4S + 1u;                  // padded K row stride: lanes read distinct banks
const K_LOADS: u32 = (KV_TILE * QK_GRANULES + THREADS - 1u) / THREADS; // K granules each lane loads per tile
const V_LOADS: u32 = (KV_TILE * V_GRANULES + THREADS - 1u) / THREADS; // V granules each lane loads per tile
const Q_STRIDE: u32 = max(QK_VEC4S, V_VEC4S);              // q_s row: a query, then a merged output

var<workgroup> q_s: array<vec4<f32>, VECTORS * Q_STRIDE>;    // scaled queries; the merged o at the end
var<workgroup> k_s: array<TS, KV_TILE * K_STRIDE>;
var<workgroup> v_s: array<TS, KV_TILE * V_VEC4S>;
var<workgroup> p_s: array<f32, KV_TILE * VECTORS>;          // [key][vector]: logits, then exp
var<workgroup> part_s: array<f32, KV_TILE * VECTORS * SLICES>;  // QK partial dots per head slice
var<workgroup> m_s: array<f32, VECTORS>;               // running maximum per vector
var<workgroup> mu_s: array<f32, VECTORS>;              // this tile's exp offset per vector
var<workgroup> al_s: array<f32, VECTORS>;              // this tile's rescale factor per vector
var<workgroup> l_s: array<f32, VECTORS>;               // merged denominators at the end

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
  let gh = w.hc * GROUP_TILE + r / M_TILE;
  let i = w.i0 + r % M_TILE;
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

// (first key, bias needed) of tile it: consecutive tiles from klo, or listed blocks.
fn tile_of(it: u32, klo: u32, l_first: u32) -> vec2<u32> {
  if (BLOCKS == 1u) {
    let e = blk_entry(l_first + it);
    return vec2<u32>((e & 0x7fffffffu) * KV_TILE, 1u - (e >> 31u));
  }
  return vec2<u32>(klo + it * KV_TILE, 1u);
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M_TILE, GROUP_TILE);
  if (!d.ok) {
    return;
  }
  var klo = d.klo;
  var khi = d.khi;
  var n_tiles = select(0u, cdiv(khi - klo, KV_TILE), khi > klo);
  var l_first = 0u;
  if (BLOCKS == 1u) {
    // GROUP_TILE is 1 when the bias differs per head, so one list row serves the workgroup.
    let row = blk_row(d.b, d.kvh * P.group_size + d.hc * GROUP_TILE, d.rt, d.n_rt);
    if (BALANCE == 1u) {
      klo = u32(d.span.x);
      khi = u32(d.span.y);
      let ls = blk_span(row, klo, khi, KV_TILE);
      let per = cdiv(ls.y - ls.x, P.n_splits);
      l_first = ls.x + min(d.t * per, ls.y - ls.x);
      n_tiles = ls.x + min((d.t + 1u) * per, ls.y - ls.x) - l_first;
    } else {
      let ls = blk_span(row, klo, khi, KV_TILE);
      l_first = ls.x;
      n_tiles = ls.y - ls.x;
    }
  }
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, klo, khi);

  // Query vector r is head hc*GROUP_TILE + r/M_TILE of the group, row i0 + r%M_TILE; absent ones
  // load zeros.
  for (var u = 0u; u < (VECTORS * QK_GRANULES + THREADS - 1u) / THREADS; u++) {
    let idx = lid + u * THREADS;
    if (idx >= VECTORS * QK_GRANULES) {
      break;
    }
    let r = idx / QK_GRANULES;
    let g = idx % QK_GRANULES;
    let gh = d.hc * GROUP_TILE + r / M_TILE;
    let i = d.i0 + r % M_TILE;
    var gv = GV();
    if (gh < P.group_size && i < d.seq.rows) {     // padding rows' q is never read
      gv = load_q(q_granule(d.b, d.kvh * P.group_size + gh, i) + g);
    }
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      q_s[r * Q_STRIDE + g * GRANULE_VEC4S + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  if (lid < VECTORS) {
    m_s[lid] = MASKED;
  }

  let st = lid / PV_LANES;                     // PV stream and column lane
  let cl = lid % PV_LANES;
  var l: array<f32, VECTORS>;
  var o: array<array<vec4<f32>, LANE_COLS>, VECTORS>;
  for (var r = 0u; r < VECTORS; r++) {
    l[r] = 0.0;
    for (var u = 0u; u < LANE_COLS; u++) {
      o[r][u] = vec4<f32>(0.0);
    }
  }

  // Tile loop. With PREFETCH=1 it is software-pipelined: iteration it stores tile it-1
  // (already in registers) to workgroup memory, issues the loads of tile it, then computes
  // tile it-1, so the loads fly during the compute. PREFETCH=0: load, store, compute tile it.
  // The loads have a constant trip count (the compiler unrolls them and issues all before
  // the first use) and sit in main: a helper taking the register tile by pointer made a
  // driver keep it in local memory.
  var kr: array<GV, K_LOADS>;
  var vr: array<GV, V_LOADS>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/v_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      for (var u = 0u; u < V_LOADS; u++) {
        stage_v(lid + u * THREADS, vr[u]);
      }
      workgroupBarrier();
    }
    var jf = 0u;
    if (it < n_tiles) {
      jf = tile_of(it, klo, l_first).x;
    }
    for (var u = 0u; u < K_LOADS; u++) {
      let idx = lid + u * THREADS;
      let jj = idx / QK_GRANULES;
      kr[u] = GV();
      if (V_GRANULES == QK_GRANULES) {
        vr[u] = GV();
      }
      // only this split's keys, never past the valid length nor before kv_start
      if (idx < KV_TILE * QK_GRANULES && it < n_tiles && jf + jj >= klo && jf + jj < khi) {
        let at = kv_granule(d.b, d.kvh, jf + jj) + idx % QK_GRANULES;
        kr[u] = load_k(at);
        if (V_GRANULES == QK_GRANULES) {                     // v's rows are k's: the same granules
          vr[u] = load_v(at);
        }
      }
    }
    if (V_GRANULES != QK_GRANULES) {
      for (var u = 0u; u < V_LOADS; u++) {
        let idx = lid + u * THREADS;
        let jj = idx / V_GRANULES;
        vr[u] = GV();
        if (idx < KV_TILE * V_GRANULES && it < n_tiles && jf + jj >= klo && jf + jj < khi) {
          vr[u] = load_v(v_granule(d.b, d.kvh, jf + jj) + idx % V_GRANULES);
        }
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/v_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      for (var u = 0u; u < V_LOADS; u++) {
        stage_v(lid + u * THREADS, vr[u]);
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
    let h = lid / min(KV_TILE, PASS_KEYS);
    for (var kk = 0u; kk < PASSES; kk++) {
      let jj = lid % min(KV_TILE, PASS_KEYS) + PASS_KEYS * kk;
      var sc: array<f32, VECTORS>;
      for (var r = 0u; r < VECTORS; r++) {
        sc[r] = 0.0;
      }
      for (var cc = 0u; cc < SLICE_VEC4S; cc++) {
        let c = min(h * SLICE_VEC4S + cc, QK_VEC4S - 1u);
        let kc = select(vec4<f32>(0.0), ts_f32(k_s[jj * K_STRIDE + c]), h * SLICE_VEC4S + cc < QK_VEC4S);
        for (var r = 0u; r < VECTORS; r++) {
          sc[r] += dot(q_s[r * Q_STRIDE + c], kc);
        }
      }
      for (var r = 0u; r < VECTORS; r++) {
        if (SLICES == 1u) {
          p_s[jj * VECTORS + r] = vec_logit(w, r, j0 + jj, sc[r], wb);
        } else {
          part_s[(jj * VECTORS + r) * SLICES + h] = sc[r];
        }
      }
    }
    workgroupBarrier();
    if (SLICES > 1u) {
      for (var u = 0u; u < LANE_ELEMS; u++) {
        let e = lid + u * THREADS;
        if (e < KV_TILE * VECTORS) {
          var s = 0.0;
          for (var hh = 0u; hh < SLICES; hh++) {
            s += part_s[e * SLICES + hh];
          }
          p_s[e] = vec_logit(w, e % VECTORS, j0 + e / VECTORS, s, wb);
        }
      }
      workgroupBarrier();
    }

    // Tile maximum and rescale factor, one lane per query vector.
    if (lid < VECTORS) {
      var mx = MASKED;
      for (var jj = 0u; jj < KV_TILE; jj++) {
        mx = max(mx, p_s[jj * VECTORS + lid]);
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
    for (var u = 0u; u < LANE_ELEMS; u++) {
      let e = lid + u * THREADS;
      if (e < KV_TILE * VECTORS) {
        p_s[e] = weight_of(p_s[e], mu_s[e % VECTORS]);
      }
    }
    workgroupBarrier();

    // A tile on the causal diagonal or the window's edge of the row tile adds only the keys
    // each row sees (their weights of 0 must not meet the others' values).
    // M_TILE == 1: the rows share one position, so no tile has an edge (the branch folds away)
    let full = M_TILE == 1u || all_see(j0, j0 + KV_TILE, vec2<i32>(i32(klo), i32(khi)), d.seen_all);
    if (st < STREAMS) {
      for (var r = 0u; r < VECTORS; r++) {
        let al = al_s[r];
        l[r] *= al;
        for (var u = 0u; u < LANE_COLS; u++) {
          o[r][u] *= al;
        }
      }
      if (full) {
        for (var n = 0u; n < (KV_TILE + STREAMS - 1u) / STREAMS; n++) {
          let jj = st + STREAMS * n;
          if (jj < KV_TILE) {
            let vv = tile_values(jj, cl);
            for (var r = 0u; r < VECTORS; r++) {
              let p = p_s[jj * VECTORS + r];
              l[r] += p;
              for (var u = 0u; u < LANE_COLS; u++) {
                o[r][u] += p * vv[u];
              }
            }
          }
        }
      } else {
        for (var n = 0u; n < (KV_TILE + STREAMS - 1u) / STREAMS; n++) {
          let jj = st + STREAMS * n;
          if (jj < KV_TILE) {
            let vv = tile_values(jj, cl);
            for (var r = 0u; r < VECTORS; r++) {
              let p = p_s[jj * VECTORS + r];
              l[r] += p;
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
  }

  // Streams add up (they share the running maximum) in q_s, which QK no longer needs.
  workgroupBarrier();
  for (var s = 0u; s < STREAMS; s++) {
    if (st == s) {
      for (var r = 0u; r < VECTORS; r++) {
        for (var u = 0u; u < LANE_COLS; u++) {
          let c = cl + PV_LANES * u;
          if (c < V_VEC4S) {
            q_s[r * Q_STRIDE + c] = select(q_s[r * Q_STRIDE + c] + o[r][u], o[r][u], s == 0u);
          }
        }
        if (cl == 0u) {
          l_s[r] = select(l_s[r] + l[r], l[r], s == 0u);
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
        let fin = finish_row(m_s[r], l_s[r], MASKED);
        let row = ((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + d.t;
        o_parts[row * V_VEC4S + c] = finite_or_nan4(q_s[r * Q_STRIDE + c] * fin.x);
        if (c == 0u) {
          lse_parts[row] = fin.y;
        }
      }
    }
  }
}
