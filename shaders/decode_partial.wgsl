// decode_partial: fused QK^T + online softmax + PV over one KV split (flash decoding).
// One workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of GROUP_TILE
// query heads): the VECTORS query vectors that share this kv head (decode_common.wgsl) read
// each K/V tile once, from workgroup memory. Writes the contract's partial state of the
// split: o_t normalised over the split's visible keys and lse_t (0 and -inf for a split with
// no visible key).
//
// Per tile of KV_TILE keys, work is spread so that each value is converted and each exp
// taken once:
//   QK   SLICES lanes per key, each a slice of the head, all query vectors
//        (decode_qk_common.wgsl);
//   max  one lane per query vector finds the tile maximum and the rescale factor;
//   exp  one lane per (key, query vector);
//   PV   STREAMS streams x PV_LANES lanes, each owning columns of the output for all query
//        vectors (decode_pv_common.wgsl).
// BLOCKS 1 (block_skip): tiles are the blocks of the masked-block list that the row tile's
// list keeps; with BALANCE 1 (op attention) the row's listed blocks are dealt out evenly over
// the splits instead of by key range (any partition of the keys reduces to the same
// result); with BALANCE 0 (op partial) a split keeps its key range, as the contract's partial
// states require. Blocks flagged all-zero skip the bias load.
// q and k rows are QK_DIM elements (QK_VEC4S vec4s, QK_GRANULES granules), v's and the
// output's V_DIM (V_VEC4S, V_GRANULES).
// DIRECT 1 (kv_staging "direct", tiles.py): K/V are never staged: each QK lane loads its
// key slices and each PV lane its stream's value granules straight into registers
// (decode_qk_common's k_reg, decode_pv_common's v_reg), so a tile needs no staging barrier
// and workgroup memory holds only queries, logits and statistics.

const Q_STRIDE: u32 = max(QK_VEC4S, V_VEC4S);   // q_s row: a query, then a merged output
const SUMS: u32 = 1u;                           // the PV lanes sum the weights
const LOW_KEYS: u32 = 1u;                       // listed blocks may start before klo

var<workgroup> m_s: array<f32, VECTORS>;        // running maximum per vector
var<workgroup> mu_s: array<f32, VECTORS>;       // this tile's exp offset per vector
var<workgroup> al_s: array<f32, VECTORS>;       // this tile's rescale factor per vector
var<workgroup> l_s: array<f32, VECTORS>;        // merged denominators at the end

// Where decode_pv_common's streams meet: o in q_s, which QK no longer needs; sums in l_s.
fn merge_o(r: u32, c: u32, x: vec4<f32>, first: bool) {
  q_s[r * Q_STRIDE + c] = select(q_s[r * Q_STRIDE + c] + x, x, first);
}

fn merge_l(r: u32, x: f32, first: bool) {
  l_s[r] = select(l_s[r] + x, x, first);
}

fn merged_o(r: u32, c: u32) -> vec4<f32> {
  return q_s[r * Q_STRIDE + c];
}

fn merged_stats(r: u32) -> vec2<f32> {
  return vec2<f32>(m_s[r], l_s[r]);
}

// (first key, bias needed) of tile it: consecutive tiles from klo, or listed blocks.
fn tile_of(it: u32, klo: u32, l_first: u32) -> vec2<u32> {
  if (BLOCKS == 1u) {
    let e = blk_entry(l_first + it);
    return vec2<u32>((e & 0x7fffffffu) * KV_TILE, 1u - (e >> 31u));
  }
  return vec2<u32>(klo + it * KV_TILE, 1u);
}

// The split's tiles: (klo, khi, tile count, first list entry). Without a block list, the
// KV_TILE-key tiles from klo over the split's keys [klo, khi) that the row tile sees; with one
// (BLOCKS 1), the listed blocks there, or with BALANCE 1 the row's listed blocks dealt out
// evenly over the splits (klo, khi: all the keys the row tile sees).
fn tile_range(d: DecodeWg) -> vec4<u32> {
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
  return vec4<u32>(klo, khi, n_tiles, l_first);
}

// p_s: the tile's logits -> its weights exp(x - m) under the running maximum, one lane per
// query vector finding the tile maximum and the rescale factor (al_s), then one per (key,
// vector). Starts and ends with p_s complete (barriers).
fn tile_weights(lid: u32) {
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
}

// A PV lane's accumulators after the tile of keys j0..: rescaled to the new running maximum
// (al_s), plus stream st's keys (decode_pv_common's pv_keys, full or edge).
fn pv_tile(acc: Lanes, st: u32, cl: u32, j0: u32, full: bool, d: DecodeWg,
           vt: array<VUnit, V_REGS>) -> Lanes {
  var a = acc;
  for (var r = 0u; r < VECTORS; r++) {
    let al = al_s[r];
    a.l[r] *= al;
    for (var u = 0u; u < LANE_COLS; u++) {
      a.o[r][u] *= al;
    }
  }
  if (full) {
    return pv_keys(a, st, cl, j0, true, d, vt);
  }
  return pv_keys(a, st, cl, j0, false, d, vt);
}

