// flash_prefill_mma.cl's tiles (the kernel and its account: flash_prefill_mma.cl, which follows
// this file in the program): the tile geometry, granules as fetched (f16 / bf16 bits or
// quantized codes), the fetch of a tile into registers, Q's fragments, the products' block
// loops, and the two staging steps (prefetch 2 asynchronous; 0 / 1 through registers).

#define NKB (TK / 8)            // 8-key blocks of S per tile
#define NKC (TK / 16)           // 16-key chunks of P V per tile
#define NDC (HD / 16)           // 16-dim chunks of Q K^T
#define NDB (HV / 8)            // 8-dim blocks of O
#define HD8 (HD / 8)            // uint4 granules (8 halves) per K row
#define HV8 (HV / 8)            // per V row
#define NLK ((TK * HD8 + WG - 1) / WG)       // K granules per work-item and tile
#define NLV ((TK / 2 * HV8 + WG - 1) / WG)   // V granule pairs (keys 2p, 2p+1) per work-item
#define VBW ((2 * NDB + 63) / 64)            // words of a row's bad-v column bits
// The word of column bit B (a constant 0 up to HV 256: one register, as before)
#define VB_WORD(B) (VBW == 1 ? 0 : (B) / 64)
// Two outputs of a row, rounded to the storage type (to nearest even).
#if IS_BF16
#define ST2_OUT(y, p, i) \
  vstore2((ushort2)((ushort)f2bf_bits((y).x), (ushort)f2bf_bits((y).y)), 0, (p) + (i))
#else
#define ST2_OUT(y, p, i) vstore_half2_rte((y), 0, (p) + (i))
#endif
// Tile position of key jj: within each 16 keys, 2t+e -> 4t+e and 8+2t+e -> 4t+2+e (keys 2p
// and 2p+1 stay neighbours: one word of the transposed V holds both).
inline int v_slot(int jj) {
  const int c = jj & 15;
  return (jj - c) + 4 * ((c & 7) >> 1) + 2 * (c >> 3) + (c & 1);
}

// Granules of 8 values as fetched: f16 (bf16) bits, or quantized K/V's raw codes with their
// scale bits in a word of their own (mma_tile.cl KVQ_CODES / KVQ_SCALE), converted to the
// fragments' type only when stored to local memory (kvq_h8), so the loads stay in flight.
#if KV_Q
typedef uint2 gran_t;
#define GRAN_ZERO ((uint2)(0u))
#define SC_REGS uint pks[NLK], pvs[2 * NLV];
#define SC_ZERO(x) x = 0u;
#define K_GRAN(n, R, D) \
  { pk[n] = KVQ_CODES(kb, R, D); pks[n] = KVQ_SCALE(ksb, R, D, HD); }
#define V_GRAN(n, R, D) \
  { pv[n] = KVQ_CODES(vb, R, D); pvs[n] = KVQ_SCALE(vsb, R, D, HV); }
#define K_H8(n, D) kvq_h8(pk[n], pks[n], D)
#define V_H8(n, D) kvq_h8(pv[n], pvs[n], D)
#else
typedef uint4 gran_t;
#define GRAN_ZERO ((uint4)(0u))
#define SC_REGS
#define SC_ZERO(x)
#define K_GRAN(n, R, D) pk[n] = LD16(kb, (R) + (D))
#define V_GRAN(n, R, D) pv[n] = LD16(vb, (R) + (D))
#define K_H8(n, D) pk[n]
#define V_H8(n, D) pv[n]
#endif

// The tile [T0, T1) into registers (zeros past T1; nothing beyond is read): K granules
// row-major, V granules of neighbouring keys in pairs, key pairs fastest (so neighbouring
// work-items store neighbouring words of the transposed tile). (Zero codes with zero scale
// bits are 0 in every storage.)
#define MMA_FETCH(T0, T1)                                                   \
  UNROLL                                                                    \
  for (int n = 0; n < NLK; ++n) {                                           \
    const int idx_ = lid + n * WG, jk_ = idx_ / HD8;                        \
    pk[n] = GRAN_ZERO;                                                      \
    SC_ZERO(pks[n])                                                         \
    if (idx_ < TK * HD8 && (T0) + jk_ < (T1))                               \
      K_GRAN(n, KOFF((T0) + jk_), 8 * (idx_ % HD8));                        \
  }                                                                         \
  UNROLL                                                                    \
  for (int n = 0; n < NLV; ++n) {                                           \
    const int idx_ = lid + n * WG, j_ = (T0) + 2 * (idx_ % (TK / 2));       \
    const int c_ = 8 * (idx_ / (TK / 2));                                   \
    pv[2 * n] = GRAN_ZERO;                                                  \
    pv[2 * n + 1] = GRAN_ZERO;                                              \
    SC_ZERO(pvs[2 * n])                                                     \
    SC_ZERO(pvs[2 * n + 1])                                                 \
    if (idx_ < TK / 2 * HV8 && j_ < (T1)) {                                 \
      V_GRAN(2 * n, VOFF(KOFF(j_)), c_);                                    \
      if (j_ + 1 < (T1)) V_GRAN(2 * n + 1, VOFF(KOFF(j_ + 1)), c_);         \
    }                                                                       \
  }
