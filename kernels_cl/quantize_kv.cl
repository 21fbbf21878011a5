// quantize_kv: float K/V vectors -> the codes and scales of a quantized KV cache, written at
// the destination vectors the host lists (KVCache.append; backends/opencl/quantize.py).
// Build options: -D HD (head size), -D DT (input: 0 float32, 1 float16, 2 bfloat16).
// No cl_khr_fp16: halves are read with vload_half and the f16 scales stored with
// vstore_half_rte (round to nearest even, like numpy's float16 cast).
//
// staging: rows [n_rows] int32 (destination vector of source vector r) at byte 0, the job's
// values (n_rows * HD in DT) at byte x_off. Inputs are finite (the host checked). Rounding
// follows attnreg.quantize_kv: rint() is half-to-even.

#if DT == 1
#define LOADX(p, i) vload_half((i), (const __global half*)(p))
#elif DT == 2
#define LOADX(p, i) as_float(((uint)((const __global ushort*)(p))[i]) << 16)
#else
#define LOADX(p, i) (((const __global float*)(p))[i])
#endif

// a / 127 correctly rounded (numpy's float32 division) from OpenCL's 2.5-ulp quotient: the
// residual a - 127 * s is exact (s split into 12-bit halves: every product is exact and the
// subtraction cancels exactly) and says whether s is more than half an ulp away.
inline float div127(const float a) {
  float s = a / 127.0f;
  if (a < 1.0e-30f) {
    return s;           // near f32's subnormals, where devices may flush: left as is
  }
  for (int k = 0; k < 4; ++k) {
    const float hi = as_float(as_uint(s) & 0xfffff000u);
    const float r = (a - hi * 127.0f) - (s - hi) * 127.0f;
    const float up = as_float(as_uint(s) + 1u);
    const float down = as_float(as_uint(s) - 1u);
    if (r > (up - s) * 63.5f) {
      s = up;
    } else if (r < -((s - down) * 63.5f)) {
      s = down;
    } else {
      break;
    }
  }
  return s;
}

// int8: one work-item per vector: max |x|, the f32 scale, HD codes (byte stores).
__kernel void quantize_int8(const __global uchar* staging, const uint n_rows, const uint x_off,
                            __global char* codes, __global float* scales) {
  const uint r = get_global_id(0);
  if (r >= n_rows) {
    return;
  }
  const __global uchar* x = staging + x_off;
  const uint dst = (uint)((const __global int*)staging)[r];
  const uint base = r * HD;
  float amax = 0.0f;
  for (uint i = 0; i < HD; ++i) {
    amax = fmax(amax, fabs(LOADX(x, base + i)));
  }
  const float s = div127(amax);
  scales[dst] = s;
  for (uint i = 0; i < HD; ++i) {
    const float q = clamp(rint(LOADX(x, base + i) / s), -127.0f, 127.0f);
    codes[(size_t)dst * HD + i] = s > 0.0f ? (char)(int)q : (char)0;
  }
}

inline uchar code4(const float x, const float s) {
  return s == 0.0f ? (uchar)8 : (uchar)(int)clamp(rint(x / s) + 8.0f, 0.0f, 15.0f);
}

// int4: one work-item per block of 32: the element of largest magnitude m, the f16 scale
// m / -8 (stored rounded, then used rounded), 16 bytes of packed nibbles.
__kernel void quantize_int4(const __global uchar* staging, const uint n_rows, const uint x_off,
                            __global uchar* codes, __global half* scales) {
  const uint nb = HD / 32;
  const uint t = get_global_id(0);
  if (t >= n_rows * nb) {
    return;
  }
  const __global uchar* x = staging + x_off;
  const uint r = t / nb;
  const uint dst = (uint)((const __global int*)staging)[r] * nb + t % nb;
  const uint base = r * HD + (t % nb) * 32;
  float m = LOADX(x, base);               // the first element, as argmax starts: the
  float am = fabs(m);                     // sign of an all-zero block's scale follows it
  for (uint i = 1; i < 32; ++i) {
    const float v = LOADX(x, base + i);
    if (fabs(v) > am) {                   // the first of equal magnitudes, like argmax
      am = fabs(v);
      m = v;
    }
  }
  vstore_half_rte(m * -0.125f, dst, scales);
  const float s = vload_half(dst, scales);
  for (uint i = 0; i < 16; ++i) {         // byte i: element i (low nibble), i + 16 (high)
    const uchar lo = code4(LOADX(x, base + i), s);
    const uchar hi = code4(LOADX(x, base + i + 16), s);
    codes[(size_t)dst * 16 + i] = lo | (uchar)(hi << 4);
  }
}
