// decode_qk: the first kernel of the unfused decode (FlashInfer's proposal). Per work-group
// (GC heads x MQ rows of one GQA group, one KV split): QK^T over the split's visible keys,
// written as final scores (softcap, bias, ALiBi and masks applied; -inf where masked) to
// scores [B, Nq, S, C] float32, plus the split's softmax statistics per row: max m_t and
// sum l_t = sum_j exp(s_j - m_t) into stats [2, B, Nq, S, T] (m_t = -inf, l_t = 0 for a
// split without visible keys). Only keys of the split's key range are written; decode_pv
// (same row tiling) reads exactly those.

// One staged tile [t0, t1) of keys for this work-item's rows (rl + a RL) and keys (kl + n KL):
// the final scores into the scores buffer (kend: the split's key end), and each row's running
// (max, sum) of the work-item's keys rescaled and extended.
inline void qk_tile(PARAMS P, const Rows* w, const __global bias_t* bias, __global float* scores,
                    __local const float* Qs, __local const float* Ks, int t0, int t1, int kend,
                    int kl, int rl, float m[MR], float l[MR]) {
  for (int a = 0; a < MR; ++a) {
    const int r = rl + a * RL, rc = min(r, R_ROWS - 1);
    float s[NK];
    for (int n = 0; n < NK; ++n) s[n] = 0.0f;
    for (int g = 0; g < HD4; ++g) {
      const float4 qv = vload4(0, Qs + rc * KP + 4 * g);
      for (int n = 0; n < NK; ++n) s[n] += dot(qv, vload4(0, Ks + (kl + n * KL) * KP + 4 * g));
    }
    float mx = m[a];
    for (int n = 0; n < NK; ++n) {
      const int j = t0 + kl + n * KL;
      s[n] = finish_score_r(P, w, bias, r, j, t1, kend, true, s[n]);
      mx = fmax(mx, s[n]);
      if (r < R_ROWS && j < t1 && row_ok(P, w, r)) scores[SCORE_ROW(P, w, r) + j] = s[n];
    }
    const float mu = SAFE_MAX(mx);
    float ls = l[a] * EXP(m[a] - mu);
    for (int n = 0; n < NK; ++n) ls += WEIGHT(s[n], mu);
    m[a] = mx;
    l[a] = ls;
  }
}

// The KL key lanes of every row combined (through red_m, red_l) into split t's statistics.
inline void qk_stats(PARAMS P, const Rows* w, int t, int kl, int rl, const float m[MR],
                     const float l[MR], __local float* red_m, __local float* red_l,
                     __global float* stats) {
  const int lid = get_local_id(0);
  for (int a = 0; a < MR; ++a) {
    const int r = rl + a * RL;
    if (r < R_ROWS) {
      red_m[r * KL + kl] = m[a];
      red_l[r * KL + kl] = l[a];
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid < R_ROWS && row_ok(P, w, lid)) {
    float mx = -INFINITY;
    for (int c = 0; c < KL; ++c) mx = fmax(mx, red_m[lid * KL + c]);
    const float mu = SAFE_MAX(mx);
    float ls = 0.0f;
    for (int c = 0; c < KL; ++c) ls += red_l[lid * KL + c] * EXP(red_m[lid * KL + c] - mu);
    const size_t row = part_row(P, w, lid, t);
    const size_t nrows = (size_t)P->batch * P->num_heads * P->seq_len * (int)P->n_splits;
    stats[row] = ls != 0.0f ? mx : -INFINITY;           // NaN ls (a NaN score): not empty
    stats[nrows + row] = ls;
  }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void decode_qk(KERNEL_ARGS) {
  __local float Qs[R_ROWS * KP];
  __local float Ks[TK * KP];
  __local float red_m[R_ROWS * KL];
  __local float red_l[R_ROWS * KL];
  __local float* Vs = 0;                   // STORE_TILE's V half is off (STAGE_V is 0)

  const int ns = (int)P->n_splits;
  int t;
  const Rows w = decompose(P, seqlens, kv_start, seqlens_q, get_group_id(0), ns, &t);
  const int2 kr = split_keys(P, &w, t);
  const Tiles ts = dense_tiles(kr);
  const __global int* btab = BTAB(P, block_table, w.b);
  const size_t kv_base = KV_BASE(P, w.b, w.kvh);
  const __global kv_t* kb = KV_AT(k, kv_base);
  const __global scale_t* ksb = SC_AT(k_scale, kv_base);
  const __global kv_t* vb = kb;            // FETCH's V half is off (STAGE_V is 0 here)
  const __global scale_t* vsb = ksb;
  const int lid = get_local_id(0);
  const int kl = lid % KL, rl = lid / KL;
  load_q(P, &w, q, Qs);

  // per work-item running (max, sum) of its keys, for each of its rows
  float m[MR], l[MR];
  for (int a = 0; a < MR; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.0f;
  }
  kvraw_t pk[NLD], pv[NLD];
  int2 tr = tile_keys(&ts, 0, 0);
  FETCH(tr.x, tr.y)
  for (int it = 0; it < ts.count; ++it) {
    const int t0 = tr.x, t1 = tr.y;
    STORE_TILE(KP)
    barrier(CLK_LOCAL_MEM_FENCE);
    tr = tile_keys(&ts, 0, it + 1);
    FETCH(tr.x, tr.y)
    qk_tile(P, &w, bias, scores, Qs, Ks, t0, t1, kr.y, kl, rl, m, l);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  qk_stats(P, &w, t, kl, rl, m, l, red_m, red_l, stats);
}
