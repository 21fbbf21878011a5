// What both tensor-core kernels (flash_prefill_mma.cl, decode_mma.cl) share, after
// mma_sync.cl: a lane (g, t) of a warp holds rows g and g + 8 of a 16-row tile, scores of
// 8-key blocks as s[NKB][4] (mma_sync.cl's C layout), O as o[NDB][4], and per row its
// reference max m[2] and partial sum l[2] (over its 4 lanes).

// ln(2^11.5): P = exp(x - m) <= ~3000, far below f16's 65504 (and bf16's ~3.4e38).
#define TAU 8.0f

#if MMA == 1
#define UNROLL _Pragma("unroll")
#else
#define UNROLL              // the emulation's barriers stay in loops (PoCL compiles faster)
#endif

// 16 bytes of f16 (bf16) bits (callers keep the offsets 16-byte aligned).
#define LD16(p, off) (*(const __global uint4*)((p) + (off)))

// The exponent bits of the fragments' 16-bit type, all set for inf and NaN: f16, or bf16
// (IS_BF16, the upper half of an f32).
#if IS_BF16
#define HALF_EXP 0x7f80u
#if KV_Q
#error "the bf16 tensor-core kernels read bf16 K/V only (quantized K/V: the f16 build)"
#endif
#else
#define HALF_EXP 0x7c00u
#endif

inline bool half_bad(uint h) { return (h & HALF_EXP) == HALF_EXP; }

// K/V runs of 8 values (D a multiple of 8) as f16 fragment bits, and whether the value at D
// is non-finite as the mma sees it (V_BAD). Quantized storages (common.cl KV_Q) are
// dequantized in f32 and rounded to f16 (to nearest even) here, since the mma multiplies
// f16: a value beyond f16's range becomes inf, and V_BAD says so.
#if KV_Q == 0
#define KV_LD16(p, s, R, D) LD16(p, (R) + (D))
#define V_BAD(p, s, R, D) half_bad(((const __global ushort*)(p))[(R) + (D)])
#else
inline uint f2h2(float lo, float hi) {
#if MMA == 1
  uint r;                          // sm_80+: both halves in one instruction
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  ushort h[2];
  vstore_half_rte(lo, 0, (__private half*)h);
  vstore_half_rte(hi, 1, (__private half*)h);
  return (uint)h[0] | ((uint)h[1] << 16);
#endif
}
inline uint4 f2h8(float4 a, float4 b) {
  return (uint4)(f2h2(a.x, a.y), f2h2(a.z, a.w), f2h2(b.x, b.y), f2h2(b.z, b.w));
}
#define V_BAD(p, s, R, D) (!(fabs(V_LD1(p, s, R, D)) < 65520.0f))    // NaN too
#if KV_Q == 1
// int8: 8 codes are one aligned 8-byte load, the vector's scale one word
inline uint4 q8_h8(uint2 c, float sc) {
  return f2h8(convert_float4(as_char4(c.x)) * sc, convert_float4(as_char4(c.y)) * sc);
}
#define KV_LD16(p, s, R, D) \
  q8_h8(*(const __global uint2*)((p) + (R) + (D)), (s)[(R) / HD])
#else
// int4: 8 values from a multiple of 8 are one nibble of 8 consecutive (aligned) bytes
inline uint4 q4_h8(uint2 c, float sc, uint shift) {
  const uint x = c.x >> shift, y = c.y >> shift;
  const int4 a = as_int4((uint4)(x, x >> 8, x >> 16, x >> 24) & 0xfu) - 8;
  const int4 b = as_int4((uint4)(y, y >> 8, y >> 16, y >> 24) & 0xfu) - 8;
  return f2h8(convert_float4(a) * sc, convert_float4(b) * sc);
}
#define KV_LD16(p, s, R, D)                                                        \
  q4_h8(*(const __global uint2*)((p) + Q4_BYTE(R, D)), vload_half(((R) + (D)) / 32, (s)), \
        ((D) & 16) ? 4u : 0u)
#endif
#endif

