// Pieces of the generated prefix that say how a program touches its tensors in memory
// (backends/webgpu/wgsl_io.py picks them per spec; its docstring gives the formats). $x in a
// piece is the tensor it serves (q, k, v), $row the constant of that tensor's row length.
//
// Compute types: T (what the kernels compute in), the load granule GV (its element count
// GRANULE follows the piece: 4 for float32, else 8), g_part (vec4 s of a granule as vec4<T>)
// and gv_of (a granule of dequantized values); TS, the staged vec4 that K/V tiles hold in
// workgroup memory, with ts_part (vec4 s of a granule as staged) and ts_f32 (a staged vec4
// read back as vec4<f32>).

// piece: compute_f32
alias T = f32;
alias GV = vec4<f32>;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g;
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return a;
}
alias TS = vec4<f32>;
fn ts_part(g: GV, s: u32) -> TS {
  return g;
}
fn ts_f32(x: TS) -> vec4<f32> {
  return x;
}

// piece: compute_f16
enable f16;
// f16 loads 16-byte granules of 8 halves as a mat2x4<f16> (two vec4 columns), so f32 and
// f16 move 16 bytes per load instruction.
alias T = f16;
alias GV = mat2x4<f16>;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g[s];
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return GV(vec4<f16>(a), vec4<f16>(b));
}
alias TS = vec4<f16>;
fn ts_part(g: GV, s: u32) -> TS {
  return g[s];
}
fn ts_f32(x: TS) -> vec4<f32> {
  return vec4<f32>(x);
}

// piece: compute_bf16
// bf16 K/V as stored: a granule is 16 bytes of 8 bf16 bits (vec4<u32>), the f16 granule's
// size, held as bits in the register tile and staged as bits (a vec2<u32> per vec4 of
// values, f16's 8 bytes): widened to f32 only where a value is used. So loads, registers
// and workgroup memory are f16's, and the plans' tiles too.
alias T = f32;
alias GV = vec4<u32>;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return bf16x4(ts_part(g, s));
}
alias TS = vec2<u32>;
fn ts_part(g: GV, s: u32) -> TS {
  return select(g.zw, g.xy, s == 0u);
}
fn ts_f32(x: TS) -> vec4<f32> {
  return bf16x4(x);
}

// piece: compute_bf16q
// bf16 with quantized K/V: the K/V loads dequantize into f32 (not representable as bf16 bits
// without rounding), so granules of 8 are f32 pairs and tiles stage f32; q is widened on
// load.
alias T = f32;
alias GV = mat2x4<f32>;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g[s];
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return GV(a, b);
}
alias TS = vec4<f32>;
fn ts_part(g: GV, s: u32) -> TS {
  return g[s];
}
fn ts_f32(x: TS) -> vec4<f32> {
  return x;
}

// piece: bf16_in
fn bf16x4(w: vec2<u32>) -> vec4<f32> {
  return vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u),
                   bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u));
}
fn bf16x8(w: vec4<u32>) -> mat2x4<f32> {
  return mat2x4<f32>(bf16x4(w.xy), bf16x4(w.zw));
}

// piece: bf16_out
// Round to nearest even on the bits; NaN as the canonical quiet NaN (its bits + 0x7fff
// could carry into the exponent and make it inf).
fn bf16_bits(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0u;
  }
  return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
fn bf16_pack(x: vec4<f32>) -> vec2<u32> {
  return vec2<u32>(bf16_bits(x.x) | (bf16_bits(x.y) << 16u),
                   bf16_bits(x.z) | (bf16_bits(x.w) << 16u));
}

// piece: i8
// Four int8 codes of a word (little-endian) as f32, exactly and without integer-to-float
// conversions (a fraction of the FMA rate on GPUs): code c + 128 (the sign bit flipped) is
// the low mantissa of 2^23 + c + 128, from which 2^23 + 128 is subtracted. unpack4xI8 is not
// in every compiler's WGSL.
fn i8x4(w: u32) -> vec4<f32> {
  let u = (vec4<u32>(w ^ 0x80808080u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
  return bitcast<vec4<f32>>(u | vec4<u32>(0x4b000000u)) - vec4<f32>(8388736.0);
}

// piece: i4
// Four int4 codes: the low (sh 0) or high (sh 4) nibbles of a word's 4 bytes, minus 8, as f32
// through the mantissa as i8x4 does (2^23 + n - (2^23 + 8)).
fn i4x4(w: u32, sh: u32) -> vec4<f32> {
  let n = (vec4<u32>(w) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(0xfu);
  return bitcast<vec4<f32>>(n | vec4<u32>(0x4b000000u)) - vec4<f32>(8388616.0);
}

// piece: load_plain
fn load_$x(g: u32) -> GV {
  return $x[g];
}

// piece: load_halves
// f16 bound as an array of halves (the direct matrix prefill's q, which subgroup
// matrices load from storage): a granule from its 8 halves.
fn load_$x(g: u32) -> GV {
  let e = g * 8u;
  return GV(vec4<f16>($x[e], $x[e + 1u], $x[e + 2u], $x[e + 3u]),
            vec4<f16>($x[e + 4u], $x[e + 5u], $x[e + 6u], $x[e + 7u]));
}

// piece: load_widened
// bf16 q beside dequantized K/V (compute_bf16q): the stored bits widened to the granule.
fn load_$x(g: u32) -> GV {
  return bf16x8($x[g]);
}

// piece: load_quant
// A granule of quantized codes dequantized where it is loaded (the direct reads); the staged
// tiles hold raw_$x's granule and dequantize it where they store it (kv_units.wgsl).
fn load_$x(g: u32) -> GV {
  return granule_of(raw_$x(g));
}

// piece: word_narrow
// Word w of quantized K/V codes bound as array<u32>.
fn ${x}_word(w: u32) -> u32 {
  return $x[w];
}

// piece: word_wide
// Word w of quantized K/V codes bound as array<vec4<u32>> (kv_units.wgsl's wide units).
fn ${x}_word(w: u32) -> u32 {
  return $x[w / 4u][w % 4u];
}

// piece: store_float32
fn store_out(i: u32, x: vec4<f32>) {
  out[i] = x;
}

// piece: store_float16
fn store_out(i: u32, x: vec4<f32>) {
  out[i] = vec4<f16>(x);
}

// piece: store_bfloat16
fn store_out(i: u32, x: vec4<f32>) {
  out[i] = bf16_pack(x);
}

// piece: put_scale_word
// int8's f32 scale of vector i: a whole word.
fn put_scale(i: u32, bits: u32) {
  scales[i] = bits;
}

// piece: put_scale_half
// int4's f16 scale of block i: half a word that two invocations (two blocks) write, so each
// clears and sets its own half with atomics (the order of the two does not matter: disjoint
// bits).
fn put_scale(i: u32, bits: u32) {
  let sh = (i & 1u) * 16u;
  atomicAnd(&scales[i / 2u], ~(0xffffu << sh));
  atomicOr(&scales[i / 2u], bits << sh);
}
