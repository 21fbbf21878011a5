// flash_prefill on matrix units: S = Q K^T and O += P V as m16n8k16 products (mma_sync.cl:
// tensor cores through PTX, or the same contract in plain OpenCL C). f16 specs, and bf16 ones
// with -D IS_BF16=1 (the fragments hold bf16 bits and the mma multiplies bf16; "f16" below
// stands for either); K/V in the spec's dtype, or int8 / int4 (KV_Q, below).
// A work-group of WG / 32 warps owns R_ROWS = 16 rows per warp (GC query heads of one GQA
// group x MQ query rows, as flash_core.cl's Rows); warp w owns rows 16w..16w+15, lane (g, t) rows
// 16w+g and 16w+g+8. Per tile of TK keys staged in local memory (f16 bits):
//   S = Q K^T stays in registers (the accumulator fragments), scaled in f32 after the
//   product; logits through flash_core.cl's finish_score_r (masks, softcap, bias, ALiBi,
//   the NaN rules), the row max over the 4 lanes of a row by sub-group xor shuffles;
//   P = exp(x - m) rounded to f16 becomes the A fragments of O += P V directly (the
//   accumulator layout of two 8-key blocks is the A layout of one 16-key chunk).
// The running max is lazy (as FlashAttention-4): a row keeps its reference max m until a
// tile's max exceeds it by more than TAU, so P <= e^TAU stays well inside f16 and O and l are
// rescaled only on those tiles.
// Non-finite values (docs/contract.md "Non-finite values and scalar fields"): keys no row of the
// work-group sees are never loaded (zeros); a non-finite v is staged as 0 (0 * NaN never reaches
// a row that does not see it) and flags its tile, whose slow path marks, per lane, the output
// columns of its rows that see it (re-read from global memory); they are written as NaN.
// The shapes real models need (docs/contract.md "Shapes real models need"): keys before
// kv_start[b] are outside the key range (never loaded), padding rows (past seqlens_q[b]) load no
// q and are written as out 0 and lse -inf, and V, O and out have HV (v_head_size) dims: Q K^T
// runs over HD, P V over HV.
// Quantized K/V (common.cl KV_Q 1: int8, 2: int4 q4_0): a granule of 8 values is fetched as
// its raw codes (8 bytes) and scale bits (a word), and dequantized only where it is stored to
// local memory (mma_tile.cl kvq_h8: exact codes times the scale in f32, rounded to f16 / bf16
// as P is); the tiles, their pitches and the rest of the kernel are those of K/V in the dtype.
// A value beyond f16's range stages as inf (a non-finite value, as V_BAD then says).
// Within each 16-wide chunk of the head dimension, lane t's k indices 2t, 2t+1, 2t+8, 2t+9
// are the dims 4t..4t+3 (A and B agree, so the dot product is unchanged), and V's keys are
// staged in the same order: every fragment is one 64-bit local read. Row pitches QW and VW
// (in words, from backends/opencl/mma.py) keep those reads free of bank conflicts.
// prefetch 2 (-D PF=2, float16 / bfloat16 K/V; layout and copies in mma_async.cl): the tiles
// are copied global -> local asynchronously into two buffers, the next tile's copies in
// flight while this one is computed; K and V stay row-major and their fragments come from
// ldmatrix (dims in the PTX order); a non-finite v is zeroed in local memory, on the tiles
// some row does not fully see, before the same slow path.

// The staged tile as the products read it, and Q's fragments: from registers (QREG) or Qs.
#if PF == 2
#define V_TILE Vs
#else
#define V_TILE Vt
#endif
#if QREG
#define Q_SRC qf
#define Q_SRC_PARAM uint4 qf[NDC]
#else
#define Q_SRC Qs
#define Q_SRC_PARAM __local const uint* Qs
#endif

