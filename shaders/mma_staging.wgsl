// The staging of the kernels whose products read workgroup tiles only (flash_prefill_mma,
// decode_mma: with mma_hw_staged.wgsl / mma_emu_staged.wgsl): q rows into q_s, and whole K/V
// tiles into k_s / v_s (mma_common.wgsl's stage_v_granule for v).

// Granule g of query row r (its first granule at: q_granule) into q_s: zeros unless load.
// Raw: the scale is applied to the f32 scores.
fn stage_q_granule(r: u32, g: u32, at: u32, load: bool) {
  var gv = GV();
  if (load) {
    gv = load_q(at + g);
  }
  for (var e = 0u; e < GRANULE; e++) {
    q_s[r * Q_STRIDE + g * GRANULE + e] = g_part(gv, e / 4u)[e % 4u];
  }
}

// Granule g of key j's k (tile row jj) into k_s: zeros unless load.
fn stage_k_granule(b: u32, kvh: u32, j: u32, jj: u32, g: u32, load: bool) {
  var kg = GV();
  if (load) {
    kg = load_k(kv_granule(b, kvh, j) + g);
  }
  for (var c = 0u; c < GRANULE; c += 4u) {
    let kh = g_part(kg, c / 4u);
    for (var e = 0u; e < 4u; e++) {
      k_s[jj * K_STRIDE + g * GRANULE + c + e] = kh[e];
    }
  }
}

// The tile of keys j0.. into k_s / v_s, keys outside [lo, hi) as zeros (no row sees them); a
// non-finite v half is staged as 0 and raises flag 2. Between barriers: the previous tile's
// readers are done before, the tile is complete after.
fn stage_tiles(b: u32, kvh: u32, j0: u32, lo: u32, hi: u32, lid: u32) {
  workgroupBarrier();
  for (var idx = lid; idx < KV_TILE * QK_GRANULES; idx += THREADS) {
    let jj = idx / QK_GRANULES;
    let ld = j0 + jj >= lo && j0 + jj < hi;
    stage_k_granule(b, kvh, j0 + jj, jj, idx % QK_GRANULES, ld);
    if (V_GRANULES == QK_GRANULES
        && stage_v_granule(b, kvh, j0 + jj, jj, idx % QK_GRANULES, ld)) {
      atomicOr(&flag_a[0], 2u);
    }
  }
  if (V_GRANULES != QK_GRANULES) {      // v's rows differ from k's: their own granules
    for (var idx = lid; idx < KV_TILE * V_GRANULES; idx += THREADS) {
      let jj = idx / V_GRANULES;
      if (stage_v_granule(b, kvh, j0 + jj, jj, idx % V_GRANULES, j0 + jj >= lo && j0 + jj < hi)) {
        atomicOr(&flag_a[0], 2u);
      }
    }
  }
  workgroupBarrier();
}
