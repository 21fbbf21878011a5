// flash_prefill: one pass over the visible keys per block of query rows, online softmax,
// normalised output (q layout, spec dtype) and lse. Two variants, chosen by -D SG_IMPL:
//   0           work-group memory only (any device)
//   1, 2, 3, 9  sub-groups: cl_khr_subgroups, cl_intel_subgroups, NVIDIA warp shuffles
//               through inline PTX, or a local-memory emulation used by the tests
// KV tiles wholly beyond the causal diagonal, seqlens_k or the window are never visited:
// the key loop is bounded by key_range(). With BLOCK_SKIP the loop visits only the listed
// blocks of the work-group's row tile (and work-groups run heaviest first, by wg_order).

// The kernel arguments (KERNEL_ARGS) come from attnreg/ports.py; the block table, block
// lists and order may be NULL.

// This work-group's rows, key range and tiles.
inline Tiles prefill_tiles(PARAMS P, const __global int* seqlens, const __global int* kv_start,
                           const __global int* seqlens_q, const __global int* blk_off,
                           const __global int* blk_ids, const __global int* wg_order, Rows* w) {
  const int n = get_num_groups(0);
  int t;
#if BLOCK_SKIP
  *w = decompose(P, seqlens, kv_start, seqlens_q, wg_order[get_group_id(0)], 1, &t);
#else
  // Heaviest (latest, longest causal range) row tiles first: better tail balance.
  *w = decompose(P, seqlens, kv_start, seqlens_q, n - 1 - (int)get_group_id(0), 1, &t);
#endif
  const int2 kr = key_range(P, w, 0, (int)P->capacity);
  Tiles ts = dense_tiles(kr);
#if BLOCK_SKIP
  const int2 e = listed(blk_off, blk_ids, list_row(P, w), kr);
  ts.first = e.x;
  ts.count = e.y - e.x;
#endif
  return ts;
}

// A padding row (live false) is written as out 0 and lse -inf, selected whatever it
// accumulated (it may have met 0 * NaN in a tile its work-group's live rows all see).
inline void write_final(PARAMS P, const Rows* w, int h, int i, float4 a[DV], float l,
                        float m, const __global float* sink, __global elem_t* out,
                        __global float* lse, int dl, bool live) {
  // m is absolute here (alibi_offset added by the caller), so it compares with the sink.
  if (P->has_sink && live) {
    const float f = join_sink(sink[h], &m, &l);
    for (int dv = 0; dv < DV; ++dv) a[dv] *= f;
  }
  float inv = inv_sum(l);
  size_t base = OUT_OFF(P, w->b, h, i);
  for (int dv = 0; dv < DV; ++dv) {
    int g = dl + dv * DL;
    if (g < HV4) ST4(live ? finite_or_nan4(a[dv] * inv) : (float4)(0.0f), out, base + 4 * g);
  }
  if (P->return_lse && dl == 0)
    lse[((size_t)w->b * P->num_heads + h) * P->seq_len + i] = live ? lse_of(m, l) : -INFINITY;
}

// The local tiles of both variants: the work-group's q rows, K and (STAGE_V) V.
#if STAGE_V
#define QKV_LOCALS                                                      \
  __local float Qs[R_ROWS * KP];                                        \
  __local float Ks[TK * KP];                                            \
  __local float Vs[TK * HV];
#else
#define QKV_LOCALS                                                      \
  __local float Qs[R_ROWS * KP];                                        \
  __local float Ks[TK * KP];                                            \
  __local float* Vs = 0;
#endif

#if SG_IMPL == 0

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void flash_prefill(KERNEL_ARGS) {
  QKV_LOCALS
  __local float Ss[R_ROWS * TK];
  __local float Ps[R_ROWS * TK];
  __local float Mrun[R_ROWS];
  __local float Mnew[R_ROWS];

  Rows w;
  const Tiles ts = prefill_tiles(P, seqlens, kv_start, seqlens_q, blk_off, blk_ids, wg_order,
                                 &w);
  const int2 kr = ts.kr;
  FLASH_ROWS_WG(ts)
  for (int pm = 0; pm < PMR; ++pm) {
    int r = prl + pm * PRL;
    if (!row_ok(P, &w, r)) continue;
    write_final(P, &w, w.h0 + r / MQ, w.i0 + r % MQ, acc[pm], l[pm],
                m[pm] + alibi_offset(P, &w, r, kr.y), sink, out, lse, dl, row_live(P, &w, r));
  }
}