// S = Q K^T for this warp's 16 rows (lane (g, t): r0 and r0 + 8) and the staged tile's keys.
inline void prefill_scores(Q_SRC_PARAM, __local const uint* Ks, int r0, int g, int t, int lane,
                           float s[NKB][4] MMA_SCRATCH_PARAM) {
  MMA_ZERO(s, NKB)
  UNROLL
  for (int dc = 0; dc < NDC; ++dc) {
    const uint4 a = Q_FRAG(dc);
    MMA_BLOCKS(s, NKB, a, K_BFRAG2, K_BFRAG1)
  }
}

// O += P V: P (f16) straight from the S fragments, V's from the staged tile.
inline void prefill_pv(float s[NKB][4], __local const uint* V_TILE, int g, int t, int lane,
                       float o[NDB][4] MMA_SCRATCH_PARAM) {
  UNROLL
  for (int kc = 0; kc < NKC; ++kc) {
    const uint4 a = MMA_P_FRAGMENT(s, kc);
    MMA_BLOCKS(o, NDB, a, V_BFRAG2, V_BFRAG1)
  }
}

// A non-finite v in the tile of tn keys from t0: mark (vbad) the columns of this lane's rows
// (r0, r0 + 8) that see it. Bit 2 db + e (of word / 64): column 8 db + 2t + e of row hr sees
// a bad v.
inline void mark_bad_v(PARAMS P, const Rows* w, const __global int* btab,
                       const __global kv_t* vb, const __global scale_t* vsb, int r0, int t,
                       int t0, int tn, ulong vbad[2][VBW]) {
  UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r0 + 8 * hr;
    if (!row_ok(P, w, r)) continue;
    for (int jj = 0; jj < tn; ++jj) {
      if (!key_seen(P, w, r, t0 + jj)) continue;
      const size_t off = VOFF(KOFF(t0 + jj));
      for (int db = 0; db < NDB; ++db)
        for (int e = 0; e < 2; ++e)
          if (V_BAD(vb, vsb, off, 8 * db + 2 * t + e))
            vbad[hr][VB_WORD(2 * db + e)] |= 1UL << ((2 * db + e) % 64);
    }
  }
}

