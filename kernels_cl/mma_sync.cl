// The matrix primitive of flash_prefill_mma.cl: D = A B + C, m16n8k16, f16 operands (bf16 with
// -D IS_BF16=1) held as pairs of raw 16-bit values in uints (no cl_khr_fp16 needed), f32
// accumulators. A "warp" is 32
// consecutive work-items; all 32 call MMA_SYNC together, in work-group-uniform control flow.
// Two builds of one contract (-D MMA):
//   1  NVIDIA tensor cores through inline PTX mma.sync (backends/opencl/mma_probe.py checks
//      the instruction and this fragment layout on the device once per driver)
//   2  plain OpenCL C computing the same product from the same per-lane fragments: each
//      lane publishes its fragments in local memory and reads the ones its results need,
//      so the kernel's indexing and tiling run unchanged on any device (PoCL in CI)
// Fragment layout (PTX ISA, mma.m16n8k16 .row A, .col B), lane = 4 g + t (g 0..7, t 0..3):
//   A (16 x 16): a.x = (row g, k 2t..2t+1), a.y = (row g+8, k 2t..2t+1),
//                a.z = (row g, k 2t+8..2t+9), a.w = (row g+8, k 2t+8..2t+9)
//   B (16 x 8):  b.x = (k 2t..2t+1, col g), b.y = (k 2t+8..2t+9, col g)
//   C, D (16 x 8, float c[4]): c[0], c[1] = (row g, cols 2t, 2t+1), c[2], c[3] = (row g+8, ..)
// The lower 16 bits of a pair hold the element of the lower k.

#ifndef CVT_PTX
#define CVT_PTX 0
#endif
#ifndef IS_BF16
#define IS_BF16 0
#endif

#if MMA == 1

// bf16 (sm_80+, as f16's m16n8k16): the same fragment layout, two bf16 per register.
#if IS_BF16
#define MMA_PTX_OP "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
#define MMA_PTX_OP "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif

