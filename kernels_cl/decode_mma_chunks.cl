// decode_mma.cl's chunks (the kernels and their account: decode_mma.cl, which follows this
// file in the program): the geometry, how a chunk's K and V runs are fetched into registers
// for every storage, Q's fragments, and the split's largest v_scale.

#if HD % 32 || HV % 64
#error "decode_mma.cl loads 32-dim runs of k and 64-dim runs of v"
#endif
#define NW (WG / 32)
// At most 8 rows (a GQA group of up to 8 heads, one query row: most decodes): rows g + 8 do
// not exist, so the products are MMA_SYNC_LO and every loop over a lane's rows stops at
// MMA_NHR = 1; the registers of Q's, S's and O's second row half are then dead (ptxas at
// H=128: 255 registers and spills before, see backends/opencl/mma.py).
#undef MMA_NHR
#if R_ROWS <= 8
#define MMA_NHR 1
#define MMA_D MMA_SYNC_LO
#else
#define MMA_NHR 2
#define MMA_D MMA_SYNC
#endif
#define NKB (TK / 8)            // 8-key blocks of S per chunk
#define NKC (TK / 16)           // 16-key chunks of P V per chunk
#define NDR (HD / 32)           // 32-dim runs of Q K^T (two 16-dim k chunks each)
#define NDB (HV / 8)            // 8-dim blocks of O (and dims per lane in P V)
#define NVW (NDB / 2)           // words of one key's dims per lane in P V
// Chunk CI's K runs (key 8 nb + g, dims 32 c + 8 t ..) and V runs (key of P V index kk of
// lane t, dims g NDB ..) into registers; zeros past the chunk's keys (nothing beyond read).
#define FETCH_CHUNK(CI, AK, AV)                                                 \
  {                                                                             \
    const int j0_ = kr.x + (CI) * TK;                                           \
    UNROLL                                                                      \
    for (int nb = 0; nb < NKB; ++nb) {                                          \
      const int j_ = j0_ + 8 * nb + g;                                          \
      UNROLL                                                                    \
      for (int c = 0; c < NDR; ++c) {                                           \
        AK[nb][c] = (uint4)(0u);                                                \
        if ((CI) < nchunks && j_ < kr.y) AK[nb][c] = KV_LD16(kb, ksb, KOFF(j_), 32 * c + 8 * t); \
      }                                                                         \
    }                                                                           \
    FOR_PV_KEYS(j0_, FETCH_V_RUNS, (kc, kk, j_, CI, AV))                         \
  }
// Key J's V runs (P V index kk of chunk kc: FOR_PV_KEYS) into AV[kc][kk] (zeros past the
// chunk's keys).
#define FETCH_V_RUNS(kc, kk, J, CI, AV)                                         \
  UNROLL                                                                        \
  for (int u = 0; u < NVW / 4; ++u) {                                           \
    AV[kc][kk][u] = (uint4)(0u);                                                \
    if ((CI) < nchunks && (J) < kr.y)                                           \
      AV[kc][kk][u] = KV_LD16(vb, vsb, VOFF(KOFF(J)), 64 * u + 8 * g);          \
  }

#define COPY_CHUNK(DK, DV, SK, SV)                                              \
  COPY2(DK, SK, NKB, NDR)                                                       \
  COPY3(DV, SV, NKC, 4, NVW / 4)

inline uint vword(uint4 x, int e) { return e == 0 ? x.x : e == 1 ? x.y : e == 2 ? x.z : x.w; }

#if KV_Q == 0
// The output dim of lane l's block db: lane l's dims are its 8-dim runs 64 u + 8 l .. (u < HV
// / 64), so the 8 lanes g of a key read 128 contiguous bytes per load (whole sectors; runs of
// 16 dims per lane, at 32-byte strides, took two loads per sector: 10% slower on the H100).
#define VDIM(l, db) (64 * ((db) >> 3) + 8 * (l) + ((db) & 7))
#endif
#if KV_Q == 1
#define O_OUT(x) ((x) * vmax)              // P carried v_scale / vmax
#else
#define O_OUT(x) (x)
#endif

#if MMA_OUT == 1
#define MMA_ENTRY decode_partial
#else
#define MMA_ENTRY decode_fused
#endif

