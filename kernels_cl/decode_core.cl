// The split-KV decode tile shared by decode_partial and decode_fused: one work-group's
// partial state -- GC query heads of one GQA group x MQ (= m_tile) query rows over one KV
// split -- written in the format of docs/contract.md "Split-KV partial states and merging":
// o_parts [B,Nq,S,T,H] and lse_parts [B,Nq,S,T], float32, o = 0 and lse = -inf where the split
// has no visible key (and for padding rows, past seqlens_q[b], selected whatever they
// accumulated). o's rows are HV long.
// Two variants (-D SG_IMPL): 0 work-group memory and barriers per tile; otherwise every
// sub-group streams its own key chunks with no barrier in the loop (see below).
// With BLOCK_SKIP (tiled variant only) a split is a share of the row tile's listed blocks
// (blocks spread evenly over the splits), not a range of split_size keys.

// What decode_tile takes of the kernel arguments (block table and block list may be NULL).
#define DECODE_ARGS                                                                      \
  PARAMS P, const __global elem_t* q, const __global kv_t* k, const __global kv_t* v,       \
      const __global scale_t* k_scale, const __global scale_t* v_scale,                   \
      const __global bias_t* bias, const __global int* seqlens, const __global int* block_table, \
      const __global int* blk_off, const __global int* blk_ids, const __global int* blk_zero, \
      const __global int* kv_start, const __global int* seqlens_q
#define DECODE_ARG_NAMES \
  P, q, k, v, k_scale, v_scale, bias, seqlens, block_table, blk_off, blk_ids, blk_zero, kv_start, \
      seqlens_q

#if SG_IMPL == 0

#if STAGE_V
#define DECODE_LOCALS                                                     \
  __local float Qs[R_ROWS * KP], Ks[TK * KP], Vs[TK * HV], Ss[R_ROWS * TK], \
      Ps[R_ROWS * TK], Mrun[R_ROWS], Mnew[R_ROWS];
#else
#define DECODE_LOCALS                                                     \
  __local float Qs[R_ROWS * KP], Ks[TK * KP], Ss[R_ROWS * TK], Ps[R_ROWS * TK], \
      Mrun[R_ROWS], Mnew[R_ROWS];                                        \
  __local float* Vs = 0;
#endif
#define DECODE_LOCAL_NAMES Qs, Ks, Vs, Ss, Ps, Mrun, Mnew

inline void decode_tile(DECODE_ARGS, __global float* o_parts, __global float* lse_parts,
                        Rows* wout, __local float* Qs, __local float* Ks, __local float* Vs,
                        __local float* Ss, __local float* Ps, __local float* Mrun,
                        __local float* Mnew) {
  const int ns = (int)P->n_splits;
  int t;
  const Rows w = decompose(P, seqlens, kv_start, seqlens_q, get_group_id(0), ns, &t);
  *wout = w;
#if BLOCK_SKIP
  // The whole key range; this split takes entries [n t / ns, n (t+1) / ns) of its list.
  const int2 kr = key_range(P, &w, 0, (int)P->capacity);
  const int2 e = listed(blk_off, blk_ids, list_row(P, &w), kr);
  const int n = e.y - e.x;
  Tiles ts = dense_tiles(kr);
  ts.first = e.x + n * t / ns;
  ts.count = e.x + n * (t + 1) / ns - ts.first;
#else
  const int2 kr = split_keys(P, &w, t);
  const Tiles ts = dense_tiles(kr);
#endif
  FLASH_ROWS_WG(ts)
  for (int pm = 0; pm < PMR; ++pm) {
    const int r = prl + pm * PRL;
    if (!row_ok(P, &w, r)) continue;
    const bool live = row_live(P, &w, r);
    const size_t row = part_row(P, &w, r, t);
    const float inv = inv_sum(l[pm]);
    for (int dv = 0; dv < DV; ++dv) {
      const int g = dl + dv * DL;
      if (g < HV4)
        vstore4(live ? finite_or_nan4(acc[pm][dv] * inv) : (float4)(0.0f), 0,
                o_parts + row * HV + 4 * g);
    }
    if (dl == 0)
      lse_parts[row] = live ? lse_of(m[pm] + alibi_offset(P, &w, r, kr.y), l[pm]) : -INFINITY;
  }
}

#else  // sub-group decode

