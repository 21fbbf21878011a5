// The flash loop of decode_partial / decode_fused (tiled) and the work-group-memory
// flash_prefill, after flash_core.cl (its rows, tiles, K/V staging and logits): K (and V)
// tiles staged in local memory, scores, the row max and probabilities, then P.V into each
// work-item's accumulators.

// Value of key t0 + jj of the current tile, float4 group g: staged, or read directly.
#if STAGE_V
#define PV_VALUE(jj, g) vload4(0, Vs + (jj) * HV + 4 * (g))
#else
#define PV_VALUE(jj, g) V_LD4(vb, vsb, VOFF(KOFF(t0 + (jj))), 4 * (g))
#endif

// Phase 2 of a tile: scores of the tile's keys into Ss, each work-item an MR x NK block
// (rows rl + a RL, keys kl + n KL), finished by finish_score_r (kref: the key range's end).
inline void rows_scores(PARAMS P, const Rows* w, const __global bias_t* bias,
                        __local const float* Qs, __local const float* Ks, __local float* Ss,
                        int t0, int t1, int kref, bool use_bias, int kl, int rl) {
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
        Ss[r * TK + jj] = finish_score_r(P, w, bias, r, t0 + jj, t1, kref, use_bias, s[a][n]);
      }
    }
  }
}

// Phase 3: the row max (each work-item redundantly over its rows: no atomics, one barrier)
// into Mnew and the probabilities of the work-item's keys into Ps. Rows past R_ROWS are
// clamped, not branched around: only the stores are guarded.
inline void rows_weights(__local const float* Ss, __local float* Ps, __local const float* Mrun,
                         __local float* Mnew, int kl, int rl) {
  for (int a = 0; a < MR; ++a) {
    int r = rl + a * RL;
    int rc = min(r, R_ROWS - 1);
    float mx = Mrun[rc];
#pragma unroll 8
    for (int jj = 0; jj < TK; ++jj) mx = fmax(mx, Ss[rc * TK + jj]);
    float mu = SAFE_MAX(mx);
    for (int n = 0; n < NK; ++n) {
      int jj = kl + n * KL;
      float p = WEIGHT(Ss[rc * TK + jj], mu);
      if (r < R_ROWS) Ps[rc * TK + jj] = p;
    }
    if (kl == 0 && r < R_ROWS) Mnew[rc] = mx;
  }
}

// Phase 4: rescale and accumulate P.V for this work-item's rows (prl + pm PRL) and float4
// dims (dl + dv DL) from the tile's tn keys at t0; a tile on the causal diagonal or the
// window's edge (not FULL) adds only the keys each row sees. PV_VALUE reads Vs, or V through
// vb, vsb, btab and P.
inline void rows_pv(PARAMS P, const Rows* w, const __global int* btab,
                    const __global kv_t* vb, const __global scale_t* vsb,
                    __local const float* Vs, __local const float* Ps,
                    __local const float* Mnew, int t0, int tn, bool full, int dl, int prl,
                    float4 acc[PMR][DV], float l[PMR], float m[PMR]) {
  for (int pm = 0; pm < PMR; ++pm) {
    int r = prl + pm * PRL;
    if (r < R_ROWS) {
      float mx = Mnew[r];
      float alpha = EXP(m[pm] - SAFE_MAX(mx));
      float ls = 0.0f;
      float4 a2[DV];
      for (int dv = 0; dv < DV; ++dv) a2[dv] = acc[pm][dv] * alpha;
      if (full) {
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
            if (g < HV4) a2[dv] += p * PV_VALUE(jj, g);
          }
        }
      } else {
        for (int jj = 0; jj < tn; ++jj) {
          float p = Ps[r * TK + jj];
          ls += p;
          if (!key_seen(P, w, r, t0 + jj)) continue;   // a branch per key, not per element
          for (int dv = 0; dv < DV; ++dv) {
            int g = dl + dv * DL;
            if (g < HV4) a2[dv] += p * PV_VALUE(jj, g);
          }
        }
      }
      for (int dv = 0; dv < DV; ++dv) acc[pm][dv] = a2[dv];
      l[pm] = l[pm] * alpha + ls;
      m[pm] = mx;
    }
  }
}

