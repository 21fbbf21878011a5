// quantize_kv: float K/V vectors -> the codes and scales of a quantized KV cache, written at
// the destination vectors the host lists (KVCache.append; backends/webgpu/quantize.py).
// The builder (backends/webgpu/program.py) declares VEC_DIM (head size), IN_DTYPE (the input: 0
// float32, 1 float16, 2 bfloat16), QUANT (1 int8, 2 int4), THREADS, the bindings (job, src,
// codes, scales) and put_scale from shaders/storage.wgsl (a plain word store for int8's f32
// scales; two atomics for int4's f16 halves, because two blocks share a word).
//
// src: rows [R] (destination vector of source vector r) at word 0, the job's data (R * VEC_DIM
// values in IN_DTYPE, packed in words) at word job.data_off. Stores are whole words: an int8
// vector is VEC_DIM bytes (VEC_DIM % 4 == 0) and an int4 block 16 bytes, so no two
// invocations share a code word. Inputs are finite (the host checked). Rounding follows
// attnreg.quantize_kv: round() is half-to-even in WGSL, the f16 scale is rounded to nearest
// even here (f16_bits) rather than by pack2x16float, whose rounding WGSL leaves to the
// implementation.

struct Job {
  rows: u32,        // R: source vectors
  count: u32,       // invocations: R (int8) or R * VEC_DIM / 32 blocks (int4)
  data_off: u32,    // word offset of the job's values in src
  pad: u32,
};

// Value i of the job (flat over [R, VEC_DIM]).
fn load_x(i: u32) -> f32 {
  if (IN_DTYPE == 0u) {
    return bitcast<f32>(src[job.data_off + i]);
  }
  let w = src[job.data_off + i / 2u];
  let odd = (i & 1u) == 1u;
  if (IN_DTYPE == 1u) {
    let p = unpack2x16float(w);
    return select(p.x, p.y, odd);
  }
  return bitcast<f32>(select(w << 16u, w & 0xffff0000u, odd));
}

// a / 127 correctly rounded (numpy's float32 division), from WGSL's 2.5-ulp quotient: the
// residual a - 127 * s is exact (s split into 12-bit halves, so every product is exact and
// the subtraction cancels exactly), and says whether s is more than half an ulp away.
fn div127(a: f32) -> f32 {
  var s = a / 127.0;
  if (a < 1.0e-30) {
    return s;           // near f32's subnormals, where devices may flush: left as is
  }
  for (var k = 0u; k < 4u; k++) {
    let hi = bitcast<f32>(bitcast<u32>(s) & 0xfffff000u);
    let r = (a - hi * 127.0) - (s - hi) * 127.0;
    let up = bitcast<f32>(bitcast<u32>(s) + 1u);
    let down = bitcast<f32>(bitcast<u32>(s) - 1u);
    if (r > (up - s) * 63.5) {
      s = up;
    } else if (r < -((s - down) * 63.5)) {
      s = down;
    } else {
      break;
    }
  }
  return s;
}

// float32 -> float16 bits, round to nearest even (finite inputs; overflow gives inf).
fn f16_bits(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  let sign = (b >> 16u) & 0x8000u;
  let a = b & 0x7fffffffu;
  if (a >= 0x477ff000u) {
    return sign | 0x7c00u;                     // >= 65520: rounds to inf
  }
  var mant: u32;
  var shift: u32;
  if (a >= 0x38800000u) {                      // normal f16: rebias the exponent
    mant = a - 0x38000000u;
    shift = 13u;
  } else {
    let e = a >> 23u;
    if (e < 102u) {
      return sign;                             // below half the smallest subnormal
    }
    mant = (a & 0x7fffffu) | 0x800000u;        // subnormal f16: units of 2^-24
    shift = 126u - e;
  }
  let r = mant >> shift;
  let rem = mant & ((1u << shift) - 1u);
  let half = 1u << (shift - 1u);
  let up = select(0u, 1u, rem > half || (rem == half && (r & 1u) == 1u));
  return sign | (r + up);               // a carry moves into the exponent, as it should
}

// int8: one invocation per vector; its max |x|, the scale, then VEC_DIM/4 words of 4 codes.
fn quant_int8(r: u32) {
  let dst = src[r];
  let base = r * VEC_DIM;
  var amax = 0.0;
  for (var i = 0u; i < VEC_DIM; i++) {
    amax = max(amax, abs(load_x(base + i)));
  }
  let s = div127(amax);
  put_scale(dst, bitcast<u32>(s));
  for (var w = 0u; w < VEC_DIM / 4u; w++) {
    var word = 0u;
    for (var k = 0u; k < 4u; k++) {
      let q = clamp(round(load_x(base + 4u * w + k) / s), -127.0, 127.0);
      let c = select(0, i32(q), s > 0.0);
      word = word | ((bitcast<u32>(c) & 0xffu) << (8u * k));
    }
    codes[dst * (VEC_DIM / 4u) + w] = word;
  }
}

fn code4(x: f32, s: f32) -> u32 {
  if (s == 0.0) {
    return 8u;
  }
  return u32(clamp(round(x / s) + 8.0, 0.0, 15.0));
}

// int4: one invocation per block of 32: the element of largest magnitude m, the f16 scale
// m / -8 (rounded, then used rounded), 4 words of packed nibbles.
fn quant_int4(t: u32) {
  let nb = VEC_DIM / 32u;
  let r = t / nb;
  let j = t % nb;
  let dst = src[r] * nb + j;
  let base = r * VEC_DIM + j * 32u;
  var m = load_x(base);                        // the first element, as argmax starts:
  var am = abs(m);                             // the sign of an all-zero block's scale
  for (var i = 1u; i < 32u; i++) {
    let x = load_x(base + i);
    if (abs(x) > am) {                         // the first of equal magnitudes, like argmax
      am = abs(x);
      m = x;
    }
  }
  let bits = f16_bits(m * -0.125);
  put_scale(dst, bits);
  let s = unpack2x16float(bits).x;
  for (var w = 0u; w < 4u; w++) {
    var word = 0u;
    for (var k = 0u; k < 4u; k++) {
      let i = 4u * w + k;                      // byte i: element i (low), i + 16 (high)
      let lo = code4(load_x(base + i), s);
      let hi = code4(load_x(base + i + 16u), s);
      word = word | ((lo | (hi << 4u)) << (8u * k));
    }
    codes[dst * 4u + w] = word;
  }
}

// Invocation t < count (utility_common.wgsl): vector t (int8) or block t (int4).
fn job_item(t: u32) {
  if (QUANT == 1u) {
    quant_int8(t);
  } else {
    quant_int4(t);
  }
}
