// The per-key half of what the attention families share (attn_common.wgsl has the numerics,
// the sequences' key spans and the workgroup mappings; every program includes both, this one
// second): K/V granules of a tile, a key's visibility, logits (masks, softcap, bias, ALiBi),
// q / k / v / out indexing, sinks, a row's finish, and the masked-block lists.

// Granule idx of a tile (key idx / ng, granule idx % ng; ng granules a row: QK_GRANULES for
// K, V_GRANULES for V) in workgroup memory whose key rows are `stride` vec4s apart: one
// layout for every family's staging stores, matching the readers' key * stride + vec4
// column.
fn tile_at(idx: u32, stride: u32, ng: u32) -> u32 {
  return (idx / ng) * stride + (idx % ng) * GRANULE_VEC4S;
}

// A lane's granule idx of the K tile of keys jf.. as its register tile holds it (as loaded:
// kv_units.wgsl's RG): zeros unless live and the key lies in [lo, hi) (the keys some row
// sees); and where v's rows are k's (V_GRANULES == QK_GRANULES), V's granule at the same
// address. One granule at a time, by value: never the register tile (decode_partial's tile
// loop says why).
struct KvGranules {
  k: RG,
  v: RG,
}

fn kv_granules(idx: u32, b: u32, kvh: u32, jf: u32, lo: u32, hi: u32, live: bool
               ) -> KvGranules {
  var g = KvGranules();
  let jj = idx / QK_GRANULES;
  if (idx < KV_TILE * QK_GRANULES && live && jf + jj >= lo && jf + jj < hi) {
    let at = kv_granule(b, kvh, jf + jj) + idx % QK_GRANULES;
    g.k = raw_k(at);
    if (V_GRANULES == QK_GRANULES) {
      g.v = raw_v(at);
    }
  }
  return g;
}

// The same of V where v's rows differ from k's (V_GRANULES granules a key).
fn v_granules(idx: u32, b: u32, kvh: u32, jf: u32, lo: u32, hi: u32, live: bool) -> RG {
  var g = RG();
  let jj = idx / V_GRANULES;
  if (idx < KV_TILE * V_GRANULES && live && jf + jj >= lo && jf + jj < hi) {
    g = raw_v(v_granule(b, kvh, jf + jj) + idx % V_GRANULES);
  }
  return g;
}

// Keys [lo, hi) a row at position pos sees (contiguous): edge loops test j against it.
// Empty for a padding row.
fn row_span(pos: i32, s: Seq) -> vec2<i32> {
  var span = window_span(s, pos, pos);
  if (Q_ROWS == 1u && pos >= i32(s.len)) {
    span.y = span.x;
  }
  return span;
}

fn key_visible(j: i32, pos: i32, s: Seq) -> bool {
  var ok = j < i32(s.len);
  if (KV_START == 1u) {
    ok = ok && j >= i32(s.lo);          // left padding
  }
  if (Q_ROWS == 1u) {
    ok = ok && pos < i32(s.len);        // a padding row sees nothing
  }
  if (P.causal != 0u) {
    ok = ok && j <= pos;
  }
  if (P.local_window > 0) {
    ok = ok && j > pos - P.local_window;
  }
  if (P.right_window >= 0) {
    ok = ok && j - pos <= P.right_window;
  }
  return ok;
}

fn alibi_slope(h: u32) -> f32 {
  if (h < P.alibi_n) {
    return exp2(P.alibi_e0 * f32(h + 1u));
  }
  return exp2(P.alibi_e1 * f32(2u * (h - P.alibi_n) + 1u));
}

// tanh as the softcap needs it. Large arguments are clamped: some tanh lowerings overflow
// to NaN there (tanh(15) == 1 in f32). Small ones use the series: lowerings through
// (e^2x - 1) / (e^2x + 1) lose every digit as x -> 0 (lavapipe returns 0 for x ~ 1e-10,
// which dropped a huge softcap's logits); the series' first omitted term is < 1e-13 * x
// for |x| < 0.05.
fn softcap_tanh(x: f32) -> f32 {
  if (abs(x) < 0.05) {
    let x2 = x * x;
    return x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))));
  }
  return tanh(clamp(x, -15.0, 15.0));
}

// s = scale * q.k (the scale is folded into q on load) -> softcap -> bias -> alibi, for a
// key visible to the row. A non-finite q.k (q or k not finite), or a NaN / +inf logit (from
// the bias) is NaN: it poisons the row. Finite logits below MASKED and -inf (a bias that
// masks the key) are MASKED.
fn logit(dot_qk: f32, b: u32, h: u32, i: u32, j: u32, pos: i32) -> f32 {
  return logit_b(dot_qk, b, h, i, j, pos, true);
}

// logit_b of a spec without softcap, bias or ALiBi (PLAIN_LOGITS, a prefix constant the plan
// sets from the spec): the scaled score itself, NaN where it is not finite. Where every row
// sees every key (the prefills' full steps, the decode's tile_plain tiles) it replaces
// logit_b's per-score feature tests (the matrix prefill's lane_logits also tests a key
// against the row's span then).
fn plain_logit(d: f32) -> f32 {
  return select(max(d, MASKED), nan_f32(), (bitcast<u32>(d) & 0x7f800000u) == 0x7f800000u);
}

