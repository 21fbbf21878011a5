// The flash loop shared by decode_partial and the work-group-memory flash_prefill.
// Compile-time constants (set by backends/opencl/programs.py):
//   WG       work-items per work-group
//   GC, MQ   rows of a work-group = GC query heads x MQ query rows
//   TK       keys per tile staged in local memory
//   KL, DL   key lanes of the score phase, float4 dim lanes of the P.V phase
//   STAGE_V  1: V tiles go through local memory too (when the device has room)
// K/V tiles are software-pipelined: each work-item holds its share of the next tile in
// registers (NLD float4 groups, raw storage bits) while the current tile is computed.

#define R_ROWS (GC * MQ)
#define KP (HD + 4)            // K/Q tile row pitch: +4 floats keeps float4 reads conflict-free
#define RL (WG / KL)           // row lanes in the score phase
#define MR ((R_ROWS + RL - 1) / RL)
#define NK (TK / KL)
#define PRL (WG / DL)          // row lanes in the P.V phase
#define PMR ((R_ROWS + PRL - 1) / PRL)
#define DV ((HD4 + DL - 1) / DL)
#define NLD ((TK * HD4 + WG - 1) / WG)

// Load this work-item's share of the tile starting at key T0 (zeros past kr.y: nothing
// beyond the range is read). Needs lid, kr, P, kb, vb, pk, pv in scope.
#define FETCH(T0)                                                       \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    pk[n] = RAW_ZERO;                                                   \
    pv[n] = RAW_ZERO;                                                   \
    if (idx_ < TK * HD4 && (T0) + jj_ < kr.y) {                         \
      const size_t off_ = (size_t)((T0) + jj_) * P->kv_ss + 4 * g_;     \
      pk[n] = LDRAW(kb, off_);                                          \
      if (STAGE_V) pv[n] = LDRAW(vb, off_);                             \
    }                                                                   \
  }

// Registers -> local tiles (K with pitch KPITCH, V with pitch HD), converted to f32.
#define STORE_TILE(KPITCH)                                              \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    if (idx_ < TK * HD4) {                                              \
      vstore4(cvt4(pk[n]), 0, Ks + jj_ * (KPITCH) + 4 * g_);            \
      if (STAGE_V) vstore4(cvt4(pv[n]), 0, Vs + jj_ * HD + 4 * g_);     \
    }                                                                   \
  }

inline float alibi_slope(PARAMS P, int h) {
  return (uint)h < P->alibi_n ? exp2(P->alibi_e0 * (float)(h + 1))
                              : exp2(P->alibi_e1 * (float)(2 * (h - (int)P->alibi_n) + 1));
}

inline int valid_len(PARAMS P, const __global int* seqlens, int b) {
  return P->has_seqlens ? seqlens[b] : (int)P->total_len;
}

// Keys [lo, hi) that any row of a work-group may see, for query rows i0..i1 (inclusive)
// of batch b with valid length L, intersected with [klo, khi). Everything outside is
// skipped by loop bounds, so memory past L (or past the window) is never read.
inline int2 key_range(PARAMS P, int L, int i0, int i1, int klo, int khi) {
  int p0 = L - (int)P->seq_len + i0, p1 = L - (int)P->seq_len + i1;
  int hi = min(khi, L);
  if (P->causal) hi = min(hi, p1 + 1);
  int lo = klo;
  if (P->local_window > 0) lo = max(lo, p0 - P->local_window + 1);
  return (int2)(lo, hi);
}

// Row r of a work-group: query head h0 + r / MQ, query row i0 + r % MQ.
typedef struct {
  int b, kvh, h0, gcv, i0, L;   // batch, kv head, first head, valid heads, first row, L_b
} Rows;

inline bool row_ok(PARAMS P, const Rows* w, int r) {
  return r < R_ROWS && r / MQ < w->gcv && w->i0 + r % MQ < (int)P->seq_len;
}

