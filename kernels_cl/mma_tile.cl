// What both tensor-core kernels (flash_prefill_mma.cl, decode_mma.cl) share, after
// mma_sync.cl: a lane (g, t) of a warp holds rows g and g + 8 of a 16-row tile, scores of
// 8-key blocks as s[NKB][4] (mma_sync.cl's C layout), O as o[NDB][4], and per row its
// reference max m[2] and partial sum l[2] (over its 4 lanes).

// Row halves a lane holds: 2 (rows g and g + 8), or 1 where a kernel's tile has at most 8
// rows (decode_mma.cl: its products are mma_sync.cl's MMA_SYNC_LO, and the [2], [3] entries
// of S and O are never touched, so their registers are free).
#ifndef MMA_NHR
#define MMA_NHR 2
#endif

// ln(2^11.5): P = exp(x - m) <= ~3000, far below f16's 65504 (and bf16's ~3.4e38).
#define TAU 8.0f

#if MMA == 1
#define UNROLL _Pragma("unroll")
#else
#define UNROLL              // the emulation's barriers stay in loops (PoCL compiles faster)
#endif

// Register arrays, loops unrolled: fragments X[N][4] set to 0; D = S for arrays [N0][N1] and
// [N0][N1][N2] (the chunks a prefetching kernel hands on).
#define MMA_ZERO(X, N)                                                    \
  UNROLL                                                                  \
  for (int i_ = 0; i_ < (N); ++i_) {                                      \
    UNROLL                                                                \
    for (int e_ = 0; e_ < 4; ++e_) X[i_][e_] = 0.0f;                      \
  }
#define COPY2(D, S, N0, N1)                                               \
  UNROLL                                                                  \
  for (int i_ = 0; i_ < (N0); ++i_) {                                     \
    UNROLL                                                                \
    for (int j_ = 0; j_ < (N1); ++j_) D[i_][j_] = S[i_][j_];              \
  }
#define COPY3(D, S, N0, N1, N2)                                           \
  UNROLL                                                                  \
  for (int i_ = 0; i_ < (N0); ++i_) {                                     \
    UNROLL                                                                \
    for (int j_ = 0; j_ < (N1); ++j_) {                                   \
      UNROLL                                                              \
      for (int k_ = 0; k_ < (N2); ++k_) D[i_][j_][k_] = S[i_][j_][k_];    \
    }                                                                     \
  }

// 16 bytes of f16 (bf16) bits (callers keep the offsets 16-byte aligned).
#define LD16(p, off) (*(const __global uint4*)((p) + (off)))

// The exponent bits of the fragments' 16-bit type, all set for inf and NaN: f16, or bf16
// (IS_BF16, the upper half of an f32).
#if IS_BF16
#define HALF_EXP 0x7f80u
#else
#define HALF_EXP 0x7c00u
#endif

inline bool half_bad(uint h) { return (h & HALF_EXP) == HALF_EXP; }

