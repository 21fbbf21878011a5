// Inputs and math shared by the attention families (flash_prefill and the decode ones); the
// per-key half (granules, logits, indexing, sinks, block lists) is attn_keys.wgsl.
// The generated prefix defines: T (compute dtype: f16 for float16, f32 for float32 and
// bfloat16), GV (the load granule of GRANULE elements, GRANULE_VEC4S vec4s), g_part() (a part
// as vec4<T>), TS / ts_part() / ts_f32() (a vec4 of a staged K/V tile in workgroup memory: as
// computed, or bfloat16's bits, widened by ts_f32 where read), QK_DIM / QK_VEC4S /
// QK_GRANULES (head size in elements, vec4s, granules: q and k rows), V_DIM / V_VEC4S /
// V_GRANULES (the same of v's and out's rows: v_head_size), the Params struct
// (backends/common.py, shared with OpenCL) and the family's bindings, declared from
// attnreg/ports.py: P, q, k, v
// (as stored), bias (float32: a float16 bias is widened on the host, exactly), seqlens, sink,
// k_scale/v_scale (quantized K/V only), and the family's outputs. Kernels read q, k, v only
// through load_q/load_k/load_v(granule) and write out only through store_out(vec4 index, x):
// the prefix's helpers widen bf16, dequantize int8/int4 K/V and round the output
// (backends/webgpu/wgsl_io.py), so one source serves every storage. kv_first(b) / q_rows(b)
// read kv_start / seqlens_q where bound, with KV_START / Q_ROWS 1; else they are the
// constants 0 / seq_len and the tests below that need them fold away.

// Logits are clamped to MASKED instead of -inf: finite arithmetic everywhere, so no driver's
// handling of inf - inf or exp(-inf) can turn a masked row into NaN.
const MASKED: f32 = -3.0e38;

fn neg_inf() -> f32 {
  // Through a let: Tint rejects a constant expression whose value is infinite (naga does
  // not check), so the bits must not be folded at compile time.
  let bits = 0xff800000u;
  return bitcast<f32>(bits);
}

// Non-finite values (docs/contract.md "Non-finite values and scalar fields"): what a row sees
// poisons it, what it cannot see never reaches it. WGSL lets implementations assume there is no
// NaN or inf (lavapipe folds x * 0.0 and x - x to 0, turns NaN != 0 false and drops NaN in max
// and clamp), so NaN is tested and made with integer bit tests and selects, never float compares
// or arithmetic.
fn nan_f32() -> f32 {
  let bits = 0x7fc00000u;       // through a let, as neg_inf
  return bitcast<f32>(bits);
}