inline void mma_ptx(float* c, uint4 a, uint2 b) {
  float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  const uint a0 = a.x, a1 = a.y, a2 = a.z, a3 = a.w, b0 = b.x, b1 = b.y;
  asm volatile(MMA_PTX_OP
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  c[0] = c0;
  c[1] = c1;
  c[2] = c2;
  c[3] = c3;
}
// Rows 0..7 only (A's rows 8..15 zero, C's c[2], c[3] neither read nor written): for tiles of
// at most 8 rows (MMA_NHR 1), so the registers of rows g + 8 (A's a.y, a.w, C's c[2], c[3])
// are dead and the compiler frees them.
inline void mma_ptx_lo(float* c, uint4 a, uint2 b) {
  float c0 = c[0], c1 = c[1], d2, d3;
  const uint a0 = a.x, a2 = a.z, b0 = b.x, b1 = b.y, z = 0u;
  asm volatile(MMA_PTX_OP
               "{%0, %1, %2, %3}, {%4, %5, %6, %5}, {%7, %8}, {%0, %1, %9, %9};"
               : "+f"(c0), "+f"(c1), "=f"(d2), "=f"(d3)
               : "r"(a0), "r"(z), "r"(a2), "r"(b0), "r"(b1), "f"(0.0f));
  c[0] = c0;
  c[1] = c1;
}
#define MMA_SCRATCH_DECL
#define MMA_SCRATCH_PARAM
#define MMA_SCRATCH_ARG
#define MMA_SYNC(C, A, B) mma_ptx((C), (A), (B))
#define MMA_SYNC_LO(C, A, B) mma_ptx_lo((C), (A), (B))

#else

// Words per warp in the exchange: 32 lanes x (4 A + 2 B).
#define MMA_WARP_WORDS 192

// Element I (the lower 16 bits of word I / 2 for even I) of a fragment array, as f32 (exact).
#if IS_BF16
inline float mma_elem(__local const uint* s, int i) {
  const uint w = s[i >> 1];
  return as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
}
#else
#define mma_elem(s, i) vload_half((i), (__local const half*)(s))
#endif

inline void mma_emu(float* c, uint4 a, uint2 b, __local uint* scr) {
  const int lid = get_local_id(0), lane = lid & 31;
  __local uint* sa = scr + (lid - lane) / 32 * MMA_WARP_WORDS;
  __local uint* sb = sa + 128;
  barrier(CLK_LOCAL_MEM_FENCE);        // the previous product's reads are done
  vstore4(a, lane, sa);
  vstore2(b, lane, sb);
  barrier(CLK_LOCAL_MEM_FENCE);
  const int g = lane >> 2, t = lane & 3;
  for (int q = 0; q < 4; ++q) {
    const int row = g + 8 * (q >> 1), col = 2 * t + (q & 1);
    float acc = c[q];
    for (int k = 0; k < 16; ++k) {
      // A[row][k] sits in lane 4 (row % 8) + (k % 8) / 2, register 2 (k / 8) + row / 8;
      // B[k][col] in lane 4 col + (k % 8) / 2, register k / 8; the half is k % 2.
      const int wa = (4 * (row & 7) + ((k & 7) >> 1)) * 4 + (k >> 3) * 2 + (row >> 3);
      const int wb = (4 * col + ((k & 7) >> 1)) * 2 + (k >> 3);
      acc = fma(mma_elem(sa, 2 * wa + (k & 1)), mma_elem(sb, 2 * wb + (k & 1)), acc);
    }
    c[q] = acc;
  }
}
// Rows 0..7 only (as mma_ptx_lo): rows 8..15 of A taken as zero, c[2], c[3] untouched.
inline void mma_emu_lo(float* c, uint4 a, uint2 b, __local uint* scr) {
  float cc[4] = {c[0], c[1], 0.0f, 0.0f};
  mma_emu(cc, (uint4)(a.x, 0u, a.z, 0u), b, scr);
  c[0] = cc[0];
  c[1] = cc[1];
}
#define MMA_SCRATCH_DECL __local uint mma_scr[WG / 32 * MMA_WARP_WORDS];
// Functions that multiply take the exchange as a parameter (as SG_SCRATCH_PARAM).
#define MMA_SCRATCH_PARAM , __local uint* mma_scr
#define MMA_SCRATCH_ARG , mma_scr
#define MMA_SYNC(C, A, B) mma_emu((C), (A), (B), mma_scr)
#define MMA_SYNC_LO(C, A, B) mma_emu_lo((C), (A), (B), mma_scr)

#endif

#if IS_BF16
// Two f32 values as a pair of bf16 (round to nearest even; NaN stays NaN): lo in the lower
// 16 bits.
#if CVT_PTX
inline uint mma_pack_h2(float lo, float hi) {
  uint r;
  // cvt.rn.bf16x2.f32 d, a, b (sm_80+) puts a in the upper half of d and b in the lower
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
// bf16 is the upper half of an f32: round the lower half away to nearest even (an overflow
// carries into inf, as it should; a subnormal rounds like any other value); a NaN becomes
// the quiet NaN (its payload's carry could otherwise make it inf).
inline uint mma_f2h(float f) {
  const uint x = as_uint(f);
  return isnan(f) ? ((x >> 16) | 0x7fc0u) : (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}
inline uint mma_pack_h2(float lo, float hi) {
  return mma_f2h(lo) | (mma_f2h(hi) << 16);
}
#endif
#else
// Two f32 values as a pair of f16 (round to nearest even): lo in the lower 16 bits.
#if CVT_PTX
inline uint mma_pack_h2(float lo, float hi) {
  uint r;
  // cvt.rn.f16x2.f32 d, a, b puts a in the upper half of d and b in the lower
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
inline uint mma_f2h(float f) {
  const uint x = as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;                    // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;                   // rounds past 65504: inf
  if (ax < 0x38800000u) return sign | (uint)rint(as_float(ax) * 0x1.0p24f);  // subnormal
  const uint r = ax - 0x38000000u;                                // rebias the exponent
  return sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
}
inline uint mma_pack_h2(float lo, float hi) {
  return mma_f2h(lo) | (mma_f2h(hi) << 16);
}
#endif
#endif