// The workgroup d's work (decode_common's main calls it): the split's tiles (tile_range),
// its queries staged, the tile loop of the kv_staging, the streams merged, the partials out.
fn decode_body(d: DecodeWg, lid: u32) {
  let tiles = tile_range(d);
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, tiles.x, tiles.y);
  stage_queries(d, lid);
  if (lid < VECTORS) {
    m_s[lid] = MASKED;
  }
  let st = lid / PV_LANES;                     // PV stream and column lane
  let cl = lid % PV_LANES;
  var acc: Lanes;
  if (DIRECT == 1u) {
    workgroupBarrier();   // q_s and m_s written (staged: the first staging barrier)
    load_q_regs(lid);
    acc = direct_tiles(d, w, tiles, lid, st, cl);
  } else {
    acc = staged_tiles(d, w, tiles, lid, st, cl);
  }
  merge_streams(acc, st, cl);
  write_partials(d, lid);
}

// DIRECT: the tile loop over register tiles. With PREFETCH=1 iteration it issues the loads of
// tile it into kn/vn, then computes tile it-1 from their copies kc/vc (loaded the iteration
// before), so the loads fly during the compute; PREFETCH=0 computes tile it from kn/vn. The
// loads have a constant trip count (unrolled, all issued before the first use).
// tiles: (klo, khi, tile count, first list entry) of tile_range; (st, cl) the lane's PV
// stream and column lane.
fn direct_tiles(d: DecodeWg, w: Wg, tiles: vec4<u32>, lid: u32, st: u32, cl: u32) -> Lanes {
  var acc = Lanes();
  var kn: array<KUnit, K_REGS>;
  var vn: array<VUnit, V_REGS>;
  for (var it = 0u; it < tiles.z + PREFETCH; it++) {
    var kc = kn;
    var vc = vn;
    var jf = 0u;
    if (it < tiles.z) {
      jf = tile_of(it, tiles.x, tiles.w).x;
    }
    // only this split's keys, never past the valid length nor before kv_start
    for (var u = 0u; u < K_REGS; u++) {
      kn[u] = k_reg(u, lid, d.b, d.kvh, jf, tiles.x, tiles.y, it < tiles.z);
    }
    for (var u = 0u; u < V_REGS; u++) {
      vn[u] = v_reg(u, st, cl, d.b, d.kvh, jf, tiles.x, tiles.y, it < tiles.z);
    }
    if (it < PREFETCH) {
      continue;
    }
    if (PREFETCH == 0u) {
      kc = kn;
      vc = vn;
    }
    let cur = tile_of(it - PREFETCH, tiles.x, tiles.w);
    let j0 = cur.x;
    tile_logits(w, j0, cur.y == 1u, tile_plain(d, j0, tiles.x, tiles.y), lid, kc);
    tile_weights(lid);
    if (st < STREAMS) {
      acc = pv_tile(acc, st, cl, j0, tile_full(d, j0, tiles.x, tiles.y), d, vc);
    }
  }

  return acc;
}

// kv_staging "workgroup": K/V tiles staged in k_s / v_s (arguments as direct_tiles).
fn staged_tiles(d: DecodeWg, w: Wg, tiles: vec4<u32>, lid: u32, st: u32, cl: u32) -> Lanes {
  var acc = Lanes();

  // Tile loop. With PREFETCH=1 it is software-pipelined: iteration it stores tile it-1
  // (already in registers) to workgroup memory, issues the loads of tile it, then computes
  // tile it-1, so the loads fly during the compute. PREFETCH=0: load, store, compute tile it.
  // The loads have a constant trip count (the compiler unrolls them and issues all before
  // the first use) and sit in the kernel's body with their staging, written out for both
  // orders (so too in flash_prefill, decode_qk and decode_pv): a helper taking the register
  // tile by pointer made a driver keep it in local memory. These twins stay on that
  // observation; helpers taking the tile by value were never timed.
  var kr: array<RG, K_LOADS>;
  var vr: array<RG, V_LOADS>;
  for (var it = 0u; it < tiles.z + PREFETCH; it++) {
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
    if (it < tiles.z) {
      jf = tile_of(it, tiles.x, tiles.w).x;
    }
    // only this split's keys, never past the valid length nor before kv_start
    for (var u = 0u; u < K_LOADS; u++) {
      let g = kv_granules(lid + u * THREADS, d.b, d.kvh, jf, tiles.x, tiles.y, it < tiles.z);
      kr[u] = g.k;
      if (V_GRANULES == QK_GRANULES) {
        vr[u] = g.v;
      }
    }
    if (V_GRANULES != QK_GRANULES) {
      for (var u = 0u; u < V_LOADS; u++) {
        vr[u] = v_granules(lid + u * THREADS, d.b, d.kvh, jf, tiles.x, tiles.y, it < tiles.z);
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
    let cur = tile_of(it - PREFETCH, tiles.x, tiles.w);
    let j0 = cur.x;
    tile_logits(w, j0, cur.y == 1u, tile_plain(d, j0, tiles.x, tiles.y), lid,
                array<KUnit, K_REGS>());
    tile_weights(lid);
    if (st < STREAMS) {
      acc = pv_tile(acc, st, cl, j0, tile_full(d, j0, tiles.x, tiles.y), d, array<VUnit, V_REGS>());
    }
  }

  return acc;
}