// with_bias false: the bias is known to be 0 here (a block flagged all-zero); not loaded.
fn logit_b(dot_qk: f32, b: u32, h: u32, i: u32, j: u32, pos: i32, with_bias: bool) -> f32 {
  let dot_bad = (bitcast<u32>(dot_qk) & 0x7f800000u) == 0x7f800000u;
  var s = dot_qk;
  if (P.softcap > 0.0) {
    s = P.softcap * softcap_tanh(s / P.softcap);
  }
  if (P.has_bias != 0u && with_bias) {
    s = s + bias[b * P.bias_sb + h * P.bias_sh + i * P.bias_ss + j];
  }
  if (P.has_alibi != 0u) {
    s = s + alibi_slope(h) * f32(i32(j) - pos);
  }
  return select(select(s, MASKED, s < MASKED), nan_f32(), dot_bad | is_poison(s));
}

// Granule index of element 0 of row (b, head, row) in q (q layout) or k/v (kv layout).
fn q_granule(b: u32, h: u32, i: u32) -> u32 {
  return (b * P.q_sb + h * P.q_sh + i * P.q_ss) / GRANULE;
}

// kv_elem (generated): contiguous layouts, or the page of key j through the block table.
fn kv_granule(b: u32, n: u32, j: u32) -> u32 {
  return kv_elem(b, n, j) / GRANULE;
}

// The same for v, whose rows are V_DIM elements: its strides are k's scaled by V_DIM / QK_DIM
// (every stride of k is a multiple of QK_DIM in each layout).
fn v_granule(b: u32, n: u32, j: u32) -> u32 {
  return v_row_at(b, n, j) / GRANULE;
}

// Element offset of key j's v row.
fn v_row_at(b: u32, n: u32, j: u32) -> u32 {
  if (V_DIM == QK_DIM) {
    return kv_elem(b, n, j);
  }
  return kv_elem(b, n, j) / QK_DIM * V_DIM;
}

// vec4 index of element 0 of out's row (b, head, row): q's layout with rows of V_DIM elements.
fn out_vec4(b: u32, h: u32, i: u32) -> u32 {
  let e = b * P.q_sb + h * P.q_sh + i * P.q_ss;
  if (V_DIM == QK_DIM) {
    return e / 4u;
  }
  return e / QK_DIM * V_DIM / 4u;
}

// The head sink as an extra logit, or MASKED when absent (a -inf sink means no sink).
fn sink_logit(h: u32) -> f32 {
  if (P.has_sink != 0u) {
    return max(sink[h], MASKED);
  }
  return MASKED;
}

// The sink of query row i: none for a padding row (out 0, lse -inf).
fn row_sink(h: u32, s: Seq, i: u32) -> f32 {
  if (Q_ROWS == 1u && i >= s.rows) {
    return MASKED;
  }
  return sink_logit(h);
}

// Closes a row's online softmax: (factor for the unnormalised o, lse). The sink only joins
// the denominator. Nothing visible and no sink: factor 0, lse -inf. A row that saw a NaN
// logit (its sum l is NaN): NaN, NaN.
fn finish_row(m: f32, l: f32, sink_l: f32) -> vec2<f32> {
  if (is_nan(l) || is_nan(m)) {
    return vec2<f32>(nan_f32());
  }
  let mf = max(m, sink_l);
  if (mf <= MASKED) {
    return vec2<f32>(0.0, neg_inf());
  }
  let lf = l * exp(m - mf) + exp(sink_l - mf);
  return vec2<f32>(exp(m - mf) / lf, mf + log(lf));
}

// Masked-block lists (blk_range / blk_entry are generated; stubs without a list). Row of
// the list for (batch b, query head h, query tile qt): the bias's own broadcast rows.
fn blk_row(b: u32, h: u32, qt: u32, n_qt: u32) -> u32 {
  let hb = select(1u, P.num_heads, P.bias_sh != 0u);
  let bb = select(0u, b, P.bias_sb != 0u);
  let hh = select(0u, h, P.bias_sh != 0u);
  return (bb * hb + hh) * n_qt + qt;
}

// First index in [lo, hi) of the (ascending) list whose block id is >= kb.
fn blk_lower(lo: u32, hi: u32, kb: u32) -> u32 {
  var a = lo;
  var z = hi;
  while (a < z) {
    let mid = (a + z) / 2u;
    if ((blk_entry(mid) & 0x7fffffffu) < kb) {
      a = mid + 1u;
    } else {
      z = mid;
    }
  }
  return a;
}

// [first, last) entries of list row r whose blocks (of bk keys) meet keys [klo, khi).
fn blk_span(r: u32, klo: u32, khi: u32, bk: u32) -> vec2<u32> {
  let rg = blk_range(r);
  if (khi <= klo) {
    return vec2<u32>(rg.x, rg.x);
  }
  let first = blk_lower(rg.x, rg.y, klo / bk);
  let last = blk_lower(first, rg.y, cdiv(khi, bk));
  return vec2<u32>(first, last);
}
