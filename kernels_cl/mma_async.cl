// flash_prefill_mma.cl's local-memory pipeline (param prefetch 2, -D PF=2): K and V tiles
// copied global -> local without passing through registers, two tiles in flight, and V's B
// fragments read from its row-major tile with a transposing load. Two builds of one contract
// (-D MMA, as mma_sync.cl):
//   1  PTX cp.async (16 bytes, cache-global, L2 fetch hint 256 B, zero-filling source size)
//      and ldmatrix .trans, given the 32-bit local addresses of __local pointers
//      (bench/ptx_async_probe.py checks both on the device)
//   2  plain OpenCL C: the copy is an ordinary load and store, the transposing load reads the
//      same halves one by one, so the kernel's indexing runs unchanged on any device
// A copy lands when the work-item that issued it has waited for its group (CP_WAIT) and the
// work-group has met a barrier.

#if MMA == 1
// 16 bytes from SRC to DST (16-byte aligned), or 16 zero bytes when !VALID (nothing read).
inline void cp_async16(__local uint* dst, const __global void* src, bool valid) {
  const uint sa = (uint)(ulong)dst, n = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;"
               :: "r"(sa), "l"(src), "r"(n) : "memory");
}
#define CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
// Waits until at most N (a literal) of this work-item's committed groups are in flight.
#define CP_WAIT_N(N) asm volatile("cp.async.wait_group " #N ";" ::: "memory")
#define CP_WAIT(N) CP_WAIT_N(N)

// B fragments (mma_sync.cl layout) of P V for the 16 keys of chunk KC and the 8-dim blocks DB
// and DB + 1, from V row-major in local memory (rows of VW words, 16-byte aligned): .x, .y
// for DB, .z, .w for DB + 1. Lane l names row l % 8 of 8x8 matrix l / 8: keys 16 KC + 8
// (m & 1) + l % 8, dims 8 (DB + m / 2) ..; .trans hands lane (g, t) the keys 2t, 2t + 1 of
// dim g, which is B's column-major fragment.
inline uint4 v_frag2(__local const uint* vs, int kc, int db, int lane) {
  const int mt = lane >> 3;
  const uint sa = (uint)(ulong)(vs + (16 * kc + 8 * (mt & 1) + (lane & 7)) * VW
                                + 4 * (db + (mt >> 1)));
  uint a, b, c, d;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(sa));
  return (uint4)(a, b, c, d);
}

// B fragments of S = Q K^T for the 16 dims of chunk DC and the 8-key blocks NB and NB + 1,
// from K row-major in local memory (rows of KW words, 16-byte aligned): .x, .y for NB, .z,
// .w for NB + 1.
// Lane l names row l % 8 of matrix l / 8: key 8 (NB + m / 2) + l % 8, dims 16 DC + 8 (m & 1)
// ..; lane (g, t) receives key g's dims 2t, 2t + 1 (of each 8), B's fragment.
inline uint4 k_frag2(__local const uint* ks, int kw, int nb, int dc, int lane) {
  const int mt = lane >> 3;
  const uint sa = (uint)(ulong)(ks + (8 * (nb + (mt >> 1)) + (lane & 7)) * kw + 8 * dc
                                + 4 * (mt & 1));
  uint a, b, c, d;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(sa));
  return (uint4)(a, b, c, d);
}

#else

inline void cp_async16(__local uint* dst, const __global void* src, bool valid) {
  *(__local uint4*)dst = valid ? *(const __global uint4*)src : (uint4)(0u);
}
#define CP_COMMIT()
#define CP_WAIT(N)

// The same fragments, each word or half read where ldmatrix would take it from.
inline uint v_pair(__local const uint* vs, int key, int dim) {
  __local const ushort* h = (__local const ushort*)vs;
  return (uint)h[key * 2 * VW + dim] | ((uint)h[(key + 1) * 2 * VW + dim] << 16);
}
inline uint4 k_frag2(__local const uint* ks, int kw, int nb, int dc, int lane) {
  __local const uint* const r = ks + (8 * nb + (lane >> 2)) * kw + 8 * dc + (lane & 3);
  return (uint4)(r[0], r[4], r[8 * kw], r[8 * kw + 4]);
}
inline uint4 v_frag2(__local const uint* vs, int kc, int db, int lane) {
  const int g = lane >> 2, t = lane & 3, k0 = 16 * kc + 2 * t;
  return (uint4)(v_pair(vs, k0, 8 * db + g), v_pair(vs, k0 + 8, 8 * db + g),
                 v_pair(vs, k0, 8 * db + 8 + g), v_pair(vs, k0 + 8, 8 * db + 8 + g));
}

#endif

// prefetch 2's layout: two buffers, each a K tile (rows of KW words) then a V tile (rows of
// VW words), both row-major at backends/opencl/mma.ldsm_pitch (odd multiples of 4 words: the
// 8 rows of each ldmatrix phase on distinct banks). With QREG (mma.async_q_in_registers) Q's
// fragments live in registers and Q's staging words are the buffers'; else Q follows them.
// Measured on the H100 (ci/results/h100_prefill_async.txt): more buffers of 16-key tiles
// were slower (causal S=2048 295-300 us with 3 or 4 against 268 with two of 32 keys), and so
// was this loop written for any buffer count (321 us); K's fragments by ldmatrix 264 us
// against 269 with the 64-bit reads of prefetch 0 / 1.
#if PF == 2
#define KV_BUF (TK * KW + TK * VW)          // words of one buffer
#if QREG
#define Q_AT 0
#define SM_WORDS (2 * KV_BUF > R_ROWS * QW ? 2 * KV_BUF : R_ROWS * QW)
#define Q_FRAG(dc) qf[dc]
#else
#define Q_AT (2 * KV_BUF)
#define SM_WORDS (2 * KV_BUF + R_ROWS * QW)
#endif
// Rows [T0, T0 + TK) of K or V (W8 16-byte granules each, row j at OFF(j) of SRC) into DST
// (rows of PITCH words): zeros past T1, where nothing is read. Expands inside the kernel,
// whose lid it reads.
#define ASYNC_ROWS(DST, PITCH, SRC, W8, OFF, T0, T1)                            \
  UNROLL                                                                        \
  for (int n_ = 0; n_ < (TK * (W8) + WG - 1) / WG; ++n_) {                      \
    const int idx_ = lid + n_ * WG, j_ = idx_ / (W8), c_ = idx_ % (W8);         \
    const bool ok_ = (T0) + j_ < (T1);                                          \
    if (idx_ < TK * (W8))                                                       \
      cp_async16((DST) + j_ * (PITCH) + 4 * c_,                                 \
                 (SRC) + (ok_ ? OFF((T0) + j_) + 8 * c_ : 0), ok_);             \
  }
#define ASYNC_VOFF(j) VOFF(KOFF(j))
// Tile [T0, T1) into the buffer at BUF (the kernel's kb, vb).
#define ASYNC_TILE(T0, T1, BUF)                                                 \
  {                                                                             \
    ASYNC_ROWS((BUF), KW, kb, HD8, KOFF, T0, T1)                                \
    ASYNC_ROWS((BUF) + TK * KW, VW, vb, HV8, ASYNC_VOFF, T0, T1)                \
  }
#else
#define QREG 0
#endif
