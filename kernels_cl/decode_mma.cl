// Split-KV decode on matrix units, streaming: the kernels decode_partial (MMA_OUT 1: partial
// states for the reduce) and decode_fused (MMA_OUT 2: then decode_merge.cl's ticket merge).
// A work-group owns one KV split of one row tile: R_ROWS = GC query heads of a GQA group x
// MQ query rows (at most 16, the M dimension of mma_sync.cl's m16n8k16: the group's heads
// fill it). Each of its NW warps holds all those rows and streams its own chunks of TK keys
// (chunks wid, wid + NW, ...) straight from global memory into registers: no local memory
// and no barrier in the key loop, the next chunk's loads in flight while one is computed
// (PF). The warps' states merge through local memory once, at the end.
// Fragments come straight from the loads, by choosing which dims and keys each fragment
// index stands for (a product is unchanged when A's columns and B's rows are permuted alike):
//   S = Q K^T: dims 32c + 8t .. 32c + 8t + 7 are lane t's k indices of chunks 2c and 2c+1
//     (k 2t, 2t+1, 2t+8, 2t+9 = dims 4h + 0..3 of that run), so a lane's B fragments are one
//     16-byte load of key 8 nb + g; Q's A fragments use the same order (loaded once).
//   O += P V: P's A fragments are S's accumulators (keys 16 kc + 2t, +1, +8, +9 of lane t);
//     lane g's output dims are the 8-dim runs 64 u + 8 g .. (block db is dim VDIM(g, db)), so
//     a lane loads its 4 keys' dims as whole 16-byte runs and pairs them key-wise in registers.
// Non-finite values (docs/contract.md "Non-finite values and scalar fields"): a chunk every row
// sees multiplies its values unmasked (a NaN v reaches every row, all of which see it). A chunk
// on an edge (the causal diagonal, the window) zeroes non-finite halves of v, and when a warp
// found one, the lanes re-read the chunk and set to NaN the output columns of their rows that see
// such a key (NaN stays NaN through every later rescale and product).
// The chunk l2_prefetch rounds ahead is prefetched into L2 (mma_prefetch.cl, NVIDIA builds).
// Quantized K/V (KV_Q 1, 2) are fetched raw and made fragments where they are multiplied, in
// the dims order and with the scales that mma_kvq.cl describes.
// The shapes real models need (docs/contract.md "Shapes real models need"): keys before
// kv_start[b] are outside every split's key range (never loaded; a split wholly before it is
// empty), padding rows (past seqlens_q[b]) load no q and are written as o 0 and lse -inf, and V,
// O and the partial states have HV (v_head_size) dims: Q K^T runs over HD, P V over HV.

// S = Q K^T for the 16 rows and the chunk's keys.
inline void decode_scores(uint4 qa[2 * NDR], K_CHUNK(ck, cks),
                          float s[NKB][4] MMA_SCRATCH_PARAM) {
  UNROLL
  for (int nb = 0; nb < NKB; ++nb) {
    UNROLL
    for (int e = 0; e < 4; ++e) s[nb][e] = 0.0f;
#if KV_Q
    UNROLL
    for (int ch = 0; ch < 2 * NDR; ++ch) MMA_D(s[nb], qa[ch], K_FRAG(ck[nb], cks[nb], ch));
#if KV_Q == 1
    UNROLL
    for (int e = 0; e < 2 * MMA_NHR; ++e) s[nb][e] *= cks[nb][e & 1];   // the key's scale
#endif
#else
    UNROLL
    for (int c = 0; c < NDR; ++c) {
      MMA_D(s[nb], qa[2 * c], (uint2)(ck[nb][c].x, ck[nb][c].y));
      MMA_D(s[nb], qa[2 * c + 1], (uint2)(ck[nb][c].z, ck[nb][c].w));
    }
#endif
  }
}