// A chunk's registers, one spelling for every storage: K runs (or raw codes) K, V runs V and,
// for quantized K/V, their scales KS and VS (mma_kvq.cl); as declarations, the chunk's fetch
// and its copy (PF), and as the parameters and arguments of the functions below.
#if KV_Q
#define CHUNK_REGS(K, V, KS, VS)                                                \
  uint K[NKB][K_WORDS], V[NKC][4][V_WORDS];                                     \
  ksc_t KS[NKB][NKS];                                                           \
  vsc_t VS AVS_DIMS;
#define FETCH_KV(CI, K, V, KS, VS) FETCH_CHUNK_Q(CI, K, V, KS, VS)
#define COPY_KV(DK, DV, DKS, DVS, SK, SV, SKS, SVS) COPY_CHUNK_Q(DK, DV, DKS, DVS, SK, SV, SKS, SVS)
#define K_CHUNK(K, KS) uint K[NKB][K_WORDS], ksc_t KS[NKB][NKS]
#define V_CHUNK(V, VS) uint V[NKC][4][V_WORDS], vsc_t VS AVS_DIMS
#define CHUNK_ARGS(K, KS) K, KS
#else
#define CHUNK_REGS(K, V, KS, VS) uint4 K[NKB][NDR], V[NKC][4][NVW / 4];
#define FETCH_KV(CI, K, V, KS, VS) FETCH_CHUNK(CI, K, V)
#define COPY_KV(DK, DV, DKS, DVS, SK, SV, SKS, SVS) COPY_CHUNK(DK, DV, SK, SV)
#define K_CHUNK(K, KS) uint4 K[NKB][NDR]
#define V_CHUNK(V, VS) uint4 V[NKC][4][NVW / 4]
#define CHUNK_ARGS(K, KS) K
#endif

// Q's A fragments (f16 bits raw, bf16 bits times the scale's power of two qk_p2; the rest of
// the scale applies to the f32 scores: mma_tile.cl qk_scale), rows g and g + 8 (zeros for
// padding rows: their q is never read).
inline void decode_q_frags(PARAMS P, const Rows* w, const __global elem_t* q, int g, int t,
                           float qk_p2, uint4 qa[2 * NDR]) {
#if KV_Q
  UNROLL
  for (int ch = 0; ch < 2 * NDR; ++ch) qa[ch] = q_frag_q(P, w, q, g, t, ch);
#else
  UNROLL
  for (int c = 0; c < NDR; ++c) {
    uint4 lo = (uint4)(0u), hi = (uint4)(0u);
    if (row_live(P, w, g))
      lo = LD16(q, (size_t)w->b * P->q_sb + (size_t)(w->h0 + g / MQ) * P->q_sh
                   + (size_t)(w->i0 + g % MQ) * P->q_ss + 32 * c + 8 * t);
    if (row_live(P, w, g + 8))
      hi = LD16(q, (size_t)w->b * P->q_sb + (size_t)(w->h0 + (g + 8) / MQ) * P->q_sh
                   + (size_t)(w->i0 + (g + 8) % MQ) * P->q_ss + 32 * c + 8 * t);
    qa[2 * c] = (uint4)(lo.x, hi.x, lo.y, hi.y);
    qa[2 * c + 1] = (uint4)(lo.z, hi.z, lo.w, hi.w);
  }
#endif
#if IS_BF16
  UNROLL
  for (int ch = 0; ch < 2 * NDR; ++ch) qa[ch] = q_prescale(qa[ch], qk_p2);
#endif
}

#if KV_Q == 1
// The split's largest v_scale (every warp finds it alone): P takes v_scale / vmax. (Key j's
// vector index: KOFF(j) / HD, V's offset / HV alike.)
inline float split_vmax(PARAMS P, const __global int* btab, const __global scale_t* vsb,
                        int2 kr, int lane SG_SCRATCH_PARAM) {
  float vmax = 0.0f;
  for (int j = kr.x + lane; j < kr.y; j += 32) vmax = fmax(vmax, vsb[KOFF(j) / HD]);
  UNROLL
  for (int x = 1; x < 32; x <<= 1) vmax = fmax(vmax, SG_XOR(vmax, x));
  if (!(vmax > 0.0f) || !isfinite(vmax)) vmax = 1.0f;    // all zero, or non-finite scales
  return vmax;
}
#endif