// Score of row r against key j (visible, scaled q already in Qs); -inf if masked.
inline float finish_score(PARAMS P, const Rows* w, const __global bias_t* bias,
                          int r, int j, int khi, float dotv) {
  if (!row_ok(P, w, r) || j >= khi) return -INFINITY;
  int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
  int p = w->L - (int)P->seq_len + i;
  if (P->causal && j > p) return -INFINITY;
  if (P->local_window > 0 && j <= p - P->local_window) return -INFINITY;
  float s = dotv;
  if (P->softcap > 0.0f) s = P->softcap * tanh(s / P->softcap);
  if (P->has_bias)
    s += LDB(bias, (size_t)w->b * P->bias_sb + (size_t)h * P->bias_sh + (size_t)i * P->bias_ss
                       + (size_t)j);
  // ALiBi relative to the last key of the range, not to p: the heaviest keys then carry
  // small logits and keep f32 precision; alibi_offset() restores p for the lse.
  if (P->has_alibi) s += alibi_slope(P, h) * (float)(j - (khi - 1));
  return s;
}

// What the scores of row r lack, for an absolute lse (0 without ALiBi).
inline float alibi_offset(PARAMS P, const Rows* w, int r, int khi) {
  if (!P->has_alibi) return 0.0f;
  int p = w->L - (int)P->seq_len + w->i0 + r % MQ;
  return alibi_slope(P, w->h0 + r / MQ) * (float)(khi - 1 - p);
}

// Stage the work-group's query rows, pre-scaled, in Qs (zeros for invalid rows).
inline void load_q(PARAMS P, const Rows* w, const __global elem_t* q, __local float* Qs) {
  for (int idx = get_local_id(0); idx < R_ROWS * HD4; idx += WG) {
    int r = idx / HD4, g = idx % HD4;
    float4 x = (float4)(0.0f);
    if (row_ok(P, w, r)) {
      int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
      x = LD4(q, (size_t)w->b * P->q_sb + (size_t)h * P->q_sh + (size_t)i * P->q_ss + 4 * g)
          * P->scale;
    }
    vstore4(x, 0, Qs + r * KP + 4 * g);
  }
}