// Each sub-group of SG = 32 lanes streams key chunks of its own (chunks ci = wid, wid+NW,
// ...), so no barrier sits in the key loop; register prefetch keeps the next chunk's loads
// in flight. Lane l owns float4 dim groups l, l+32, ... of every row and key. A chunk is
// KC keys for RP (rows padded to a power of two) rows: RP x KC = 32 dot products, summed
// across lanes by a transposed butterfly (31 shuffles leave dot product l in lane l).
// The sub-groups' states merge through local memory once, at the end.
#if SG != 32
#error "the sub-group decode maps 32 values onto 32 lanes"
#endif
#define NW (WG / SG)
#define KC (SG / RP)
#define DPL4 ((HD4 + SG - 1) / SG)     // float4 groups of q / k per lane
#define DPLV ((HV4 + SG - 1) / SG)     // of v / o

#if HV == HD
#define FETCH_CHUNK(CI, AK, AV)                                           \
  for (int c_ = 0; c_ < KC; ++c_)                                         \
    for (int d_ = 0; d_ < DPL4; ++d_) {                                   \
      const int j_ = kr.x + (CI) * KC + c_, g_ = lane + d_ * SG;          \
      AK[c_][d_] = KV_RAW_ZERO;                                           \
      AV[c_][d_] = KV_RAW_ZERO;                                           \
      if ((CI) < nchunks && j_ < kr.y && g_ < HD4) {                      \
        const size_t ro_ = KOFF(j_);                                      \
        AK[c_][d_] = KV_LDRAW(kb, ksb, ro_, 4 * g_);                      \
        AV[c_][d_] = KV_LDRAW(vb, vsb, ro_, 4 * g_);                      \
      }                                                                   \
    }
#else
#define FETCH_CHUNK(CI, AK, AV)                                           \
  for (int c_ = 0; c_ < KC; ++c_) {                                       \
    const int j_ = kr.x + (CI) * KC + c_;                                 \
    const bool in_ = (CI) < nchunks && j_ < kr.y;                         \
    for (int d_ = 0; d_ < DPL4; ++d_) {                                   \
      const int g_ = lane + d_ * SG;                                      \
      AK[c_][d_] = KV_RAW_ZERO;                                           \
      if (in_ && g_ < HD4) AK[c_][d_] = KV_LDRAW(kb, ksb, KOFF(j_), 4 * g_); \
    }                                                                     \
    for (int d_ = 0; d_ < DPLV; ++d_) {                                   \
      const int g_ = lane + d_ * SG;                                      \
      AV[c_][d_] = KV_RAW_ZERO;                                           \
      if (in_ && g_ < HV4) AV[c_][d_] = V_LDRAW(vb, vsb, VOFF(KOFF(j_)), 4 * g_); \
    }                                                                     \
  }
#endif

#define COPY_CHUNK(DK, DV_, SK, SV)                                       \
  for (int c_ = 0; c_ < KC; ++c_) {                                       \
    for (int d_ = 0; d_ < DPL4; ++d_) DK[c_][d_] = SK[c_][d_];            \
    for (int d_ = 0; d_ < DPLV; ++d_) DV_[c_][d_] = SV[c_][d_];           \
  }

// One butterfly level: keep the half of x selected by this lane's bit, add the partner's.
#define FOLD(H)                                                           \
  for (int i_ = 0; i_ < (H); ++i_) {                                      \
    const bool up_ = (lane & (H)) != 0;                                   \
    const float keep_ = up_ ? x[i_ + (H)] : x[i_];                        \
    const float send_ = up_ ? x[i_] : x[i_ + (H)];                        \
    x[i_] = keep_ + SG_XOR(send_, (H));                                   \
  }

#define DECODE_LOCALS                                                     \
  __local float red_m[NW * RP], red_l[NW * RP];                           \
  __local float4 red_o[NW * RP * HV4];                                    \
  SG_SCRATCH_DECL
#define DECODE_LOCAL_NAMES red_m, red_l, red_o SG_SCRATCH_ARG

// The rows' running state before the first chunk (m -inf, l and acc 0) and this lane's
// float4 groups of their q, pre-scaled (zeros for padding rows: their q is never read).
inline void decode_q_rows(PARAMS P, const Rows* w, const __global elem_t* q, int lane,
                          float4 qr[RP][DPL4], float4 acc[RP][DPLV], float m[RP],
                          float l[RP]) {
  for (int r = 0; r < RP; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int d = 0; d < DPLV; ++d) acc[r][d] = (float4)(0.0f);
    for (int d = 0; d < DPL4; ++d) {
      const int g = lane + d * SG;
      qr[r][d] = (float4)(0.0f);
      if (g < HD4 && row_live(P, w, r)) {
        const int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
        qr[r][d] = LD4(q, (size_t)w->b * P->q_sb + (size_t)h * P->q_sh + (size_t)i * P->q_ss
                              + 4 * g) * P->scale;
      }
    }
  }
}