// The flash loop over the tiles of ts: per tile, stage K (and V), scores into Ss,
// row max + probabilities into Ps, then P.V into the caller's accumulators. Every
// work-item runs the same number of iterations (barriers stay uniform). On return each
// work-item holds, for its P.V rows, acc (unnormalised), l (sum of p) and m (max).
inline void flash_rows(PARAMS P, const Rows* w, Tiles ts, const __global int* ids,
                       const __global int* zero, const __global int* btab,
                       const __global kv_t* kb, const __global kv_t* vb,
                       const __global scale_t* ksb, const __global scale_t* vsb,
                       const __global bias_t* bias,
                       __local float* Qs, __local float* Ks, __local float* Vs,
                       __local float* Ss, __local float* Ps, __local float* Mrun,
                       __local float* Mnew,
                       float4 acc[PMR][DV], float l[PMR], float m[PMR]) {
  const int lid = get_local_id(0);
  const int kl = lid % KL, rl = lid / KL;
  const int dl = lid % DL, prl = lid / DL;
  const int2 ckeys = common_keys(P, w);
  for (int pm = 0; pm < PMR; ++pm) {
    l[pm] = 0.0f;
    m[pm] = -INFINITY;
    for (int dv = 0; dv < DV; ++dv) acc[pm][dv] = (float4)(0.0f);
  }
  if (lid < R_ROWS) Mrun[lid] = -INFINITY;
  FETCH_FIRST(ts, ids)
  for (int it = 0; it < ts.count; ++it) {
    const int t0 = tr.x, t1 = tr.y, tn = t1 - t0;
    const bool use_bias = tile_bias(&ts, zero, it);
    // 1. stage the prefetched tile, then start fetching the next one
    STAGE_NEXT(KP, ts, ids, it)
    rows_scores(P, w, bias, Qs, Ks, Ss, t0, t1, ts.kr.y, use_bias, kl, rl);
    barrier(CLK_LOCAL_MEM_FENCE);
    rows_weights(Ss, Ps, Mrun, Mnew, kl, rl);
    barrier(CLK_LOCAL_MEM_FENCE);
    const bool full = MQ == 1 || all_see(ckeys, t0, t1);   // MQ == 1: rows share a position
    rows_pv(P, w, btab, vb, vsb, Vs, Ps, Mnew, t0, tn, full, dl, prl, acc, l, m);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < R_ROWS) Mrun[lid] = Mnew[lid];
  }
}

// The tiled kernels' work-group (decode_core.cl's decode_tile, flash_prefill.cl's SG_IMPL 0):
// its query rows staged in Qs, then flash_rows over the tiles TS of its (batch, kv head)'s K/V.
// Reads P, w, the kernel arguments and the local tiles (Qs .. Mnew) from scope, and declares
// what each work-item holds after it: acc, l and m of its P.V rows prl + pm PRL (float4 dims
// dl + dv DL).
#define FLASH_ROWS_WG(TS)                                                                  \
  const size_t kv_base = KV_BASE(P, w.b, w.kvh);                                           \
  load_q(P, &w, q, Qs);                                                                    \
  float4 acc[PMR][DV];                                                                     \
  float l[PMR], m[PMR];                                                                    \
  flash_rows(P, &w, TS, blk_ids, blk_zero, BTAB(P, block_table, w.b), KV_AT(k, kv_base),  \
             KV_AT(v, VOFF(kv_base)), SC_AT(k_scale, kv_base), SCV_AT(v_scale, VOFF(kv_base)), \
             bias, Qs, Ks, Vs, Ss, Ps, Mrun, Mnew, acc, l, m);                             \
  const int lid = get_local_id(0);                                                         \
  const int dl = lid % DL, prl = lid / DL;
