// Pieces both matrix-unit kernels (flash_prefill_mma, decode_mma) share: the lazy-max
// threshold, non-finite tests on halves, and the staging of one K or V granule into the
// primitive's k_s / v_s tiles (rows K_STRIDE / V_STRIDE halves apart; k rows are QK_DIM
// elements, QK_GRANULES granules, v rows V_DIM, V_GRANULES granules).

// ln(2^11.5): P = exp(x - m) <= ~3000, far below f16's 65504.
const TAU: f32 = 8.0;

// Which lanes of a vec4 of halves are not finite (bit tests: see attn_common.wgsl's NaN note).
fn bad4(x: vec4<f16>) -> vec4<bool> {
  let e = bitcast<vec4<u32>>(vec4<f32>(x)) & vec4<u32>(0x7f800000u);
  return e == vec4<u32>(0x7f800000u);
}

fn is_bad_f16(x: f16) -> bool {
  return bad4(vec4<f16>(x)).x;
}

// Element d of key j's row of v (kv layout), for the non-finite slow path.
fn v_elem(b: u32, kvh: u32, j: u32, d: u32) -> f16 {
  let g = load_v(v_granule(b, kvh, j) + d / GRANULE);
  return g_part(g, (d % GRANULE) / 4u)[d % 4u];
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

// Granule g of key j's v (tile row jj) into v_s: zeros unless load; a non-finite v half is
// staged as 0 (so 0 * NaN never reaches rows that do not see it). True if one was.
fn stage_v_granule(b: u32, kvh: u32, j: u32, jj: u32, g: u32, load: bool) -> bool {
  var vg = GV();
  if (load) {
    vg = load_v(v_granule(b, kvh, j) + g);
  }
  var bad = false;
  for (var c = 0u; c < GRANULE; c += 4u) {
    let vraw = g_part(vg, c / 4u);
    let vb = bad4(vraw);
    bad = bad || any(vb);
    let vh = select(vraw, vec4<T>(0.0), vb);
    for (var e = 0u; e < 4u; e++) {
      v_s[jj * V_STRIDE + g * GRANULE + c + e] = vh[e];
    }
  }
  return bad;
}

// The lazy running max: (reference max, rescale factor of O and l) after a tile whose max
// is m_tile. The reference moves only when the tile exceeds it by more than TAU, or on the
// row's first visible logit (O is still zero then and needs no scaling: factor 1).
fn lazy_max(m: f32, m_tile: f32) -> vec2<f32> {
  if (m_tile > m + TAU || (m <= MASKED && m_tile > MASKED)) {
    return vec2<f32>(m_tile, select(1.0, exp(m - m_tile), m > MASKED));
  }
  return vec2<f32>(m, 1.0);
}