fn is_nan(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// NaN or +inf: a logit, lse or weight that poisons its row.
fn is_poison(x: f32) -> bool {
  let u = bitcast<u32>(x);
  return u == 0x7f800000u || (u & 0x7fffffffu) > 0x7f800000u;
}

// Output writers: a non-finite value (a visible v of inf or NaN) is written as NaN.
fn finite_or_nan4(x: vec4<f32>) -> vec4<f32> {
  let e = bitcast<vec4<u32>>(x) & vec4<u32>(0x7f800000u);
  return select(x, vec4<f32>(nan_f32()), e == vec4<u32>(0x7f800000u));
}

// exp(x - m) for a softmax weight, NaN where the logit x is NaN (whatever exp does with it).
fn weight_of(x: f32, m: f32) -> f32 {
  return select(exp(x - m), x, is_nan(x));
}

fn cdiv(a: u32, b: u32) -> u32 {
  return (a + b - 1u) / b;
}

// L_b: keys at or beyond it do not exist and are never loaded.
fn valid_len(b: u32) -> u32 {
  if (P.has_seqlens != 0u) {
    return u32(seqlens[b]);
  }
  return P.total_len;
}

// Batch entry b's keys and rows: keys [lo, len) exist (kv_start[b], L_b; keys before lo
// are left padding and never loaded), rows [0, rows) are queries (S_b; rows past it are
// padding: they see no key, take no sink, and their q is never loaded).
struct Seq {
  lo: u32,
  len: u32,
  rows: u32,
}

fn seq_of(b: u32) -> Seq {
  return Seq(kv_first(b), valid_len(b), q_rows(b));
}

// Position of query row i: the S_b queries are the last S_b tokens of the valid length.
// A padding row's position is >= len (key_visible and row_span test that).
fn row_pos(s: Seq, i: u32) -> i32 {
  return i32(s.len) - i32(s.rows) + i32(i);
}

// min(hi, pos + right_window + 1): the end of the keys a row at pos may see on the right
// (two-sided windows), or hi without a right window. Compared as a difference, so a window
// near 2**31 never overflows (pos >= 0: the S_b rows are the last of L_b >= S_b keys).
fn right_end(pos: i32, hi: i32) -> i32 {
  if (P.right_window >= 0 && P.right_window < hi - pos) {
    return pos + P.right_window + 1;
  }
  return hi;
}

// Keys [lo, hi) of the existing keys [s.lo, s.len) that lie neither left of the local window
// of a row at left_pos nor right of the causal diagonal or right window of a row at
// right_pos: the spans below differ only in which rows set the two edges.
fn window_span(s: Seq, left_pos: i32, right_pos: i32) -> vec2<i32> {
  var hi = i32(s.len);
  if (P.causal != 0u) {
    hi = min(hi, right_pos + 1);
  }
  hi = right_end(right_pos, hi);
  var lo = i32(s.lo);
  if (P.local_window > 0) {
    lo = max(lo, left_pos - P.local_window + 1);
  }
  return vec2<i32>(lo, hi);
}

// [lo, hi) of the keys that rows i_first..i_last can see: whole tiles outside it are
// skipped by loop bounds (kv_start, causal diagonal, seqlens_k, the windows, padding rows),
// and keys outside it are never loaded (zeros stand in for them).
fn key_span(s: Seq, i_first: u32, i_last: u32) -> vec2<i32> {
  var last = i_last;
  if (Q_ROWS == 1u) {
    if (i_first >= s.rows) {
      return vec2<i32>(i32(s.lo), i32(s.lo));     // padding rows only: nothing to see
    }
    last = min(i_last, s.rows - 1u);
  }
  let span = window_span(s, row_pos(s, i_first), row_pos(s, last));
  return vec2<i32>(span.x, max(span.x, span.y));
}

// [lo, hi) of the keys that every row i_first..i_last sees. P.V multiplies a tile's weights
// with its values unmasked only when the tile's loaded keys lie inside it: elsewhere a row's
// weight of 0 for a key it cannot see would meet that key's value (0 * NaN = NaN), so those
// tiles (the causal diagonal, the window's edge, any tile of a row tile with a padding row)
// select each contribution by visibility. (Either window's edge: the right one is the
// first row's, the left one the last row's.)
fn common_span(s: Seq, i_first: u32, i_last: u32) -> vec2<i32> {
  if (Q_ROWS == 1u && i_last >= s.rows) {
    return vec2<i32>(0, 0);             // a padding row sees nothing
  }
  return window_span(s, row_pos(s, i_last), row_pos(s, i_first));
}

// Whether every key of [a, b) inside span (the loaded keys) lies in seen_all (common_span).
fn all_see(a: u32, b: u32, span: vec2<i32>, seen_all: vec2<i32>) -> bool {
  let lo = max(i32(a), span.x);
  let hi = min(i32(b), span.y);
  return hi <= lo || (lo >= seen_all.x && hi <= seen_all.y);
}

// One workgroup of a split-KV decode family (decode_partial, decode_qk, decode_pv): split t,
// row tile rt of m query rows, chunk hc of gt query heads, kv head kvh, batch b; klo/khi
// bound the split's keys that the row tile can see. ok is false past the end of the grid.
struct DecodeWg {
  ok: bool,
  t: u32,
  rt: u32,
  n_rt: u32,
  hc: u32,
  kvh: u32,
  b: u32,
  seq: Seq,
  i0: u32,
  span: vec2<i32>,
  seen_all: vec2<i32>,
  klo: u32,
  khi: u32,
}

// One workgroup of a flash prefill (flash_prefill, flash_prefill_mma): row tile rt of br
// query rows (of n_rt), query head h, its kv head kvh, batch b; keys [span.x, span.y) are
// the ones its rows can see. ok is false past the end of the grid. Row tiles run last-first
// across the whole grid (every head and batch of the last tile, then of the one before, ..):
// under causal masking the late tiles have the most keys, and the longest work then starts
// first instead of leaving the last head's heavy tiles to run alone at the end.
struct PrefillWg {
  ok: bool,
  rt: u32,
  n_rt: u32,
  h: u32,
  kvh: u32,
  b: u32,
  seq: Seq,
  i0: u32,
  span: vec2<i32>,
}

fn prefill_wg(wid: vec3<u32>, nwg: vec3<u32>, br: u32) -> PrefillWg {
  var w = PrefillWg();
  w.n_rt = cdiv(P.seq_len, br);
  // Grids past 65535 workgroups are folded into y/z; unfold to one linear id.
  let lin = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
  if (lin >= w.n_rt * P.num_heads * P.batch) {
    return w;
  }
  w.ok = true;
  w.h = lin % P.num_heads;
  w.b = (lin / P.num_heads) % P.batch;
  w.rt = w.n_rt - 1u - lin / (P.num_heads * P.batch);
  w.kvh = w.h / P.group_size;
  w.seq = seq_of(w.b);
  w.i0 = w.rt * br;
  w.span = key_span(w.seq, w.i0, min(w.i0 + br, P.seq_len) - 1u);
  return w;
}

// The tile sizes come in as arguments: every family including this file compiles this
// function, and flash_prefill's prefix defines no M or GT.
fn decode_wg(wid: vec3<u32>, nwg: vec3<u32>, m: u32, gt: u32) -> DecodeWg {
  var d = DecodeWg();
  d.n_rt = cdiv(P.seq_len, m);
  let n_hc = cdiv(P.group_size, gt);
  // Grids past 65535 workgroups are folded into y/z; unfold to one linear id.
  let lin = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
  if (lin >= P.n_splits * d.n_rt * n_hc * P.kv_num_heads * P.batch) {
    return d;
  }
  d.ok = true;
  d.t = lin % P.n_splits;
  var rest = lin / P.n_splits;
  d.rt = rest % d.n_rt;
  rest = rest / d.n_rt;
  d.hc = rest % n_hc;
  rest = rest / n_hc;
  d.kvh = rest % P.kv_num_heads;
  d.b = rest / P.kv_num_heads;
  d.seq = seq_of(d.b);
  d.i0 = d.rt * m;
  d.span = key_span(d.seq, d.i0, min(d.i0 + m, P.seq_len) - 1u);
  d.seen_all = common_span(d.seq, d.i0, min(d.i0 + m, P.seq_len) - 1u);
  let split_lo = d.t * P.split_size;
  d.klo = max(split_lo, u32(d.span.x));
  d.khi = min(min(split_lo + P.split_size, P.capacity), u32(d.span.y));
  return d;
}