// Row sums over the row's 4 lanes; then sink, normalisation, out and lse (kend: the key
// range's end, for the absolute lse), NaN in the columns vbad marks.
inline void mma_prefill_out(PARAMS P, const Rows* w, int kend, const __global float* sink,
                            __global elem_t* out, __global float* lse, int r0, int t,
                            float m[2], float l[2], float o[NDB][4],
                            ulong vbad[2][VBW] SG_SCRATCH_PARAM) {
  UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] += SG_XOR(l[hr], 1);
    l[hr] += SG_XOR(l[hr], 2);
  }
  UNROLL
  for (int hr = 0; hr < 2; ++hr) {
    const int r = r0 + 8 * hr;
    if (!row_ok(P, w, r)) continue;
    const int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
    // a padding row: out 0 and lse -inf, selected whatever it accumulated
    const bool live = row_live(P, w, r);
    float mm = m[hr] + alibi_offset(P, w, r, kend), ll = l[hr], f = 1.0f;
    if (P->has_sink && live) f = join_sink(sink[h], &mm, &ll);
    const float inv = inv_sum(ll) * f;
    const size_t base = OUT_OFF(P, w->b, h, i) + 2 * t;
    UNROLL
    for (int db = 0; db < NDB; ++db) {
      float2 y = (float2)(finite_or_nan(o[db][2 * hr] * inv),
                          finite_or_nan(o[db][2 * hr + 1] * inv));
      const ulong bits = vbad[hr][VB_WORD(2 * db)] >> ((2 * db) % 64);
      if (bits & 1UL) y.x = NAN;
      if ((bits >> 1) & 1UL) y.y = NAN;
      y = live ? y : (float2)(0.0f);     // (ST2_OUT's parameter y is also its .y)
      ST2_OUT(y, out, base + 8 * db);
    }
    if (P->return_lse && t == 0)
      lse[((size_t)w->b * P->num_heads + h) * P->seq_len + i] = live ? lse_of(mm, ll) : -INFINITY;
  }
}

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void flash_prefill(KERNEL_ARGS) {
#if PF == 2
  __local uint smem[SM_WORDS] __attribute__((aligned(16)));
  __local uint* const Qs = smem + Q_AT;
#else
  __local uint Qs[R_ROWS * QW] __attribute__((aligned(16)));
  __local uint Ks[TK * QW] __attribute__((aligned(16)));
  __local uint Vt[HV * VW] __attribute__((aligned(16)));
#endif
  __local int vflag;
  SG_SCRATCH_DECL
  MMA_SCRATCH_DECL

  // Rows and keys: row tiles last-first (under causal masking the late ones have the most
  // keys), keys [kr.x, kr.y) that any row of the work-group may see.
  Rows w;
  int split;
  w = decompose(P, seqlens, kv_start, seqlens_q,
                (int)get_num_groups(0) - 1 - (int)get_group_id(0), 1, &split);
  const int2 kr = key_range(P, &w, 0, (int)P->capacity);
  const Tiles ts = dense_tiles(kr);
  const int2 ckeys = common_keys(P, &w);
  KV_POINTERS(w)
  const int lid = get_local_id(0), lane = lid & 31, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * (lid >> 5) + g;            // this lane's rows: r0 and r0 + 8
  // Logits are the scaled product where nothing but the scale applies (a uniform choice).
  const bool plain = !P->has_bias && !P->has_alibi && !(P->softcap > 0.0f);
  const float qk_p2 = qk_pow2(P->scale), qk_scale = P->scale / qk_p2;
  stage_q(P, &w, q, qk_p2, Qs);
  if (lid == 0) vflag = 0;
  barrier(CLK_LOCAL_MEM_FENCE);
#if QREG
  uint4 qf[NDC];                  // this warp's Q fragments, read once (the tile's words are
  UNROLL                          // the K / V buffers' from here)
  for (int dc = 0; dc < NDC; ++dc) qf[dc] = q_frag(Qs, r0, dc, t);
  barrier(CLK_LOCAL_MEM_FENCE);
#endif

  float o[NDB][4];
  MMA_ZERO(o, NDB)
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  ulong vbad[2][VBW];             // the columns that see a non-finite v (mark_bad_v)
  UNROLL
  for (int u = 0; u < VBW; ++u) vbad[0][u] = vbad[1][u] = 0;

  int2 tr = tile_keys(&ts, blk_ids, 0);
#if PF == 2
  if (ts.count > 0) ASYNC_TILE(tr.x, tr.y, smem)
  CP_COMMIT();
#else
  gran_t pk[NLK], pv[2 * NLV];
  SC_REGS
#if PF
  MMA_FETCH(tr.x, tr.y)
#endif
#endif
  for (int it = 0; it < ts.count; ++it) {
    const int t0 = tr.x, t1 = tr.y, tn = t1 - t0;
#if PF == 2
    __local const uint* const Ks = smem + (it & 1) * KV_BUF;
    __local uint* const Vs = smem + (it & 1) * KV_BUF + TK * KW;
    tr = async_step(P, btab, kb, vb, &ts, blk_ids, it, ckeys, t0, t1, smem, &vflag);
#else
    tr = reg_step(P, btab, kb, vb, ksb, vsb, &ts, blk_ids, it, t0, t1, pk, pv SC_ARGS, Ks, Vt,
                  &vflag);
#endif
    float s[NKB][4];
    prefill_scores(Q_SRC, Ks, r0, g, t, lane, s MMA_SCRATCH_ARG);
    // Logits and the tile's max per row (over the row's 4 lanes).
    const bool fast = plain && tn == TK && all_see(ckeys, t0, t1);
    MMA_LOGITS_TILE(s, mt, fast, r0)
    MMA_SOFTMAX_TILE(s, mt, m, l, o)
    prefill_pv(s, V_TILE, g, t, lane, o MMA_SCRATCH_ARG);
    if (vflag == it + 1) mark_bad_v(P, &w, btab, vb, vsb, r0, t, t0, tn, vbad);
    barrier(CLK_LOCAL_MEM_FENCE);      // this tile's readers are done
  }
  mma_prefill_out(P, &w, kr.y, sink, out, lse, r0, t, m, l, o, vbad SG_SCRATCH_ARG);
}