// Whether the K/V value at D is non-finite as the mma sees it (V_BAD; the decode's runs of 8
// values are loaded by mma_prefetch.cl's KV_LD16). Quantized storages (common.cl KV_Q) are
// fetched raw (KVQ_CODES: the run's codes, one aligned 8-byte load; KVQ_SCALE: its scale's
// bits, of rows of W values) and converted where they are stored (kvq_h8): each code exactly
// to f32 (the byte or nibble in the mantissa of 2^23, the offset subtracted), times the scale
// in f32, then rounded to the fragments' 16-bit type (f16, or bf16) to nearest even as
// mma_pack_h2 rounds P: a value beyond f16's range becomes inf, and V_BAD says so (the same
// rounding of the same f32 product).
#if KV_Q == 0
#define V_BAD(p, s, R, D) half_bad(((const __global ushort*)(p))[(R) + (D)])
#else
#define V_BAD(p, s, R, D) half_bad(mma_pack_h2(V_LD1(p, s, R, D), 0.0f))
#if KV_Q == 1
// int8: 8 codes from a multiple of 8 are 8 aligned bytes, the vector's float32 scale a word
#define KVQ_CODES(p, R, D) (*(const __global uint2*)((p) + (R) + (D)))
#define KVQ_SCALE(s, R, D, W) as_uint((s)[(R) / (W)])
// code k of word X (byte k) as f32: 2^23 + (c + 128) - (2^23 + 128), exact
#define KVQ_F(X, k) (as_float(0x4b000000u | (((X) >> (8 * (k))) & 0xffu)) - 8388736.0f)
#else
// int4: 8 values from a multiple of 8 are one nibble of 8 consecutive (aligned) bytes (the
// high ones for dims 16..31 of a block), the block's float16 scale a ushort
#define KVQ_CODES(p, R, D) (*(const __global uint2*)((p) + Q4_BYTE(R, D)))
#define KVQ_SCALE(s, R, D, W) ((uint)((const __global ushort*)(s))[((R) + (D)) / 32])
// nibble k of word X (byte k, already shifted and masked) as f32: 2^23 + n - (2^23 + 8)
#define KVQ_F(X, k) (as_float(0x4b000000u | (((X) >> (8 * (k))) & 0xffu)) - 8388616.0f)
#endif
// The 8 values [D, D + 8) from their raw codes C and scale bits SC, as 4 words of 16-bit
// pairs (the lower dim in the lower half, as the 16-bit storages lie in memory).
inline uint4 kvq_h8(uint2 c, uint sc, int d) {
#if KV_Q == 1
  const float s = as_float(sc);
  const uint x = c.x ^ 0x80808080u, y = c.y ^ 0x80808080u;       // each byte c + 128
#else
  const float s = h2f(sc);
  const uint sh = (d & 16) ? 4u : 0u;
  const uint x = (c.x >> sh) & 0x0f0f0f0fu, y = (c.y >> sh) & 0x0f0f0f0fu;
#endif
  return (uint4)(mma_pack_h2(KVQ_F(x, 0) * s, KVQ_F(x, 1) * s),
                 mma_pack_h2(KVQ_F(x, 2) * s, KVQ_F(x, 3) * s),
                 mma_pack_h2(KVQ_F(y, 0) * s, KVQ_F(y, 1) * s),
                 mma_pack_h2(KVQ_F(y, 2) * s, KVQ_F(y, 3) * s));
}
#endif

// A pair of f16 (bf16) with each non-finite half zeroed.
inline uint finite_halves(uint w) {
  uint keep = 0xffffffffu;
  if ((w & HALF_EXP) == HALF_EXP) keep &= 0xffff0000u;
  if ((w & (HALF_EXP << 16)) == (HALF_EXP << 16)) keep &= 0x0000ffffu;
  return w & keep;
}

// Q pre-scaled by a power of two (docs/contract.md "Overflow"): the bf16 builds multiply q,
// as it is loaded, by 2^(e-1), the power of two at or just below the scale (exact in bf16),
// and the f32 scores by the rest, qk_scale = scale / 2^(e-1) in [1, 2): q.k then never leaves
// float32's range unless the logit itself does (a raw bf16 q.k of 1.6e39 whose logit is 2e38
// was NaN). f16 q.k cannot overflow float32: those builds keep q raw and qk_scale = scale.
// Only the Q load changes; the score loop keeps its one multiply.
#if IS_BF16
inline float qk_pow2(float scale) {
  int e;
  frexp(scale, &e);
  return ldexp(1.0f, e - 1);
}
// Two bf16 values (a word) times a power of two: exact for normal results.
inline uint bf16x2_times(uint x, float p2) {
  const float lo = as_float(x << 16) * p2, hi = as_float(x & 0xffff0000u) * p2;
  return (as_uint(hi) & 0xffff0000u) | (as_uint(lo) >> 16);
}
inline uint4 q_prescale(uint4 x, float p2) {
  return (uint4)(bf16x2_times(x.x, p2), bf16x2_times(x.y, p2), bf16x2_times(x.z, p2),
                 bf16x2_times(x.w, p2));
}
#else
inline float qk_pow2(float scale) { return 1.0f; }
#define q_prescale(x, p2) (x)
#endif