// A pair of f16 (bf16) with each non-finite half zeroed.
inline uint finite_halves(uint w) {
  uint keep = 0xffffffffu;
  if ((w & HALF_EXP) == HALF_EXP) keep &= 0xffff0000u;
  if ((w & (HALF_EXP << 16)) == (HALF_EXP << 16)) keep &= 0x0000ffffu;
  return w & keep;
}

// One tile's logits in place of its scores S, and their max per row of this lane into MT
// (initialised here). FAST: every key of the tile is visible to every row and nothing but the
// scale applies; otherwise flash_core.cl's finish_score_r applies bias, ALiBi, softcap and
// the masks, for rows ROW0 and ROW0 + 8. Reads the caller's P, w, bias, t0, t1, t and kr.
#define MMA_LOGITS_TILE(S, MT, FAST, ROW0)                                \
  float MT[2] = {-INFINITY, -INFINITY};                                   \
  UNROLL                                                                  \
  for (int nb_ = 0; nb_ < NKB; ++nb_) {                                   \
    UNROLL                                                                \
    for (int e_ = 0; e_ < 4; ++e_) {                                      \
      const float d_ = S[nb_][e_] * P->scale;                             \
      const float x_ = (FAST) ? (isfinite(d_) ? d_ : NAN)                 \
          : finish_score_r(P, &w, bias, (ROW0) + 8 * (e_ >> 1),           \
                           t0 + 8 * nb_ + 2 * t + (e_ & 1), t1, kr.y, true, d_); \
      S[nb_][e_] = x_;                                                    \
      MT[e_ >> 1] = fmax(MT[e_ >> 1], x_);                                \
    }                                                                     \
  }

// One tile's online softmax, logits s in, weights out; MT is the tile's max per row of this
// lane (its own keys). The lazy max (as FlashAttention-4): the row max over its 4 lanes moves
// the reference m only when it exceeds it by more than TAU, rescaling l and O then (from
// -inf, the first visible logit: O and l are still 0 and alpha is 0); P = exp(x - m), so
// P <= e^TAU stays well inside f16 (and bf16).
#define MMA_SOFTMAX_TILE(S, MT, M, L, O)                                  \
  UNROLL                                                                  \
  for (int hr_ = 0; hr_ < 2; ++hr_) {                                     \
    MT[hr_] = fmax(MT[hr_], SG_XOR(MT[hr_], 1));                          \
    MT[hr_] = fmax(MT[hr_], SG_XOR(MT[hr_], 2));                          \
    if (MT[hr_] > M[hr_] + TAU) {                                         \
      const float alpha_ = EXP(M[hr_] - MT[hr_]);                         \
      L[hr_] *= alpha_;                                                   \
      UNROLL                                                              \
      for (int db_ = 0; db_ < NDB; ++db_) {                               \
        O[db_][2 * hr_] *= alpha_;                                        \
        O[db_][2 * hr_ + 1] *= alpha_;                                    \
      }                                                                   \
      M[hr_] = MT[hr_];                                                   \
    }                                                                     \
  }                                                                       \
  {                                                                       \
    const float mu_[2] = {SAFE_MAX(M[0]), SAFE_MAX(M[1])};                \
    UNROLL                                                                \
    for (int nb_ = 0; nb_ < NKB; ++nb_) {                                 \
      UNROLL                                                              \
      for (int e_ = 0; e_ < 4; ++e_) {                                    \
        const float p_ = WEIGHT(S[nb_][e_], mu_[e_ >> 1]);                \
        S[nb_][e_] = p_;                                                  \
        L[e_ >> 1] += p_;                                                 \
      }                                                                   \
    }                                                                     \
  }

// P's A fragment (f16, or bf16) for the 16 keys of chunk KC: the C layout of the 8-key blocks
// 2 KC and 2 KC + 1 is the A layout of one 16-key chunk.
#define MMA_P_FRAGMENT(S, KC)                                             \
  (uint4)(mma_pack_h2(S[2 * (KC)][0], S[2 * (KC)][1]),                    \
          mma_pack_h2(S[2 * (KC)][2], S[2 * (KC)][3]),                    \
          mma_pack_h2(S[2 * (KC) + 1][0], S[2 * (KC) + 1][1]),            \
          mma_pack_h2(S[2 * (KC) + 1][2], S[2 * (KC) + 1][3]))
