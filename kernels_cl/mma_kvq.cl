// Quantized K/V (common.cl KV_Q 1: int8 + a float32 scale per vector, 2: int4 q4_0 + a
// float16 scale per 32 elements) straight into decode_mma.cl's f16 (bf16) fragments, after
// mma_tile.cl. A chunk's codes stay raw in registers (so the next chunk's loads can be in
// flight) and become fragments where they are multiplied, with integer and f16x2 operations
// (no int -> float conversions, whose pipe is 1/8 of the FMA rate):
//   code c as f16 = (bits 0x6400 | (c + 128)) - 1152 (int8) or (0x6400 | n) - 1032 (int4):
//   a byte or nibble is placed in the mantissa of 1024 and the offset subtracted, exactly.
// The scales:
//   int8 K: one per key, applied to the key's f32 score (exact: the mma sums code products)
//   int8 V: one per key, folded into P (f32) before P is rounded to f16 (bf16), as v_scale / vmax
//           with vmax the split's largest v_scale (so P stays <= e^TAU), O times vmax at the
//           end
//   int4 K, V: one per key and 32 dims, code * scale rounded to f16 (mul.rn.f16x2: the
//           same value as the f32 product rounded, since both factors have 11-bit mantissas)
// The bf16 build (IS_BF16) makes bf16 fragments of the same slots and scales: a code is made
// an exact f32 the same way (the byte or nibble in the mantissa of 2^23, the offset
// subtracted), an int8 code's bf16 is that f32's upper half (exact: at most 8 significant
// bits), an int4 value code * scale is computed in f32 (exact) and rounded to bf16 as P is
// (mma_pack_h2: cvt.rn.bf16x2.f32 on NVIDIA), the f16 scale made f32 exactly (cvt.f32.f16).
// (Exact-code tricks for bf16 itself need 9 significant bits for c + 128; hence via f32.)
// Which dims a lane's fragment slots stand for is chosen so that its loads are whole
// contiguous runs (a product is unchanged when A's columns and B's rows are permuted alike):
//   K (lane g, t; key 8 nb + g): the lane's K_WORDS words at byte t * HD / 4 (int8) or
//     t * HD / 8 (int4) of the key's row; k chunk ch's slots (2t, 2t+1) are dims (d0, d0+2)
//     and (2t+8, 2t+9) dims (d0+1, d0+3), d0 = QD0(t, ch); Q's A fragments use the same dims.
//   V (lane g): V_WORDS words at byte g * HD / 8 (int8) or g * HD / 16 (int4) of each of its
//     4 keys; output block db of lane g is dim VDIM(g, db).

#if KV_Q

#if KV_Q == 2 && ((HD != 64 && HD != 128 && HD != 256) || (HV != 64 && HV != 128 && HV != 256))
#error "int4 K/V on the tensor-core decode: head sizes (k and v) 64, 128 or 256"
#endif