// The chunk's RP x KC dot products, this lane's partial sums of its dims, summed across the
// lanes by the transposed butterfly: dot product l (row l / KC, key l % KC) in lane l.
// (Conversions happen where the values are used, so few converted tiles are live.)
inline float decode_chunk_scores(float4 qr[RP][DPL4], kvraw_t ck[KC][DPL4],
                                 int lane SG_SCRATCH_PARAM) {
  float x[SG];
  for (int c = 0; c < KC; ++c) {
    for (int r = 0; r < RP; ++r) x[r * KC + c] = 0.0f;
    for (int d = 0; d < DPL4; ++d) {
      const float4 kc = kv_cvt4(ck[c][d]);
      for (int r = 0; r < RP; ++r) x[r * KC + c] += dot(qr[r][d], kc);
    }
  }
  FOLD(16) FOLD(8) FOLD(4) FOLD(2) FOLD(1)
  return x[0];
}

// Online softmax over chunk ci (keys from j0; past nchunks all masked) of dot product X0
// (this lane's row and key): every row's m, l and acc rescaled to its new max; returns this
// lane's weight p.
inline float decode_chunk_softmax(PARAMS P, const Rows* w, const __global bias_t* bias,
                                  int j0, int kend, bool live_chunk, float x0, int lane,
                                  float4 acc[RP][DPLV], float m[RP],
                                  float l[RP] SG_SCRATCH_PARAM) {
  const int r = lane / KC, c = lane % KC;
  const float sc = live_chunk ? finish_score(P, w, bias, r, j0 + c, kend, x0) : -INFINITY;
  float mx = sc;
  for (int o = KC / 2; o > 0; o >>= 1) mx = fmax(mx, SG_XOR(mx, o));
  float mold = -INFINITY;
  for (int rr = 0; rr < RP; ++rr) mold = rr == r ? m[rr] : mold;
  const float mnew = fmax(mold, mx);
  const float p = WEIGHT(sc, SAFE_MAX(mnew));
  float ps = p;
  for (int o = KC / 2; o > 0; o >>= 1) ps += SG_XOR(ps, o);
  for (int rr = 0; rr < RP; ++rr) {
    const float mn = SG_BCAST(mnew, rr * KC);
    const float alpha = EXP(m[rr] - SAFE_MAX(mn));
    l[rr] = l[rr] * alpha + SG_BCAST(ps, rr * KC);
    m[rr] = mn;
    for (int d = 0; d < DPLV; ++d) acc[rr][d] *= alpha;
  }
  return p;
}

// P.V of the chunk's KC keys from j0 (lane l's weight p: row l / KC, key l % KC, by
// broadcast). A chunk on the causal diagonal or the window's edge (not FULL) adds only the
// keys each row sees (the chunk differs per sub-group: the shuffles stay outside the branch,
// uniform).
inline void decode_chunk_pv(PARAMS P, const Rows* w, kvraw_t cv[KC][DPLV], float p, bool full,
                            int j0, float4 acc[RP][DPLV] SG_SCRATCH_PARAM) {
  for (int cc = 0; cc < KC; ++cc) {
    float pr[RP];
    for (int rr = 0; rr < RP; ++rr) pr[rr] = SG_BCAST(p, rr * KC + cc);
    if (full) {
      for (int d = 0; d < DPLV; ++d) {
        const float4 vc = kv_cvt4(cv[cc][d]);
        for (int rr = 0; rr < RP; ++rr) acc[rr][d] += pr[rr] * vc;
      }
    } else {
      bool seen[RP];
      for (int rr = 0; rr < RP; ++rr) seen[rr] = key_seen(P, w, rr, j0 + cc);
      for (int d = 0; d < DPLV; ++d) {
        const float4 vc = kv_cvt4(cv[cc][d]);
        for (int rr = 0; rr < RP; ++rr)
          if (seen[rr]) acc[rr][d] += pr[rr] * vc;
      }
    }
  }
}