#else  // sub-group variant

#if SG_IMPL == 2 && SG_REQD
#define SG_ATTR __attribute__((intel_reqd_sub_group_size(SG)))
#else
#define SG_ATTR
#endif

// Each sub-group owns RS = R_ROWS / NSG rows. Per tile the whole work-group stages K
// (and V) with two barriers; scores, row max, row sum and the probabilities then stay in
// registers and sub-group operations: lane l scores keys l, l+SG, ... and owns output
// dims l, l+SG, ...
#define NSG (WG / SG)
#define RS (R_ROWS / NSG)
#define KPL (TK / SG)             // keys per lane
#define DPL ((HV + SG - 1) / SG)  // output dims per lane

// This lane's output dims of the value of tile key jj (0 past the tile's tn keys).
#if STAGE_V
#define SG_VALUE(jj, dd) Vs[(jj) * HV + (dd)]
#else
#define SG_VALUE(jj, dd) V_LD1(vb, vsb, VOFF(KOFF(t0 + (jj))), (dd))
#endif
#define SG_VALUES(VV, jj)                                               \
  for (int d_ = 0; d_ < DPL; ++d_) {                                    \
    const int dd_ = lane + d_ * SG;                                     \
    VV[d_] = ((jj) < tn && dd_ < HV) ? SG_VALUE(jj, dd_) : 0.0f;        \
  }
// P.V of a tile: each row a's probability of tile key jj, from lane jj % SG by shuffle, times
// the key's values, added where SEEN (true, or a test of row a's keys: the shuffle stays
// outside it).
#define SG_PV(SEEN)                                                     \
  for (int c = 0; c < KPL; ++c) {                                       \
    for (int src = 0; src < SG; ++src) {                                \
      const int jj = c * SG + src;                                      \
      float vv[DPL];                                                    \
      SG_VALUES(vv, jj)                                                 \
      for (int a = 0; a < RS; ++a) {                                    \
        float p = SG_BCAST(s[a][c], src);                               \
        if (SEEN)                                                       \
          for (int d = 0; d < DPL; ++d) acc[a][d] = fma(p, vv[d], acc[a][d]); \
      }                                                                 \
    }                                                                   \
  }

// The tile's scores of this sub-group's rows (sg RS + a) and this lane's keys (lane + c SG).
inline void sg_scores(__local const float* Qs, __local const float* Ks, int lane, int sg,
                      float s[RS][KPL]) {
  for (int a = 0; a < RS; ++a)
    for (int c = 0; c < KPL; ++c) s[a][c] = 0.0f;
  for (int g = 0; g < HD4; ++g) {
    float4 kv[KPL];
    for (int c = 0; c < KPL; ++c) kv[c] = vload4(0, Ks + (lane + c * SG) * KP + 4 * g);
    for (int a = 0; a < RS; ++a) {
      float4 qv = vload4(0, Qs + (sg * RS + a) * KP + 4 * g);
      for (int c = 0; c < KPL; ++c) s[a][c] += dot(qv, kv[c]);
    }
  }
}

// Online softmax per row of the tile [t0, t1) (kref: the key range's end), the
// probabilities left in s; m, l and acc rescaled to the new max.
inline void sg_softmax(PARAMS P, const Rows* w, const __global bias_t* bias, int t0, int t1,
                       int kref, bool use_bias, int lane, int sg, float s[RS][KPL],
                       float m[RS], float l[RS], float acc[RS][DPL] SG_SCRATCH_PARAM) {
  for (int a = 0; a < RS; ++a) {
    int r = sg * RS + a;
    float mx = m[a];
    for (int c = 0; c < KPL; ++c) {
      s[a][c] = finish_score_r(P, w, bias, r, t0 + lane + c * SG, t1, kref, use_bias,
                               s[a][c]);
      mx = fmax(mx, s[a][c]);
    }
    mx = SG_MAX(mx);
    float mu = SAFE_MAX(mx);
    float alpha = EXP(m[a] - mu);
    float ls = 0.0f;
    for (int c = 0; c < KPL; ++c) {
      s[a][c] = WEIGHT(s[a][c], mu);
      ls += s[a][c];
    }
    l[a] = l[a] * alpha + SG_SUM(ls);
    m[a] = mx;
    for (int d = 0; d < DPL; ++d) acc[a][d] *= alpha;
  }
}