// The flash loop over keys [kr.x, kr.y): per tile, stage K (and V), scores into Ss,
// row max + probabilities into Ps, then P.V into the caller's accumulators. Every
// work-item runs the same number of iterations (barriers stay uniform). On return each
// work-item holds, for its P.V rows, acc (unnormalised), l (sum of p) and m (max).
inline void flash_rows(PARAMS P, const Rows* w, int2 kr,
                       const __global elem_t* kb, const __global elem_t* vb,
                       const __global bias_t* bias,
                       __local float* Qs, __local float* Ks, __local float* Vs,
                       __local float* Ss, __local float* Ps, __local float* Mrun,
                       __local float* Mnew,
                       float4 acc[PMR][DV], float l[PMR], float m[PMR]) {
  const int lid = get_local_id(0);
  const int kl = lid % KL, rl = lid / KL;
  const int dl = lid % DL, prl = lid / DL;
  for (int pm = 0; pm < PMR; ++pm) {
    l[pm] = 0.0f;
    m[pm] = -INFINITY;
    for (int dv = 0; dv < DV; ++dv) acc[pm][dv] = (float4)(0.0f);
  }
  if (lid < R_ROWS) Mrun[lid] = -INFINITY;
  raw4_t pk[NLD], pv[NLD];
  FETCH(kr.x)
  for (int t0 = kr.x; t0 < kr.y; t0 += TK) {
    const int tn = min(TK, kr.y - t0);
    // 1. stage the prefetched tile, then start fetching the next one
    STORE_TILE(KP)
    barrier(CLK_LOCAL_MEM_FENCE);
    FETCH(t0 + TK)
    // 2. scores: each work-item an MR x NK block (rows strided by RL, keys by KL)
    float s[MR][NK];
    for (int a = 0; a < MR; ++a)
      for (int n = 0; n < NK; ++n) s[a][n] = 0.0f;
#pragma unroll 4
    for (int g = 0; g < HD4; ++g) {
      float4 kv[NK];
      for (int n = 0; n < NK; ++n) kv[n] = vload4(0, Ks + (kl + n * KL) * KP + 4 * g);
      for (int a = 0; a < MR; ++a) {
        int r = rl + a * RL;
        float4 qv = r < R_ROWS ? vload4(0, Qs + r * KP + 4 * g) : (float4)(0.0f);
        for (int n = 0; n < NK; ++n) s[a][n] += dot(qv, kv[n]);
      }
    }
    for (int a = 0; a < MR; ++a) {
      int r = rl + a * RL;
      if (r < R_ROWS) {
        for (int n = 0; n < NK; ++n) {
          int jj = kl + n * KL;
          Ss[r * TK + jj] = finish_score(P, w, bias, r, t0 + jj, kr.y, s[a][n]);
        }
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // 3. row max (each work-item redundantly over its rows: no atomics, one barrier).
    // Rows past R_ROWS are clamped, not branched around: only the stores are guarded.
    for (int a = 0; a < MR; ++a) {
      int r = rl + a * RL;
      int rc = min(r, R_ROWS - 1);
      float mx = Mrun[rc];
#pragma unroll 8
      for (int jj = 0; jj < TK; ++jj) mx = fmax(mx, Ss[rc * TK + jj]);
      float mu = SAFE_MAX(mx);
      for (int n = 0; n < NK; ++n) {
        int jj = kl + n * KL;
        float p = EXP(Ss[rc * TK + jj] - mu);
        if (r < R_ROWS) Ps[rc * TK + jj] = p;
      }
      if (kl == 0 && r < R_ROWS) Mnew[rc] = mx;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // 4. rescale and accumulate P.V for this work-item's rows and float4 dims
    for (int pm = 0; pm < PMR; ++pm) {
      int r = prl + pm * PRL;
      if (r < R_ROWS) {
        float mx = Mnew[r];
        float alpha = EXP(m[pm] - SAFE_MAX(mx));
        float ls = 0.0f;
        float4 a2[DV];
        for (int dv = 0; dv < DV; ++dv) a2[dv] = acc[pm][dv] * alpha;
#if STAGE_V
        // zeros were staged past the range (and p is 0 there): a fixed trip count unrolls
#pragma unroll 8
        for (int jj = 0; jj < TK; ++jj) {
#else
        for (int jj = 0; jj < tn; ++jj) {
#endif
          float p = Ps[r * TK + jj];
          ls += p;
          for (int dv = 0; dv < DV; ++dv) {
            int g = dl + dv * DL;
            if (g < HD4) {
#if STAGE_V
              a2[dv] += p * vload4(0, Vs + jj * HD + 4 * g);
#else
              a2[dv] += p * LD4(vb, (size_t)(t0 + jj) * P->kv_ss + 4 * g);
#endif
            }
          }
        }
        for (int dv = 0; dv < DV; ++dv) acc[pm][dv] = a2[dv];
        l[pm] = l[pm] * alpha + ls;
        m[pm] = mx;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < R_ROWS) Mrun[lid] = Mnew[lid];
  }
}

// Work-group tile -> rows. Splits/row tiles vary fastest so neighbours share K/V in cache.
inline Rows decompose(PARAMS P, const __global int* seqlens, int gid, int n_splits,
                      int* split) {
  const int rt_n = ((int)P->seq_len + MQ - 1) / MQ;
  const int hc_n = ((int)P->group_size + GC - 1) / GC;
  Rows w;
  int rt = gid % rt_n;
  gid /= rt_n;
  int hc = gid % hc_n;
  gid /= hc_n;
  *split = gid % n_splits;
  gid /= n_splits;
  w.kvh = gid % (int)P->kv_num_heads;
  w.b = gid / (int)P->kv_num_heads;
  w.h0 = w.kvh * (int)P->group_size + hc * GC;
  w.gcv = min(GC, (int)P->group_size - hc * GC);
  w.i0 = rt * MQ;
  w.L = valid_len(P, seqlens, w.b);
  return w;
}
