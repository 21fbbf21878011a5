// What the matrix-unit kernels (flash_prefill_mma and its direct form, decode_mma) share: the
// staging of v into the kernel's v_s (rows V_STRIDE halves apart; v rows are V_DIM elements,
// V_GRANULES granules; mma_staging.wgsl stages q and whole K/V tiles), non-finite tests on
// halves, and the softmax between the two products: ROW_LANES lanes per row of scores (s_s,
// rows S_STRIDE apart) each take LANE_KEYS of a tile's keys, with a lazy running max (a row
// keeps its reference max until a tile exceeds it by more than TAU) whose moves the lanes flag
// to the workgroup. Each kernel declares v_s, s_s, p_s (P, rows P_STRIDE apart), red_s (a
// value per row and lane) and alpha_s (a factor per row), and places each subgroup's 16 x 16
// O scratch in s_s (x_at); the staged ones declare q_s and k_s too.

// ln(2^11.5): P = exp(x - m) <= ~3000, far below f16's 65504.
const TAU: f32 = 8.0;

// Flags the lanes raise during a tile (take_flags): 1, a row's reference max moved (its O
// needs rescaling); 2, the tile holds a non-finite v (the slow path marks who sees it). Word
// 0 of each is used: every workgroup variable of a matrix kernel is a whole multiple of 16
// bytes, since the driver places them without the 16-byte alignment a subgroup matrix's
// pointer needs, and a 4-byte one beside the matrix arrays gave wrong products on the H200
// (ci/results/h200_wgsl_matrix_decode.txt; tests/backends/wgsl/test_mma_layout.py).
var<workgroup> flag_a: array<atomic<u32>, 4>;
var<workgroup> flag_u: vec4<u32>;

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

// The logits of lane part `part` of score row rr (query row i at position pos, of head h;
// live: the row exists): its LANE_KEYS keys from j0 + part * LANE_KEYS, MASKED where the row
// does not see the key, x[e] that of key (e + rot) % LANE_KEYS of the part (rot: the lane's
// rotation, which puts a subgroup's reads of one step in distinct banks; lane_weights takes
// the same). Their max goes to red_s for the row's other lanes.
fn lane_logits(rr: u32, part: u32, j0: u32, hi: u32, live: bool, b: u32, h: u32, i: u32,
               pos: i32, s: Seq, rot: u32) -> array<f32, LANE_KEYS> {
  var x: array<f32, LANE_KEYS>;
  var best = MASKED;
  // PLAIN_LOGITS: the row's keys as its span (row_span: contiguous), two tests a key
  let sp = row_span(pos, s);
  let k0 = j0 + part * LANE_KEYS;       // the part's first key
  // every key of the part seen with plain logits (a causal prefill's tiles off the diagonal):
  // no test a key. (A branch per lane: only a diagonal tile's lanes part ways. Its own loop:
  // one loop testing `all_seen ||` before the key's tests measured 664-670 us at S=2048 on
  // the H200 against this form's 524-530, h200_wgsl_prefill_order.txt call 10.)
  let all_seen = i32(k0) >= sp.x && i32(k0 + LANE_KEYS) <= sp.y && k0 + LANE_KEYS <= hi;
  if (PLAIN_LOGITS == 1u && live && all_seen) {
    for (var e = 0u; e < LANE_KEYS; e++) {
      let xv = plain_logit(s_s[rr * S_STRIDE + part * LANE_KEYS + (e + rot) % LANE_KEYS]
                           * P.scale);
      x[e] = xv;
      best = max(best, xv);
    }
    red_s[rr * ROW_LANES + part] = best;
    return x;
  }
  for (var e = 0u; e < LANE_KEYS; e++) {
    let jl = part * LANE_KEYS + (e + rot) % LANE_KEYS;
    let j = j0 + jl;
    var xv = MASKED;
    var seen = i32(j) >= sp.x && i32(j) < sp.y;
    if (PLAIN_LOGITS == 0u) {
      seen = key_visible(i32(j), pos, s);
    }
    if (live && j < hi && seen) {
      let d = s_s[rr * S_STRIDE + jl] * P.scale;
      if (PLAIN_LOGITS == 1u) {
        xv = plain_logit(d);
      } else {
        xv = logit(d, b, h, i, j, pos);
      }
    }
    x[e] = xv;
    best = max(best, xv);
  }
  red_s[rr * ROW_LANES + part] = best;
  return x;
}

// After a tile whose row max is m_tile, a row's softmax state ml (its reference max m, the
// lane's part of its sum l) from ml before it: the lazy max (a moved reference raises flag
// 1), P = exp(x - m) of the lane's logits x into p_s from `at` as f16, and the row's factor
// for O in alpha_s[rr] (x in lane_logits' order: rot as there). A row's state starts as
// (MASKED, 0).
fn lane_weights(x: array<f32, LANE_KEYS>, ml: vec2<f32>, m_tile: f32, at: u32, rr: u32,
                part: u32, rot: u32) -> vec2<f32> {
  let m = ml.x;
  let lm = lazy_max(m, m_tile);
  let alpha = lm.y;
  if (lm.x != m && m > MASKED) {
    atomicOr(&flag_a[0], 1u);
  }
  // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p at 0.
  let m_use = select(lm.x, 0.0, lm.x <= MASKED);
  var psum = 0.0;
  for (var e = 0u; e < LANE_KEYS; e++) {
    let p = weight_of(x[e], m_use);
    psum += p;
    p_s[at + (e + rot) % LANE_KEYS] = f16(p);
  }
  if (part == 0u) {
    alpha_s[rr] = alpha;
  }
  return vec2<f32>(lm.x, ml.y * alpha + psum);
}

// The flags the lanes raised since the last call, the same for every lane (called by all:
// it starts with a barrier); those in `keep` stay raised for the next call.
fn take_flags(lid: u32, keep: u32) -> u32 {
  workgroupBarrier();
  if (lid == 0u) {
    flag_u = vec4<u32>(atomicAnd(&flag_a[0], keep), 0u, 0u, 0u);
  }
  return workgroupUniformLoad(&flag_u).x;
}

// Tile acc with its 16 rows times alpha_s[a0 + row], through the subgroup's O scratch (the
// tiles are opaque). Called by every lane, in uniform control flow.
fn rescaled(acc: MAcc, sg: u32, lane: u32, a0: u32) -> MAcc {
  let xo = x_at(sg);
  mm_store_x(acc, xo);
  workgroupBarrier();
  for (var e = lane; e < 256u; e += 32u) {
    s_s[xo + e] *= alpha_s[a0 + e / 16u];
  }
  workgroupBarrier();
  let got = mm_load_x(xo);
  workgroupBarrier();
  return got;
}