#if KV_Q == 0
// O += P V for a chunk's weights s (f16 P from the S fragments) and values cv (V's key pairs
// packed from the loaded runs). An edge chunk (not FULL) first loses its values' non-finite
// halves (a row that does not see a key must not meet its NaN through 0 * NaN); returns 1
// when it had any, else 0 (vinv: int8's alone).
inline float decode_pv_chunk(float s[NKB][4], V_CHUNK(cv, cvs), bool full, float vinv,
                             float o[NDB][4] MMA_SCRATCH_PARAM) {
  float badf = 0.0f;
  if (!full) {
    UNROLL
    for (int kc = 0; kc < NKC; ++kc) {
      UNROLL
      for (int kk = 0; kk < 4; ++kk) {
        UNROLL
        for (int u = 0; u < NVW / 4; ++u) {
          const uint4 x = cv[kc][kk][u];
          const uint4 y = (uint4)(finite_halves(x.x), finite_halves(x.y),
                                  finite_halves(x.z), finite_halves(x.w));
          if (any(x != y)) badf = 1.0f;
          cv[kc][kk][u] = y;
        }
      }
    }
  }
  UNROLL
  for (int kc = 0; kc < NKC; ++kc) {
    const uint4 a = MMA_P_FRAGMENT(s, kc);
    UNROLL
    for (int i = 0; i < NVW; ++i) {     // dims VDIM(g, 2i) (low halves) and VDIM(g, 2i + 1)
      const uint k0 = vword(cv[kc][0][i / 4], i % 4), k1 = vword(cv[kc][1][i / 4], i % 4);
      const uint k8 = vword(cv[kc][2][i / 4], i % 4), k9 = vword(cv[kc][3][i / 4], i % 4);
      MMA_D(o[2 * i], a, (uint2)((k0 & 0xffffu) | (k1 << 16), (k8 & 0xffffu) | (k9 << 16)));
      MMA_D(o[2 * i + 1], a, (uint2)((k0 >> 16) | (k1 & 0xffff0000u),
                                        (k8 >> 16) | (k9 & 0xffff0000u)));
    }
  }
  return badf;
}
#else
// O += P V for a chunk's weights s and raw V codes cv (scales cvs): V's fragments made from
// the codes of the lane's 4 keys of each chunk. int8: P first takes each key's v_scale / vmax
// (vinv = 1 / vmax; f32, before P is rounded to f16). On an edge chunk (not FULL) a
// non-finite int8 scale, or int4 product (code * scale beyond f16's range is inf), becomes 0
// there (a row that does not see the key must not meet it through 0 * NaN); returns 1 when
// there was one, else 0 (elsewhere every row sees the key).
inline float decode_pv_chunk(float s[NKB][4], V_CHUNK(cv, cvs), bool full, float vinv,
                             float o[NDB][4] MMA_SCRATCH_PARAM) {
  float badf = 0.0f;
#if KV_Q == 1
  UNROLL
  for (int nb = 0; nb < NKB; ++nb) {
    UNROLL
    for (int e = 0; e < 2; ++e) {
      float f = cvs[nb][e] * vinv;
      if (!full && !isfinite(f)) {
        f = 0.0f;
        badf = 1.0f;
      }
      s[nb][e] *= f;
      if (MMA_NHR == 2) s[nb][e + 2] *= f;
    }
  }
#endif
  UNROLL
  for (int kc = 0; kc < NKC; ++kc) {
    const uint4 a = MMA_P_FRAGMENT(s, kc);
    UNROLL
    for (int db = 0; db < NDB; ++db) {
      uint2 b = V_FRAG(cv[kc], cvs[kc], db);
#if KV_Q == 2
      if (!full) {
        const uint2 y = (uint2)(finite_halves(b.x), finite_halves(b.y));
        if (any(b != y)) badf = 1.0f;
        b = y;
      }
#endif
      MMA_D(o[db], a, b);
    }
  }
  return badf;
}
#endif

