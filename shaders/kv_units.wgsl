// Pieces of the generated prefix for K/V as a lane's register tiles hold them, beside
// storage.wgsl's loads (backends/webgpu/wgsl_io.py picks them per spec; $x is the tensor a
// piece serves, k or v, $row the constant of its row length).
//
// The staged families' register tiles (K/V loaded a tile ahead, stored to workgroup memory
// after the next barrier) hold granules as loaded, RG: raw_$x(g) is granule g so, and
// granule_of(r) its values, taken where the granule is stored. Arithmetic on a loaded value
// makes the lane wait for the load where it stands (ku_scale_* below says what that cost the
// direct decode), so quantized granules are dequantized at the store, not at the load.
//
// The load units of the direct decode_partial (decode_qk_common's k_reg, decode_pv_common's
// v_reg): KU, UNIT_VEC4S vec4s of values as loaded; ku_part(x, s) its vec4 s without the
// scale, ku_$x(e) the unit whose first element is e, ku_scale_$x(e) its scale as loaded and
// scale_of_$x that scale as f32. Wide (K/V bound as array<vec4<u32>>, wgsl_io.kv_unit): 16
// raw bytes, converted where used (4 f32, 8 f16 or bf16, 16 int8 codes of one vector, or one
// whole q4_0 block of 32 int4 codes), so a lane issues one 16-byte load per unit, holds it in
// 4 registers and applies a quantized unit's scale once. Otherwise a granule as load_$x
// returns it (dequantized: scale 1).
// A scale "as loaded" is (the word read, the shift of its half): the register tiles are
// loaded a tile ahead, and any arithmetic on a loaded value where it is loaded (int4's
// unpack2x16float of its half) makes the lane wait for that load there, a tile early. On the
// H200 that put int4's loads alone at 60 us against 26 without the scales (Dawn, L=32768,
// ci/results/h200_wgsl_decode_int4_scales.txt).

// piece: raw_plain
// Float K/V: a granule as loaded is its values.
alias RG = GV;
fn granule_of(r: RG) -> GV {
  return r;
}

// piece: raw_load_plain
fn raw_$x(g: u32) -> RG {
  return load_$x(g);
}

// piece: raw_quant
// Quantized K/V: the granule's words of codes (w.y unused where a granule is one word) and
// its scale as loaded: the scale's word and the shift of its half (int4), int4's nibble shift
// in bits 8.. of s.y.
struct RG {
  w: vec2<u32>,
  s: vec2<u32>,
}

// piece: raw_int8
fn granule_of(r: RG) -> GV {
  let s = bitcast<f32>(r.s.x);
  return gv_of(i8x4(r.w.x) * s, i8x4(r.w.y) * s);
}

// piece: raw_int4
fn granule_of(r: RG) -> GV {
  let s = unpack2x16float(r.s.x >> (r.s.y & 0xffu)).x;
  let sh = r.s.y >> 8u;
  return gv_of(i4x4(r.w.x, sh) * s, i4x4(r.w.y, sh) * s);
}

// piece: raw_load_int8
// One scale per vector: k's are QK_DIM elements long, v's V_DIM ($row). A granule of 8 takes a
// second word, one of 4 only the first.
fn raw_$x(g: u32) -> RG {
  let e0 = g * GRANULE;
  let w = e0 / 4u;
  var w1 = 0u;
  if (GRANULE == 8u) {
    w1 = ${x}_word(w + 1u);
  }
  return RG(vec2<u32>(${x}_word(w), w1), vec2<u32>(bitcast<u32>(${x}_scale[e0 / $row]), 0u));
}

// piece: raw_load_int4
// Block blk of 32 elements: 16 bytes of codes (4 words), a float16 scale (two per word).
fn raw_$x(g: u32) -> RG {
  let e0 = g * GRANULE;
  let blk = e0 / 32u;
  let r = e0 % 32u;
  let w = blk * 4u + (r % 16u) / 4u;
  let sh = select(0u, 4u, r >= 16u);
  var w1 = 0u;
  if (GRANULE == 8u) {
    w1 = ${x}_word(w + 1u);
  }
  return RG(vec2<u32>(${x}_word(w), w1),
            vec2<u32>(${x}_scale[blk / 2u], ((blk % 2u) * 16u) | (sh << 8u)));
}

// piece: unit_granule
alias KU = GV;
const UNIT_VEC4S: u32 = GRANULE_VEC4S;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return vec4<f32>(g_part(x, s));
}

// piece: unit_float32
alias KU = vec4<u32>;
const UNIT_VEC4S: u32 = 1u;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return bitcast<vec4<f32>>(x);
}

// piece: unit_float16
alias KU = vec4<u32>;
const UNIT_VEC4S: u32 = 2u;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return vec4<f32>(unpack2x16float(x[2u * s]), unpack2x16float(x[2u * s + 1u]));
}

// piece: unit_bfloat16
alias KU = vec4<u32>;
const UNIT_VEC4S: u32 = 2u;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return bf16x4(vec2<u32>(x[2u * s], x[2u * s + 1u]));
}

// piece: unit_int8
alias KU = vec4<u32>;
const UNIT_VEC4S: u32 = 4u;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return i8x4(x[s]);
}

