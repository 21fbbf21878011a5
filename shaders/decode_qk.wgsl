// decode_qk: the first kernel of the unfused split-KV decode (FlashInfer's two-kernel form):
// QK^T over one KV split, written out as scores [B, Nq, S, C] float32 (the logits after
// softcap, bias and alibi; MASKED where a key is invisible), and the split's softmax
// statistics per query row: m = max logit, l = sum exp(s - m) (m = MASKED, l = 0 when the
// split has no visible key). decode_pv normalises and multiplies by V.
// One workgroup = one (batch, kv head, split, tile of M_TILE query rows, chunk of GROUP_TILE
// query heads), like decode_partial: its query vectors (decode_common.wgsl) read each K tile
// once from workgroup memory, QK^T as decode_partial's (decode_qk_common.wgsl). Scores are
// written for the keys [klo, khi) of the split that the row tile can see; decode_pv reads
// only keys visible to each row.

const Q_STRIDE: u32 = QK_VEC4S;                 // q_s row: a query
const LOW_KEYS: u32 = 0u;                       // tiles start at klo

// Row of query vector r in [B, Nq, S] order, or 0xffffffff when the vector is absent.
fn vec_row(w: Wg, r: u32) -> u32 {
  let gh = w.hc * GROUP_TILE + r / M_TILE;
  let i = w.i0 + r % M_TILE;
  if (gh < P.group_size && i < P.seq_len) {
    return (w.b * P.num_heads + w.kvh * P.group_size + gh) * P.seq_len + i;
  }
  return 0xffffffffu;
}

// The logits of the tile of keys j0.. (p_s) out as scores, one lane per (key, vector) of the
// tile's keys below khi; and the running statistics ml = (max, sum) of vector lid (lanes lid <
// VECTORS) after the tile (online: the sum rescaled to the new maximum).
fn tile_scores(w: Wg, j0: u32, ml: vec2<f32>, lid: u32) -> vec2<f32> {
  for (var u = 0u; u < LANE_ELEMS; u++) {
    let e = lid + u * THREADS;
    if (e < KV_TILE * VECTORS) {
      let row = vec_row(w, e % VECTORS);
      let j = j0 + e / VECTORS;
      if (row != 0xffffffffu && j < w.khi) {
        scores[row * P.capacity + j] = p_s[e];
      }
    }
  }
  if (lid >= VECTORS) {
    return ml;
  }
  var mx = MASKED;
  for (var jj = 0u; jj < KV_TILE; jj++) {
    mx = max(mx, p_s[jj * VECTORS + lid]);
  }
  let m_new = max(ml.x, mx);
  // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps the sum at 0.
  let m_use = select(m_new, 0.0, m_new <= MASKED);
  var lsum = ml.y * exp(ml.x - m_use);
  for (var jj = 0u; jj < KV_TILE; jj++) {
    lsum += weight_of(p_s[jj * VECTORS + lid], m_use);
  }
  return vec2<f32>(m_new, lsum);
}

// The workgroup d's work (decode_common's main calls it).
fn decode_body(d: DecodeWg, lid: u32) {
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, d.klo, d.khi);

  stage_queries(d, lid);
  workgroupBarrier();

  // Running statistics (max, sum) of vector lid (lanes lid < VECTORS), in private memory.
  var ml = vec2<f32>(MASKED, 0.0);

  // Tile loop, software-pipelined as in decode_partial (PREFETCH=1: store tile it-1, load
  // tile it, compute tile it-1), its loads and staging written out in the body as there.
  let n_tiles = select(0u, cdiv(d.khi - d.klo, KV_TILE), d.khi > d.klo);
  var kr: array<RG, K_LOADS>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      workgroupBarrier();
    }
    let jf = d.klo + it * KV_TILE;
    for (var u = 0u; u < K_LOADS; u++) {
      let idx = lid + u * THREADS;
      kr[u] = RG();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < KV_TILE * QK_GRANULES && jf + idx / QK_GRANULES < d.khi) {
        kr[u] = raw_k(kv_granule(d.b, d.kvh, jf + idx / QK_GRANULES) + idx % QK_GRANULES);
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = d.klo + (it - PREFETCH) * KV_TILE;
    // this kernel loads the bias of every tile; its K is staged (DIRECT 0: no registers)
    tile_logits(w, j0, true, tile_plain(d, j0, d.klo, d.khi), lid, array<KUnit, K_REGS>());
    ml = tile_scores(w, j0, ml, lid);
  }

  if (lid < VECTORS) {
    let row = vec_row(w, lid);
    if (row != 0xffffffffu) {
      stats[row * P.n_splits + d.t] = ml;
    }
  }
}