#ifndef Q_FRAG
#define Q_FRAG(dc) q_frag(Qs, r0, dc, t)
#endif
// Q's A fragment of 16-dim chunk DC for rows R0 and R0 + 8: dims in the order of the note at
// the top (one 64-bit read per row), or with prefetch 2, whose K fragments come from
// ldmatrix, in the PTX order (k 2t, 2t + 1 are dims 2t, 2t + 1 of the chunk, k 2t + 8,
// 2t + 9 dims 2t + 8, 2t + 9) in both operands.
inline uint4 q_frag(__local const uint* qs, int r0, int dc, int t) {
#if PF == 2
  __local const uint* const a = qs + r0 * QW + 8 * dc + t;
  return (uint4)(a[0], a[8 * QW], a[4], a[8 * QW + 4]);
#else
  const uint2 lo = *(__local const uint2*)(qs + r0 * QW + 8 * dc + 2 * t);
  const uint2 hi = *(__local const uint2*)(qs + (r0 + 8) * QW + 8 * dc + 2 * t);
  return (uint4)(lo.x, hi.x, lo.y, hi.y);
#endif
}

// C[n] += A B_n over the N 8-wide blocks n of a product with the staged tile: with prefetch 2
// one ldmatrix gives the B fragments of blocks n and n + 1 (FRAG2(n), a uint4), otherwise
// each is one 64-bit local read (FRAG1(n), a uint2). K's fragments for 16-dim chunk dc of S
// (8-key blocks), V's for 16-key chunk kc of O (8-dim blocks), in the order of the note at the
// top (dc, kc, g, t and lane from the kernel).
#if PF == 2
#define MMA_BLOCKS(C, N, A, FRAG2, FRAG1)                                     \
  UNROLL                                                                    \
  for (int n_ = 0; n_ < (N); n_ += 2) {                                     \
    const uint4 b_ = FRAG2(n_);                                             \
    MMA_SYNC(C[n_], A, b_.xy);                                              \
    MMA_SYNC(C[n_ + 1], A, b_.zw);                                          \
  }
#else
#define MMA_BLOCKS(C, N, A, FRAG2, FRAG1)                                     \
  UNROLL                                                                    \
  for (int n_ = 0; n_ < (N); ++n_) {                                        \
    const uint2 b_ = FRAG1(n_);                                             \
    MMA_SYNC(C[n_], A, b_);                                                 \
  }
#endif
#define K_BFRAG2(nb) k_frag2(Ks, KW, nb, dc, lane)
#define K_BFRAG1(nb) *(__local const uint2*)(Ks + (8 * (nb) + g) * QW + 8 * dc + 2 * t)
#define V_BFRAG2(db) v_frag2(Vs, kc, db, lane)
#define V_BFRAG1(db) *(__local const uint2*)(Vt + (8 * (db) + g) * VW + 8 * kc + 2 * t)

// Quantized K/V's scale bits beside the fetched granules, as parameters and arguments.
#if KV_Q
#define SC_PARAMS , uint pks[NLK], uint pvs[2 * NLV]
#define SC_ARGS , pks, pvs
#else
#define SC_PARAMS
#define SC_ARGS
#endif

// The Q tile into Qs (f16 bits raw, bf16 bits times the scale's power of two qk_p2; the rest
// of the scale is applied to the f32 scores: mma_tile.cl qk_scale), invalid and padding rows
// zero.
inline void stage_q(PARAMS P, const Rows* w, const __global elem_t* q, float qk_p2,
                    __local uint* Qs) {
  for (int idx = get_local_id(0); idx < R_ROWS * HD8; idx += WG) {
    const int r = idx / HD8, c = idx % HD8;
    uint4 x = (uint4)(0u);
    if (row_live(P, w, r))
      x = LD16(q, (size_t)w->b * P->q_sb + (size_t)(w->h0 + r / MQ) * P->q_sh
                  + (size_t)(w->i0 + r % MQ) * P->q_ss + 8 * c);
    vstore4(q_prescale(x, qk_p2), 0, Qs + r * QW + 4 * c);
  }
}