// The sub-group's rows normalised into out (this lane's dims) and lse (write_final's rules,
// per lane: kref is the key range's end, for the absolute lse).
inline void sg_write_rows(PARAMS P, const Rows* w, int kref, const __global float* sink,
                          __global elem_t* out, __global float* lse, int lane, int sg,
                          float acc[RS][DPL], const float l[RS], const float m[RS]) {
  for (int a = 0; a < RS; ++a) {
    int r = sg * RS + a;
    if (!row_ok(P, w, r)) continue;
    int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
    // a padding row: out 0 and lse -inf, selected (see write_final)
    const bool live = row_live(P, w, r);
    float mm = m[a] + alibi_offset(P, w, r, kref), ll = l[a];
    if (P->has_sink && live) {
      const float f = join_sink(sink[h], &mm, &ll);
      for (int d = 0; d < DPL; ++d) acc[a][d] *= f;
    }
    float inv = inv_sum(ll);
    size_t base = OUT_OFF(P, w->b, h, i);
    for (int d = 0; d < DPL; ++d) {
      int dd = lane + d * SG;
      if (dd < HV) ST1(live ? finite_or_nan(acc[a][d] * inv) : 0.0f, out, base + dd);
    }
    if (P->return_lse && lane == 0)
      lse[((size_t)w->b * P->num_heads + h) * P->seq_len + i] = live ? lse_of(mm, ll) : -INFINITY;
  }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) SG_ATTR
void flash_prefill(KERNEL_ARGS) {
  QKV_LOCALS
  SG_SCRATCH_DECL

  Rows w;
  const Tiles ts = prefill_tiles(P, seqlens, kv_start, seqlens_q, blk_off, blk_ids, wg_order,
                                 &w);
  const int2 kr = ts.kr;
  KV_POINTERS(w)
  const int lid = get_local_id(0);
  const int lane = SG_LANE, sg = SG_ID;
  load_q(P, &w, q, Qs);

  const int2 ckeys = common_keys(P, &w);
  int2 rk[RS];
  for (int a = 0; a < RS; ++a) rk[a] = row_keys(P, &w, sg * RS + a);
  float acc[RS][DPL], l[RS], m[RS];
  for (int a = 0; a < RS; ++a) {
    l[a] = 0.0f;
    m[a] = -INFINITY;
    for (int d = 0; d < DPL; ++d) acc[a][d] = 0.0f;
  }
  FETCH_FIRST(ts, blk_ids)
  for (int it = 0; it < ts.count; ++it) {
    const int t0 = tr.x, t1 = tr.y, tn = t1 - t0;
    const bool use_bias = tile_bias(&ts, blk_zero, it);
    STAGE_NEXT(KP, ts, blk_ids, it)
    float s[RS][KPL];
    sg_scores(Qs, Ks, lane, sg, s);
    sg_softmax(P, &w, bias, t0, t1, kr.y, use_bias, lane, sg, s, m, l, acc SG_SCRATCH_ARG);
    // P.V: each V element is read once per sub-group, the probability comes by shuffle; a
    // tile on the causal diagonal or the window's edge adds only the keys each row sees
    // (the branch is uniform over the work-group: the tile is)
    if (all_see(ckeys, t0, t1)) {
      SG_PV(true)
    } else {
      SG_PV(t0 + jj >= rk[a].x && t0 + jj < rk[a].y)
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  sg_write_rows(P, &w, kr.y, sink, out, lse, lane, sg, acc, l, m);
}

#endif