// Whether any lane of the warp zeroed a value (BADF): on an edge chunk (a warp-uniform
// branch for the hardware's shuffles); the emulation's shuffles are work-group barriers, so
// there every warp shuffles in every round (inside a uniform branch PoCL lost the result).
// If so, the columns of this lane's rows that see a bad v (keys [t0, t1)) become NaN (and stay
// NaN).
inline void nan_bad_columns(PARAMS P, const Rows* w, const __global int* btab,
                            const __global kv_t* vb, const __global scale_t* vsb, int g, int t,
                            int t0, int t1, bool full, float badf,
                            float o[NDB][4] SG_SCRATCH_PARAM) {
#if MMA == 1
  if (!full) {
#else
  {
#endif
    badf = fmax(badf, SG_XOR(badf, 1));
    badf = fmax(badf, SG_XOR(badf, 2));
    badf = fmax(badf, SG_XOR(badf, 4));
    badf = fmax(badf, SG_XOR(badf, 8));
    badf = fmax(badf, SG_XOR(badf, 16));
    if (badf > 0.0f) {
      UNROLL
      for (int hr = 0; hr < MMA_NHR; ++hr) {
        const int r = g + 8 * hr;
        const int2 seen = row_keys(P, w, r);
        const int j0 = max(t0, seen.x), j1 = min(t1, seen.y);
        UNROLL
        for (int db = 0; db < NDB; ++db) {
          UNROLL
          for (int e = 0; e < 2; ++e) {
            bool bad = false;
            for (int j = j0; j < j1; ++j)
              bad = bad || V_BAD(vb, vsb, VOFF(KOFF(j)), VDIM(2 * t + e, db));
            if (bad && row_ok(P, w, r)) o[db][2 * hr + e] = NAN;
          }
        }
      }
    }
  }
}

// Row sums over the row's 4 lanes; the warps' states into local memory (red_m, red_l,
// red_o), merged per row into the split's partial state (kend: its key end, for the absolute
// lse; vmax: int8's, which O carries).
inline void decode_mma_out(PARAMS P, const Rows* w, int split, int kend, int g, int t, int wid,
                           float vmax, float m[2], float l[2], float o[NDB][4],
                           __local float* red_m, __local float* red_l, __local float* red_o,
                           __global float* o_parts,
                           __global float* lse_parts SG_SCRATCH_PARAM) {
  UNROLL
  for (int hr = 0; hr < MMA_NHR; ++hr) {
    l[hr] += SG_XOR(l[hr], 1);
    l[hr] += SG_XOR(l[hr], 2);
    const int r = g + 8 * hr;
    if (r < R_ROWS) {
      if (t == 0) {
        red_m[wid * R_ROWS + r] = m[hr];
        red_l[wid * R_ROWS + r] = l[hr];
      }
      UNROLL
      for (int db = 0; db < NDB; ++db) {
        UNROLL
        for (int e = 0; e < 2; ++e)
          red_o[(wid * R_ROWS + r) * HV + VDIM(2 * t + e, db)] = O_OUT(o[db][2 * hr + e]);
      }
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int idx = get_local_id(0); idx < R_ROWS * HV; idx += WG) {
    const int r = idx / HV, d = idx % HV;
    if (!row_ok(P, w, r)) continue;
    MERGE_SUBGROUPS(float, R_ROWS, HV, r, d)
    const size_t row = part_row(P, w, r, split);
    // a padding row: o 0 and lse -inf, selected whatever it accumulated
    const bool live = row_live(P, w, r);
    o_parts[row * HV + d] = live ? finite_or_nan(oo * inv_sum(ll)) : 0.0f;
    if (d == 0)
      lse_parts[row] = live ? lse_of(mm + alibi_offset(P, w, r, kend), ll) : -INFINITY;
  }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void MMA_ENTRY(KERNEL_ARGS) {
  __local float red_m[NW * R_ROWS], red_l[NW * R_ROWS];
  __local float red_o[NW * R_ROWS * HV];
#if MMA_OUT == 2
  __local int last;
#endif
  SG_SCRATCH_DECL
  MMA_SCRATCH_DECL

  Rows w;
  int split;
  w = decompose(P, seqlens, kv_start, seqlens_q, (int)get_group_id(0), (int)P->n_splits,
                &split);
  const int2 kr = split_keys(P, &w, split);
  const int2 ckeys = common_keys(P, &w);
  KV_POINTERS(w)
  const int lid = get_local_id(0), lane = lid & 31, wid = lid >> 5, g = lane >> 2, t = lane & 3;
  const bool plain = !P->has_bias && !P->has_alibi && !(P->softcap > 0.0f);
  const float qk_p2 = qk_pow2(P->scale), qk_scale = P->scale / qk_p2;
  uint4 qa[2 * NDR];
  decode_q_frags(P, &w, q, g, t, qk_p2, qa);

  float o[NDB][4];
  MMA_ZERO(o, NDB)
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  const int nchunks = kr.y > kr.x ? (kr.y - kr.x + TK - 1) / TK : 0;
  // rounds 1 .. PL2 - 1 (round 0 is loaded now; round r prefetches round r + PL2)
  for (int d = 1; d < PL2; ++d) PREFETCH_CHUNK(wid + d * NW)
#if KV_Q == 1
  const float vmax = split_vmax(P, btab, vsb, kr, lane SG_SCRATCH_ARG), vinv = 1.0f / vmax;
#else
  const float vmax = 1.0f, vinv = 1.0f;       // (only int8's P and O take v_scale / vmax)
#endif
  CHUNK_REGS(ak, av, aks, avs)
#if PF
  FETCH_KV(wid, ak, av, aks, avs)
#endif
  // Every warp runs the same number of rounds (a round past the end is all masked).
  for (int base = 0; base < nchunks; base += NW) {
    const int ci = base + wid;
    const int t0 = kr.x + ci * TK, t1 = min(t0 + TK, kr.y);
    PREFETCH_CHUNK(ci + PL2 * NW)
    CHUNK_REGS(ck, cv, cks, cvs)
#if PF
    COPY_KV(ck, cv, cks, cvs, ak, av, aks, avs)
    FETCH_KV(ci + NW, ak, av, aks, avs)
#else
    FETCH_KV(ci, ck, cv, cks, cvs)
#endif
    float s[NKB][4];
    decode_scores(qa, CHUNK_ARGS(ck, cks), s MMA_SCRATCH_ARG);
    // Logits and the chunk's max per row (over the row's 4 lanes).
    const bool full = ci < nchunks && all_see(ckeys, t0, t1);
    const bool fast = plain && full && t1 - t0 == TK;
    MMA_LOGITS_TILE(s, mt, fast, g)
    MMA_SOFTMAX_TILE(s, mt, m, l, o)
    const float badf = decode_pv_chunk(s, CHUNK_ARGS(cv, cvs), full, vinv, o MMA_SCRATCH_ARG);
    nan_bad_columns(P, &w, btab, vb, vsb, g, t, t0, t1, full, badf, o SG_SCRATCH_ARG);
  }
  decode_mma_out(P, &w, split, kr.y, g, t, wid, vmax, m, l, o, red_m, red_l, red_o, o_parts,
                 lse_parts SG_SCRATCH_ARG);
#if MMA_OUT == 2
  fused_finish(P, &w, sink, o_parts, lse_parts, out, lse, tickets, &last);
#endif
}