#if PF == 2
// Prefetch 2's step into tile `it` (keys [t0, t1)): the next tile's copies started into the
// other buffer (its keys returned), this tile's waited for (the next tile's may still fly);
// where some row does not see all of its keys (masks, or a bias that may be -inf) a
// non-finite v is zeroed, as the staged tiles of prefetch 0 / 1 do, and flags the tile
// (vflag: the slow path).
inline int2 async_step(PARAMS P, const __global int* btab, const __global kv_t* kb,
                       const __global kv_t* vb, const Tiles* ts, const __global int* ids,
                       int it, int2 ckeys, int t0, int t1, __local uint* smem,
                       __local int* vflag) {
  const int lid = get_local_id(0);
  __local uint* const Vs = smem + (it & 1) * KV_BUF + TK * KW;
  const int2 tr = tile_keys(ts, ids, it + 1);
  if (it + 1 < ts->count) ASYNC_TILE(tr.x, tr.y, smem + ((it + 1) & 1) * KV_BUF)
  CP_COMMIT();
  CP_WAIT(1);
  barrier(CLK_LOCAL_MEM_FENCE);
  if (P->has_bias || !all_see(ckeys, t0, t1)) {
    for (int idx = lid; idx < (t1 - t0) * HV8; idx += WG) {
      __local uint* const p = Vs + idx / HV8 * VW + 4 * (idx % HV8);
      const uint4 x = vload4(0, p);
      const uint4 y = (uint4)(finite_halves(x.x), finite_halves(x.y), finite_halves(x.z),
                              finite_halves(x.w));
      if (any(x != y)) {
        vstore4(y, 0, p);
        *vflag = it + 1;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  return tr;
}
#else
// Prefetch 0 / 1's step into tile `it` (keys [t0, t1)): the tile fetched into registers now
// (0: they live only until the stores) or in the last round (1), staged (quantized K/V
// dequantized here): K as is, V transposed (dims x keys, keys in v_slot order) with
// non-finite halves zeroed and the tile flagged (vflag); then (1) the next tile's loads
// started, to fly while this one is computed. Returns the next tile's keys.
inline int2 reg_step(PARAMS P, const __global int* btab, const __global kv_t* kb,
                     const __global kv_t* vb, const __global scale_t* ksb,
                     const __global scale_t* vsb, const Tiles* ts, const __global int* ids,
                     int it, int t0, int t1, gran_t pk[NLK], gran_t pv[2 * NLV] SC_PARAMS,
                     __local uint* Ks, __local uint* Vt, __local int* vflag) {
  const int lid = get_local_id(0);
#if !PF
  MMA_FETCH(t0, t1)
#endif
  UNROLL
  for (int n = 0; n < NLK; ++n) {
    const int idx = lid + n * WG;
    if (idx < TK * HD8)
      vstore4(K_H8(n, 8 * (idx % HD8)), 0, Ks + idx / HD8 * QW + 4 * (idx % HD8));
  }
  UNROLL
  for (int n = 0; n < NLV; ++n) {
    const int idx = lid + n * WG;
    if (idx < TK / 2 * HV8) {
      const int word = v_slot(2 * (idx % (TK / 2))) / 2, d0 = 8 * (idx / (TK / 2));
      const uint4 xa = V_H8(2 * n, d0), xb = V_H8(2 * n + 1, d0);
      const uint wa[4] = {xa.x, xa.y, xa.z, xa.w};
      const uint wb[4] = {xb.x, xb.y, xb.z, xb.w};
      bool bad = false;
      UNROLL
      for (int e = 0; e < 4; ++e) {     // dims d0 + 2e (low halves), d0 + 2e + 1 (high)
        const uint a = finite_halves(wa[e]), b = finite_halves(wb[e]);
        bad = bad || a != wa[e] || b != wb[e];
        Vt[(d0 + 2 * e) * VW + word] = (a & 0xffffu) | (b << 16);
        Vt[(d0 + 2 * e + 1) * VW + word] = (a >> 16) | (b & 0xffff0000u);
      }
      if (bad) *vflag = it + 1;
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const int2 tr = tile_keys(ts, ids, it + 1);
#if PF
  MMA_FETCH(tr.x, tr.y)
#endif
  return tr;
}
#endif

