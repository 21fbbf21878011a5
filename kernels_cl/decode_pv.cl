// decode_pv: the second kernel of the unfused decode. Per work-group (the same row tiling
// as decode_qk, so the same key range per row): p_j = exp(s_j - m_t) / l_t from the
// scores and statistics decode_qk wrote, times V, into the partial states of docs/contract.md
// "Split-KV partial states and merging": o_parts [B,Nq,S,T,Hv] and lse_parts [B,Nq,S,T] (lse_t =
// m_t + log l_t; o = 0 and lse = -inf for a split without visible keys, padding rows included:
// decode_qk gave them no visible key). The reduce then merges the splits.
// Probabilities of a TK-key tile are staged in local memory; DL lanes own float4 dims,
// WG / DL key lanes take every (WG / DL)-th key of the tile, and merge at the end.

#define KLN (WG / DL)              // key lanes of the P.V phase

// P.V of the staged weights Ps of the tile of keys from t0 (the split's keys end at kend)
// into acc: this work-item's float4 dims (dl + dv DL) and keys (kn, kn + KLN, ...). A tile on
// the causal diagonal or the window's edge (not FULL) adds only the keys each row sees.
inline void pv_tile(PARAMS P, const Rows* w, const __global int* btab, const __global kv_t* vb,
                    const __global scale_t* vsb, __local const float* Ps, int t0, int kend,
                    bool full, int dl, int kn, float4 acc[R_ROWS][DV]) {
  if (full) {
    for (int jj = kn; jj < TK; jj += KLN) {
      const int j = min(t0 + jj, kend - 1);               // clamped; p is 0 past the range
      for (int dv = 0; dv < DV; ++dv) {
        const int g = min(dl + dv * DL, HV4 - 1);
        const float4 vv = V_LD4(vb, vsb, VOFF(KOFF(j)), 4 * g);
        for (int r = 0; r < R_ROWS; ++r) acc[r][dv] += Ps[r * TK + jj] * vv;
      }
    }
  } else {
    for (int jj = kn; jj < TK; jj += KLN) {
      const int j = min(t0 + jj, kend - 1);
      bool seen[R_ROWS];
      for (int r = 0; r < R_ROWS; ++r) seen[r] = t0 + jj < kend && key_seen(P, w, r, j);
      for (int dv = 0; dv < DV; ++dv) {
        const int g = min(dl + dv * DL, HV4 - 1);
        const float4 vv = V_LD4(vb, vsb, VOFF(KOFF(j)), 4 * g);
        for (int r = 0; r < R_ROWS; ++r)
          if (seen[r]) acc[r][dv] += Ps[r * TK + jj] * vv;
      }
    }
  }
}

// The key lanes merged (through red), one row at a time, into split t's partial state.
inline void pv_write(PARAMS P, const Rows* w, int t, int kend, int dl, int kn,
                     float4 acc[R_ROWS][DV], __local float4* red, __local const float* Mt,
                     __local const float* Lt, __global float* o_parts,
                     __global float* lse_parts) {
  for (int r = 0; r < R_ROWS; ++r) {
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int dv = 0; dv < DV; ++dv) {
      const int g = dl + dv * DL;
      if (g < HV4) red[kn * HV4 + g] = acc[r][dv];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (kn == 0 && row_ok(P, w, r)) {
      const size_t row = part_row(P, w, r, t);
      const bool any = Lt[r] != 0.0f;                     // NaN (a NaN score): not empty
      for (int dv = 0; dv < DV; ++dv) {
        const int g = dl + dv * DL;
        if (g < HV4) {
          float4 o = (float4)(0.0f);
          for (int c = 0; c < KLN; ++c) o += red[c * HV4 + g];
          vstore4(any ? finite_or_nan4(o) : (float4)(0.0f), 0, o_parts + row * HV + 4 * g);
        }
      }
      if (dl == 0)
        lse_parts[row] = any ? Mt[r] + alibi_offset(P, w, r, kend) + log(Lt[r]) : -INFINITY;
    }
  }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void decode_pv(KERNEL_ARGS) {
  __local float Ps[R_ROWS * TK];
  __local float4 red[KLN * HV4];
  __local float Mt[R_ROWS];
  __local float Lt[R_ROWS];
  __local float Il[R_ROWS];

  const int ns = (int)P->n_splits;
  int t;
  const Rows w = decompose(P, seqlens, kv_start, seqlens_q, get_group_id(0), ns, &t);
  const int2 kr = split_keys(P, &w, t);
  const __global int* btab = BTAB(P, block_table, w.b);
  const size_t kv_base = KV_BASE(P, w.b, w.kvh);
  const __global kv_t* vb = KV_AT(v, VOFF(kv_base));
  const __global scale_t* vsb = SCV_AT(v_scale, VOFF(kv_base));
  const int lid = get_local_id(0);
  const int dl = lid % DL, kn = lid / DL;
  const size_t nrows = (size_t)P->batch * P->num_heads * P->seq_len * ns;
  const int2 ckeys = common_keys(P, &w);

  if (lid < R_ROWS) {
    const int rc = row_ok(P, &w, lid) ? lid : 0;        // clamped: row 0 always exists
    const size_t row = part_row(P, &w, rc, t);
    const float lt = stats[nrows + row];
    Mt[lid] = SAFE_MAX(stats[row]);
    Lt[lid] = lt;
    Il[lid] = inv_sum(lt);
  }
  float4 acc[R_ROWS][DV];
  for (int r = 0; r < R_ROWS; ++r)
    for (int dv = 0; dv < DV; ++dv) acc[r][dv] = (float4)(0.0f);
  for (int t0 = kr.x; t0 < kr.y; t0 += TK) {
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int idx = lid; idx < R_ROWS * TK; idx += WG) {
      const int r = idx / TK, j = t0 + idx % TK;
      const int rc = row_ok(P, &w, r) ? r : 0, jc = min(j, kr.y - 1);
      const float s = scores[SCORE_ROW(P, &w, rc) + jc];
      Ps[idx] = (j < kr.y && row_ok(P, &w, r)) ? WEIGHT(s, Mt[r]) * Il[r] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // a tile on the causal diagonal or the window's edge adds only the keys each row sees
    // (a clamped key past the range is key kr.y - 1 again, with p 0: every row of a full
    // tile sees it)
    // MQ == 1: the rows share one position, so no tile has an edge (the branch folds away)
    const bool full = MQ == 1 || all_see(ckeys, t0, min(t0 + TK, kr.y));
    pv_tile(P, &w, btab, vb, vsb, Ps, t0, kr.y, full, dl, kn, acc);
  }
  pv_write(P, &w, t, kr.y, dl, kn, acc, red, Mt, Lt, o_parts, lse_parts);
}