#if MMA == 1
inline uint prmt(uint a, uint b, uint sel) {
  uint r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
inline uint hsub2(uint a, uint b) {
  uint r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
inline uint hmul2(uint a, uint b) {
  uint r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#else
// The same three operations in plain C for the emulated build.
inline uint prmt(uint a, uint b, uint sel) {
  const ulong x = (ulong)a | ((ulong)b << 32);
  uint r = 0u;
  for (int k = 0; k < 4; ++k) r |= (uint)((x >> (8 * ((sel >> (4 * k)) & 7u))) & 0xffu) << (8 * k);
  return r;
}
inline float2 h2_f(uint a) {
  ushort h[2] = {(ushort)(a & 0xffffu), (ushort)(a >> 16)};
  return (float2)(vload_half(0, (const __private half*)h), vload_half(1, (const __private half*)h));
}
inline uint f_h2(float2 x) {
  ushort h[2];
  vstore_half_rte(x.x, 0, (__private half*)h);
  vstore_half_rte(x.y, 1, (__private half*)h);
  return (uint)h[0] | ((uint)h[1] << 16);
}
inline uint hsub2(uint a, uint b) { return f_h2(h2_f(a) - h2_f(b)); }
inline uint hmul2(uint a, uint b) { return f_h2(h2_f(a) * h2_f(b)); }
#endif

// Byte 0 of X (an int8 code + 128, or an int4 nibble) as the exact f32 of its code: the byte
// in the mantissa of 2^23, minus 2^23 and the offset O (128 or 8).
#define CODE_F32(X, O) (as_float(0x4b000000u | ((X) & 0xffu)) - (8388608.0f + (O)))
// An f16 scale's bits (the lower half of H) as f32: one exact cvt on NVIDIA.
#if MMA == 1
inline float sc_f32(uint h) {
  float f;
  asm("{.reg .f16 lo, hi;\n\t"
      "mov.b32 {lo, hi}, %1;\n\t"
      "cvt.f32.f16 %0, lo;\n\t}"
      : "=f"(f) : "r"(h));
  return f;
}
#else
#define sc_f32(h) h2f((h) & 0xffffu)
#endif

#if KV_Q == 1
#define K_WORDS (HD / 16)
#define K_VEC 4
#define V_WORDS (HV / 32)
#define V_VEC (HV % 128 ? 2 : 4)
#define QD0(t, ch) ((t) * (HD / 4) + 4 * (ch))
#define VDIM(l, db) ((l) * NDB + (db))
// bytes 0 and 2 of x as the f16 (bf16) pair of their codes (byte 0 low)
#if IS_BF16
inline uint q8_pair(uint x) {
  const uint y = x ^ 0x00800080u;                            // c + 128
  return prmt(as_uint(CODE_F32(y, 128.0f)), as_uint(CODE_F32(y >> 16, 128.0f)), 0x7632u);
}
#define Q8_PAIR(x) q8_pair(x)
#else
#define Q8_PAIR(x) hsub2(((x) & 0x00ff00ffu) ^ 0x64806480u, 0x64806480u)
#endif
#else
#define K_WORDS (HD / 32)
#define K_VEC (HD == 64 ? 2 : 4)
#define V_WORDS (HV / 64)
#define V_VEC (HV == 64 ? 1 : HV == 128 ? 2 : 4)
// word m = ch / 2 of the lane's K bytes (t HD / 8 + 4 m of the row): low nibbles (chunk 2m)
// or high nibbles (chunk 2m + 1) of q4_0 block b, bytes i0 .. i0 + 3
#define Q4B(t, m) ((t) * (HD / 8) + 4 * (m))
#define QD0(t, ch) (32 * (Q4B(t, (ch) / 2) / 16) + Q4B(t, (ch) / 2) % 16 + 16 * ((ch) & 1))
// V byte j of lane l (l HD / 16 + j of the row): dims lo(j) (db = j) and hi(j) (db = NDB/2 + j)
#define V4B(l, j) ((l) * (NDB / 2) + (j))
#define VDIM(l, db) (32 * (V4B(l, (db) % (NDB / 2)) / 16) + V4B(l, (db) % (NDB / 2)) % 16 \
                     + 16 * ((db) / (NDB / 2)))
// nibbles (bytes 0, 2 of x >> SH) as codes times the scale pair S2 (f16: the pair's bits in
// one word, bf16: float2), rounded to f16 (bf16)
#if IS_BF16
inline uint q4_pair(uint x, uint sh, float2 s2) {
  const uint y = (x >> sh) & 0x000f000fu;
  return mma_pack_h2(CODE_F32(y, 8.0f) * s2.x, CODE_F32(y >> 16, 8.0f) * s2.y);
}
#define Q4_PAIR(x, SH, S2) q4_pair((x), (SH), (S2))
#define SC2(a, b) ((float2)(sc_f32(a), sc_f32(b)))
#else
#define Q4_PAIR(x, SH, S2) \
  hmul2(hsub2((((x) >> (SH)) & 0x000f000fu) | 0x64006400u, 0x64086408u), (S2))
#define SC2(a, b) ((uint)(a) | ((uint)(b) << 16))
#endif
#endif

// N words from the 4-byte-aligned global bytes PTR into DST[0..N), VEC words per load (the
// callers' offsets are multiples of 4 VEC bytes).
#define LDWORDS(DST, PTR, N, VEC)                                                 \
  UNROLL                                                                          \
  for (int i_ = 0; i_ < (N); i_ += (VEC)) {                                       \
    if ((VEC) == 4) {                                                             \
      const uint4 x_ = LDG_V4((const __global uint4*)((PTR) + 4 * i_));          \
      DST[i_] = x_.x; DST[i_ + 1] = x_.y; DST[i_ + 2] = x_.z; DST[i_ + 3] = x_.w; \
    } else if ((VEC) == 2) {                                                      \
      const uint2 x_ = LDG_V2((const __global uint2*)((PTR) + 4 * i_));          \
      DST[i_] = x_.x; DST[i_ + 1] = x_.y;                                         \
    } else {                                                                      \
      DST[i_] = LDG_V1((const __global uint*)((PTR) + 4 * i_));                  \
    }                                                                             \
  }

#define KBYTES(R) ((const __global uchar*)kb + (KV_Q == 1 ? (R) : (R) / 2))
#define VBYTES(R) ((const __global uchar*)vb + (KV_Q == 1 ? (R) : (R) / 2))
#define SCALE_BITS(s, i) (((const __global ushort*)(s))[i])

// Chunk CI's raw K codes (key 8 nb + g), V codes (key of P V index kk of lane t) and
// scales, zeros past the chunk's keys (nothing beyond is read):
//   int8: AKS / AVS[nb][e]: k / v scale of key 8 nb + 2t + e (the lane's S columns)
//   int4: AKS[nb][u]: f16 scale bits of key 8 nb + g, the lane's u-th block; AVS[kc][kk]:
//         of the V key, the lane's block
#if KV_Q == 1
typedef float ksc_t;
typedef float vsc_t;
#define NKS 2
#define AVS_DIMS [NKB][2]
#else
typedef ushort ksc_t;
typedef ushort vsc_t;
#define NKS (HD == 256 ? 2 : 1)
#define AVS_DIMS [NKC][4]
#endif
#define FETCH_CHUNK_Q(CI, AK, AV, AKS, AVS)                                          \
  {                                                                                \
    const int j0_ = kr.x + (CI) * TK;                                              \
    const bool in_ = (CI) < nchunks;                                               \
    UNROLL                                                                         \
    for (int nb = 0; nb < NKB; ++nb) {                                             \
      const int j_ = j0_ + 8 * nb + g;                                             \
      UNROLL                                                                       \
      for (int i = 0; i < K_WORDS; ++i) AK[nb][i] = 0u;                            \
      if (in_ && j_ < kr.y) {                                                      \
        LDWORDS(AK[nb], KBYTES(KOFF(j_)) + t * (KV_Q == 1 ? HD / 4 : HD / 8), K_WORDS, K_VEC) \
      }                                                                            \
      FETCH_KSCALES(AKS, AVS, nb, in_, j0_, j_)                                    \
    }                                                                              \
    FOR_PV_KEYS(j0_, FETCH_V_CODES, (kc, kk, j_, in_, AV, AVS))                     \
  }
// Key J's V codes and scale (P V index kk of chunk kc: FOR_PV_KEYS) into AV[kc][kk] and AVS
// (zeros unless IN and J is one of the chunk's keys).
#define FETCH_V_CODES(kc, kk, J, IN, AV, AVS)                                      \
  UNROLL                                                                           \
  for (int i = 0; i < V_WORDS; ++i) AV[kc][kk][i] = 0u;                            \
  if ((IN) && (J) < kr.y) {                                                        \
    LDWORDS(AV[kc][kk], VBYTES(VOFF(KOFF(J))) + g * (KV_Q == 1 ? HV / 8 : HV / 16), V_WORDS, \
            V_VEC)                                                                 \
  }                                                                                \
  FETCH_VSCALE(AVS, kc, kk, IN, J)

#if KV_Q == 1
#define FETCH_KSCALES(AKS, AVS, nb, IN, j0, jg)                          \
  UNROLL                                                                 \
  for (int e = 0; e < 2; ++e) {                                          \
    const int je_ = (j0) + 8 * (nb) + 2 * t + e;                         \
    AKS[nb][e] = 0.0f;                                                   \
    AVS[nb][e] = 0.0f;                                                   \
    if ((IN) && je_ < kr.y) {                                            \
      AKS[nb][e] = ksb[KOFF(je_) / HD];                                  \
      AVS[nb][e] = vsb[KOFF(je_) / HD];                                  \
    }                                                                    \
  }
#define FETCH_VSCALE(AVS, kc, kk, IN, j)
#else
#define FETCH_KSCALES(AKS, AVS, nb, IN, j0, jg)                                    \
  UNROLL                                                                           \
  for (int u = 0; u < NKS; ++u) {                                                  \
    AKS[nb][u] = 0;                                                                \
    if ((IN) && (jg) < kr.y)                                                       \
      AKS[nb][u] = SCALE_BITS(ksb, KOFF(jg) / 32 + Q4B(t, 0) / 16 + u);            \
  }
#define FETCH_VSCALE(AVS, kc, kk, IN, j)                                           \
  AVS[kc][kk] = 0;                                                                 \
  if ((IN) && (j) < kr.y) AVS[kc][kk] = SCALE_BITS(vsb, VOFF(KOFF(j)) / 32 + V4B(g, 0) / 16);
#endif

// Q's A fragments in the K fragments' dim order: rows g and g + 8 (raw f16 bits).
inline uint4 q_frag_q(PARAMS P, const Rows* w, const __global elem_t* q, int g, int t, int ch) {
  const int d0 = QD0(t, ch);
  uint2 lo = (uint2)(0u), hi = (uint2)(0u);
  if (row_live(P, w, g))
    lo = *(const __global uint2*)(q + (size_t)w->b * P->q_sb + (size_t)(w->h0 + g / MQ) * P->q_sh
                                  + (size_t)(w->i0 + g % MQ) * P->q_ss + d0);
  if (row_live(P, w, g + 8))
    hi = *(const __global uint2*)(q + (size_t)w->b * P->q_sb
                                  + (size_t)(w->h0 + (g + 8) / MQ) * P->q_sh
                                  + (size_t)(w->i0 + (g + 8) % MQ) * P->q_ss + d0);
  // (d0, d0 + 2) and (d0 + 1, d0 + 3) of each row
  return (uint4)((lo.x & 0xffffu) | (lo.y << 16), (hi.x & 0xffffu) | (hi.y << 16),
                 (lo.x >> 16) | (lo.y & 0xffff0000u), (hi.x >> 16) | (hi.y & 0xffff0000u));
}

// K chunk ch's B fragment from the lane's raw words W of one key (and its scale bits KS).
#if KV_Q == 1
#define K_FRAG(W, KS, ch) (uint2)(Q8_PAIR(W[ch]), Q8_PAIR(W[ch] >> 8))
#else
#define K_FRAG(W, KS, ch)                                                               \
  (uint2)(Q4_PAIR(W[(ch) / 2], 4 * ((ch) & 1), K_S2(KS, ch)),                           \
          Q4_PAIR(W[(ch) / 2], 4 * ((ch) & 1) + 8, K_S2(KS, ch)))
#define K_S2(KS, ch) SC2(KS[(ch) / 8], KS[(ch) / 8])
#endif

// V's B fragment of output block db from the lane's raw words of its 4 keys (VR[kk][..]):
// keys (kk 0, 1) as b.x, (2, 3) as b.y, the pair of one dim in each.
#if KV_Q == 1
#define V_SEL(j) (((j) & 3) | ((4 + ((j) & 3)) << 8))
#define V_FRAG(VR, VS, db)                                                          \
  (uint2)(Q8_PAIR(prmt(VR[0][(db) / 4], VR[1][(db) / 4], V_SEL(db))),               \
          Q8_PAIR(prmt(VR[2][(db) / 4], VR[3][(db) / 4], V_SEL(db))))
#else
#define V_SEL(j) (((j) & 3) | ((4 + ((j) & 3)) << 8))
#define V_J(db) ((db) % (NDB / 2))
#define V_SH(db) (4 * ((db) / (NDB / 2)))
#define V_FRAG(VR, VS, db)                                                                  \
  (uint2)(Q4_PAIR(prmt(VR[0][V_J(db) / 4], VR[1][V_J(db) / 4], V_SEL(V_J(db))), V_SH(db),   \
                  SC2(VS[0], VS[1])),                                                       \
          Q4_PAIR(prmt(VR[2][V_J(db) / 4], VR[3][V_J(db) / 4], V_SEL(V_J(db))), V_SH(db),   \
                  SC2(VS[2], VS[3])))
#endif

// Whether the value at (row R, dim D) is non-finite as this kernel multiplies it: int8 keeps
// the f32 product code * scale (its scale goes into P), int4 rounds it to f16 (bf16: never
// beyond its range, so only a non-finite scale; mma_tile.cl's V_BAD rounds it alike).
#if KV_Q == 1
#undef V_BAD
#define V_BAD(p, s, R, D) (!isfinite(V_LD1(p, s, R, D)))
#elif !IS_BF16
#undef V_BAD
#define V_BAD(p, s, R, D) (!(fabs(V_LD1(p, s, R, D)) < 65520.0f))
#endif

// PF: the chunk fetched last round becomes the current one.
#define COPY_CHUNK_Q(DK, DV, DKS, DVS, SK, SV, SKS, SVS)                        \
  UNROLL                                                                      \
  for (int nb = 0; nb < NKB; ++nb) {                                          \
    UNROLL                                                                    \
    for (int i = 0; i < K_WORDS; ++i) DK[nb][i] = SK[nb][i];                  \
    UNROLL                                                                    \
    for (int u = 0; u < NKS; ++u) DKS[nb][u] = SKS[nb][u];                    \
  }                                                                           \
  COPY3(DV, SV, NKC, 4, V_WORDS)                                              \
  COPY_VSCALES(DVS, SVS)
#if KV_Q == 1
#define COPY_VSCALES(D, S)                                                    \
  UNROLL                                                                      \
  for (int nb = 0; nb < NKB; ++nb) { D[nb][0] = S[nb][0]; D[nb][1] = S[nb][1]; }
#else
#define COPY_VSCALES(D, S)                                                    \
  UNROLL                                                                      \
  for (int kc = 0; kc < NKC; ++kc) {                                          \
    UNROLL                                                                    \
    for (int kk = 0; kk < 4; ++kk) D[kc][kk] = S[kc][kk];                     \
  }
#endif

#endif  // KV_Q