// piece: unit_int4
// vec4 s < 4: the low nibbles of word s (elements 4s..), s >= 4: the high ones (16 + ...).
alias KU = vec4<u32>;
const UNIT_VEC4S: u32 = 8u;
fn ku_part(x: KU, s: u32) -> vec4<f32> {
  return i4x4(x[s % 4u], (s / 4u) * 4u);
}

// piece: ku_granule
fn ku_$x(e: u32) -> KU {
  return load_$x(e / GRANULE);
}
fn ku_scale_$x(e: u32) -> vec2<u32> {
  return vec2<u32>(0x3f800000u, 0u);    // 1.0
}
fn scale_of_$x(s: vec2<u32>) -> f32 {
  return bitcast<f32>(s.x);
}

// piece: ku_float
fn ku_$x(e: u32) -> KU {
  return $x[e / (4u * UNIT_VEC4S)];
}
fn ku_scale_$x(e: u32) -> vec2<u32> {
  return vec2<u32>(0x3f800000u, 0u);    // 1.0
}
fn scale_of_$x(s: vec2<u32>) -> f32 {
  return bitcast<f32>(s.x);
}

// piece: ku_int8
fn ku_$x(e: u32) -> KU {
  return $x[e / 16u];
}
fn ku_scale_$x(e: u32) -> vec2<u32> {
  return vec2<u32>(bitcast<u32>(${x}_scale[e / $row]), 0u);
}
fn scale_of_$x(s: vec2<u32>) -> f32 {
  return bitcast<f32>(s.x);
}

// piece: ku_int4
fn ku_$x(e: u32) -> KU {
  return $x[e / 32u];
}
fn ku_scale_$x(e: u32) -> vec2<u32> {
  let blk = e / 32u;
  return vec2<u32>(${x}_scale[blk / 2u], (blk % 2u) * 16u);
}
fn scale_of_$x(s: vec2<u32>) -> f32 {
  return unpack2x16float(s.x >> s.y).x;
}

// V's units (decode_pv_common's v_reg): VU, VUNIT_VEC4S vec4s of values; vu_part(x, s)
// its vec4 s unscaled, vu_col(gi, s) that vec4's column in the row for unit gi of the row,
// vu_v(e, gi) unit gi of the row whose first element is e, vu_scale_v(e, gi) its scale. A
// PV lane accumulates every column of its units for every query vector, so quantized V is
// read in units of 8 values (two vec4 columns, f16's granule): int8 8 codes (v bound as
// array<vec2<u32>>), int4 one word of a q4_0 block (v as array<u32>): its 4 low nibbles
// are elements 4w.. of the block, its high ones 16 + 4w.. (columns 8 blk + w and + 4).

// piece: vunit_k
// V's units are K's (float K/V, or granules).
alias VU = KU;
const VUNIT_VEC4S: u32 = UNIT_VEC4S;
fn vu_part(x: VU, s: u32) -> vec4<f32> {
  return ku_part(x, s);
}
fn vu_col(gi: u32, s: u32) -> u32 {
  return gi * VUNIT_VEC4S + s;
}
fn vu_v(e: u32, gi: u32) -> VU {
  return ku_v(e + gi * VUNIT_VEC4S * 4u);
}
fn vu_scale_v(e: u32, gi: u32) -> vec2<u32> {
  return ku_scale_v(e + gi * VUNIT_VEC4S * 4u);
}

// piece: vunit_int8
alias VU = vec2<u32>;
const VUNIT_VEC4S: u32 = 2u;
fn vu_part(x: VU, s: u32) -> vec4<f32> {
  return i8x4(x[s]);
}
fn vu_col(gi: u32, s: u32) -> u32 {
  return gi * 2u + s;
}
fn vu_v(e: u32, gi: u32) -> VU {
  return v[e / 8u + gi];
}
fn vu_scale_v(e: u32, gi: u32) -> vec2<u32> {
  return vec2<u32>(bitcast<u32>(v_scale[e / V_DIM]), 0u);
}
fn scale_of_v(s: vec2<u32>) -> f32 {
  return bitcast<f32>(s.x);
}

// piece: vunit_int4
alias VU = u32;
const VUNIT_VEC4S: u32 = 2u;
fn vu_part(x: VU, s: u32) -> vec4<f32> {
  return i4x4(x, s * 4u);
}
fn vu_col(gi: u32, s: u32) -> u32 {
  return (gi / 4u) * 8u + gi % 4u + 4u * s;
}
fn vu_v(e: u32, gi: u32) -> VU {
  return v[e / 8u + gi];
}
fn vu_scale_v(e: u32, gi: u32) -> vec2<u32> {
  let blk = e / 32u + gi / 4u;
  return vec2<u32>(v_scale[blk / 2u], (blk % 2u) * 16u);
}
fn scale_of_v(s: vec2<u32>) -> f32 {
  return unpack2x16float(s.x >> s.y).x;
}

// piece: word_v8
// Word w of int8 V codes bound as array<vec2<u32>> (vunit_int8).
fn ${x}_word(w: u32) -> u32 {
  return $x[w / 2u][w % 2u];
}

// piece: load_wide_float32
// The granule loads where float K/V are bound wide (compiled, unused, beside the units).
fn load_$x(g: u32) -> GV {
  return bitcast<vec4<f32>>($x[g]);
}

// piece: load_wide_float16
fn load_$x(g: u32) -> GV {
  let w = $x[g];
  return gv_of(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
               vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)));
}

// piece: load_wide_bfloat16
fn load_$x(g: u32) -> GV {
  return $x[g];
}