// One tile's logits in place of its scores S, and their max per row of this lane into MT
// (initialised here). The scores are q.k with q pre-scaled (above): qk_scale finishes them. FAST: every key of the tile is visible to every row and nothing but the
// scale applies; otherwise flash_core.cl's finish_score_r applies bias, ALiBi, softcap and
// the masks, for rows ROW0 and ROW0 + 8. Reads the caller's P, w, bias, t0, t1, t and kr.
// The choice is made once per tile (FAST is warp-uniform): a choice per score kept both
// paths' instructions in the loop (on the H100 the prefill at S=2048 took 288 vs 348 us).
#define MMA_LOGITS_TILE(S, MT, FAST, ROW0)                                \
  float MT[2] = {-INFINITY, -INFINITY};                                   \
  if (FAST) {                                                             \
    UNROLL                                                                \
    for (int nb_ = 0; nb_ < NKB; ++nb_) {                                 \
      UNROLL                                                              \
      for (int e_ = 0; e_ < 2 * MMA_NHR; ++e_) {                          \
        const float d_ = S[nb_][e_] * qk_scale;                           \
        S[nb_][e_] = isfinite(d_) ? d_ : NAN;                             \
        MT[e_ >> 1] = fmax(MT[e_ >> 1], S[nb_][e_]);                      \
      }                                                                   \
    }                                                                     \
  } else {                                                                \
    UNROLL                                                                \
    for (int nb_ = 0; nb_ < NKB; ++nb_) {                                 \
      UNROLL                                                              \
      for (int e_ = 0; e_ < 2 * MMA_NHR; ++e_) {                          \
        S[nb_][e_] = finish_score_r(P, &w, bias, (ROW0) + 8 * (e_ >> 1),  \
                                    t0 + 8 * nb_ + 2 * t + (e_ & 1), t1, kr.y, true, \
                                    S[nb_][e_] * qk_scale);               \
        MT[e_ >> 1] = fmax(MT[e_ >> 1], S[nb_][e_]);                      \
      }                                                                   \
    }                                                                     \
  }

// The weights exp(x - m) as 2^((x - m) log2(e)) (the difference first: exact near the max,
// whatever the logits' magnitude), through PTX ex2.approx in the hardware builds (relative
// error about 2^-22, far below P's rounding to f16 / bf16; by the PTX ISA ex2(NaN) is NaN and
// ex2(-inf) is 0, so a NaN logit still poisons its row and a masked one weighs 0), exp2 in
// the emulation. On the H100 the prefill at S=2048 took 274 vs 288 us with it.
#define MMA_LOG2E 1.4426950408889634f
#if MMA == 1
inline float mma_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#else
#define mma_exp2(x) exp2(x)
#endif

// One tile's online softmax, logits s in, weights out; MT is the tile's max per row of this
// lane (its own keys). The lazy max (as FlashAttention-4): the row max over its 4 lanes moves
// the reference m only when it exceeds it by more than TAU, rescaling l and O then (from
// -inf, the first visible logit: O and l are still 0 and alpha is 0); P = exp(x - m) (by
// mma_exp2 above), so P <= e^TAU stays well inside f16 (and bf16).
#define MMA_SOFTMAX_TILE(S, MT, M, L, O)                                  \
  UNROLL                                                                  \
  for (int hr_ = 0; hr_ < MMA_NHR; ++hr_) {                               \
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
      for (int e_ = 0; e_ < 2 * MMA_NHR; ++e_) {                          \
        const float p_ = mma_exp2((S[nb_][e_] - mu_[e_ >> 1]) * MMA_LOG2E); \
        S[nb_][e_] = p_;                                                  \
        L[e_ >> 1] += p_;                                                 \
      }                                                                   \
    }                                                                     \
  }

// BODY ARGS for each key whose P this lane holds in the A fragments (below) of a run of keys
// from J0: index kk (0..3) of 16-key chunk kc is key j_ = J0 + 16 kc + 2t + (kk & 1) +
// 8 (kk >> 1) (t: the lane's column, from the caller). BODY names a macro and ARGS is its
// parenthesized argument list, naming kc, kk and j_ where BODY takes them (no variadic
// macro: NVIDIA's OpenCL C 1.2 compiler refuses them).
#define FOR_PV_KEYS(J0, BODY, ARGS)                                       \
  UNROLL                                                                  \
  for (int kc = 0; kc < NKC; ++kc) {                                      \
    UNROLL                                                                \
    for (int kk = 0; kk < 4; ++kk) {                                      \
      const int j_ = (J0) + 16 * kc + 2 * t + (kk & 1) + 8 * (kk >> 1);   \
      BODY ARGS                                                           \
    }                                                                     \
  }

// P's A fragment (f16, or bf16) for the 16 keys of chunk KC: the C layout of the 8-key blocks
// 2 KC and 2 KC + 1 is the A layout of one 16-key chunk.
#define MMA_P_FRAGMENT(S, KC)                                             \
  (uint4)(mma_pack_h2(S[2 * (KC)][0], S[2 * (KC)][1]),                    \
          mma_pack_h2(S[2 * (KC)][2], S[2 * (KC)][3]),                    \
          mma_pack_h2(S[2 * (KC) + 1][0], S[2 * (KC) + 1][1]),            \
          mma_pack_h2(S[2 * (KC) + 1][2], S[2 * (KC) + 1][3]))