// The sub-groups' (m, l, acc) per row merged through local memory (red_m, red_l, red_o)
// into split t's partial state (kend: the split's key end, for the absolute lse).
inline void decode_merge_out(PARAMS P, const Rows* w, int t, int kend, int lane, int wid,
                             float4 acc[RP][DPLV], const float m[RP], const float l[RP],
                             __local float* red_m, __local float* red_l, __local float4* red_o,
                             __global float* o_parts, __global float* lse_parts) {
  for (int rr = 0; rr < RP; ++rr) {
    if (lane == 0) {
      red_m[wid * RP + rr] = m[rr];
      red_l[wid * RP + rr] = l[rr];
    }
    for (int d = 0; d < DPLV; ++d) {
      const int g = lane + d * SG;
      if (g < HV4) red_o[(wid * RP + rr) * HV4 + g] = acc[rr][d];
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int idx = get_local_id(0); idx < R_ROWS * HV4; idx += WG) {
    const int r = idx / HV4, g = idx % HV4;
    if (row_ok(P, w, r)) {
      MERGE_SUBGROUPS(float4, RP, HV4, r, g)
      const size_t row = part_row(P, w, r, t);
      // a padding row: o 0 and lse -inf, selected whatever it accumulated
      const bool live = row_live(P, w, r);
      const float4 o = live && (ll > 0.0f || isnan(ll)) ? finite_or_nan4(oo / ll)
                                                        : (float4)(0.0f);
      vstore4(o, 0, o_parts + row * HV + 4 * g);
      if (g == 0)
        lse_parts[row] = live ? lse_of(mm + alibi_offset(P, w, r, kend), ll) : -INFINITY;
    }
  }
}

inline void decode_tile(DECODE_ARGS, __global float* o_parts, __global float* lse_parts,
                        Rows* wout, __local float* red_m, __local float* red_l,
                        __local float4* red_o SG_SCRATCH_PARAM) {
  const int ns = (int)P->n_splits;
  int t;
  const Rows w = decompose(P, seqlens, kv_start, seqlens_q, get_group_id(0), ns, &t);
  *wout = w;
  const int2 kr = split_keys(P, &w, t);
  KV_POINTERS(w)
  const int lane = SG_LANE, wid = SG_ID;
  const int2 ckeys = common_keys(P, &w);

  float4 qr[RP][DPL4];
  float4 acc[RP][DPLV];
  float m[RP], l[RP];
  decode_q_rows(P, &w, q, lane, qr, acc, m, l);

  const int nchunks = kr.y > kr.x ? (kr.y - kr.x + KC - 1) / KC : 0;
  // Raw chunks in flight: PF = 1 keeps the next chunk loading while this one is computed,
  // PF = 2 the one after it too (twice the bytes in flight per sub-group, more registers).
  kvraw_t ak[KC][DPL4], av[KC][DPLV];
  FETCH_CHUNK(wid, ak, av)
#if PF == 2
  kvraw_t bk[KC][DPL4], bv[KC][DPLV];
  FETCH_CHUNK(wid + NW, bk, bv)
#endif
  // Every sub-group runs the same number of rounds (a round past the end is all masked),
  // so sub-group operations stay uniform even where they are emulated with barriers.
  for (int base = 0; base < nchunks; base += NW) {
    const int ci = base + wid;
    kvraw_t ck[KC][DPL4], cv[KC][DPLV];
    COPY_CHUNK(ck, cv, ak, av)
#if PF == 2
    COPY_CHUNK(ak, av, bk, bv)
    FETCH_CHUNK(ci + 2 * NW, bk, bv)
#else
    FETCH_CHUNK(ci + NW, ak, av)
#endif
    const float x0 = decode_chunk_scores(qr, ck, lane SG_SCRATCH_ARG);
    const int j0 = kr.x + ci * KC;
    const float p = decode_chunk_softmax(P, &w, bias, j0, kr.y, ci < nchunks, x0, lane, acc, m,
                                         l SG_SCRATCH_ARG);
    // MQ == 1: the rows share one position, so no chunk has an edge (the branch folds away)
    const bool full = MQ == 1 || all_see(ckeys, j0, min(j0 + KC, kr.y));
    decode_chunk_pv(P, &w, cv, p, full, j0, acc SG_SCRATCH_ARG);
  }
  decode_merge_out(P, &w, t, kr.y, lane, wid, acc, m, l, red_m, red_l, red_o, o_parts,
                   lse_parts);
}

#endif
