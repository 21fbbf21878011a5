// decode_mma.cl's memory hints, after mma_kvq.cl: the L2 prefetch (the decodes' param
// l2_prefetch, -D PL2) and the cache qualifiers of its K/V loads (below).
// PREFETCH_CHUNK(CI) expands inside decode_mma.cl's kernel, whose kb, vb, ksb, vsb, kr,
// nchunks and lane it reads.
// PL2 (NVIDIA builds): the chunk PL2 rounds ahead of the one computed is prefetched into L2
// (PTX prefetch.global.L2: no registers held, unlike PF), its K and V rows (and int8 / int4
// scales) as 128-byte lines spread over the warp's lanes, so its loads meet L2, not DRAM.
#ifndef PL2
#define PL2 0
#endif
#if KV_Q
#define KROW_B(j) KBYTES(KOFF(j))
#define VROW_B(j) VBYTES(VOFF(KOFF(j)))
#define KROW_LEN (KV_Q == 1 ? HD : HD / 2)
#define VROW_LEN (KV_Q == 1 ? HV : HV / 2)
#else
#define KROW_B(j) ((const __global uchar*)(kb + KOFF(j)))
#define VROW_B(j) ((const __global uchar*)(vb + VOFF(KOFF(j))))
#define KROW_LEN (2 * HD)
#define VROW_LEN (2 * HV)
#endif
#define KROW_LINES ((KROW_LEN + 127) / 128)
#define VROW_LINES ((VROW_LEN + 127) / 128)
#if MMA == 1 && PL2
inline void pf_l2(const __global void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }
#if KV_Q == 1
#define PF_SCALES(j)                                                            \
  {                                                                             \
    pf_l2(ksb + KOFF(j) / HD);                                                  \
    pf_l2(vsb + KOFF(j) / HD);                                                  \
  }
#elif KV_Q == 2
#define PF_SCALES(j)                                                            \
  {                                                                             \
    pf_l2((const __global ushort*)ksb + KOFF(j) / 32);                          \
    pf_l2((const __global ushort*)vsb + VOFF(KOFF(j)) / 32);                    \
  }
#else
#define PF_SCALES(j) {}
#endif
#define PREFETCH_CHUNK(CI)                                                      \
  if ((CI) < nchunks) {                                                         \
    const int j0_ = kr.x + (CI) * TK;                                           \
    for (int i_ = lane; i_ < TK * KROW_LINES; i_ += 32) {                       \
      const int j_ = j0_ + i_ / KROW_LINES;                                     \
      if (j_ < kr.y) pf_l2(KROW_B(j_) + 128 * (i_ % KROW_LINES));               \
    }                                                                           \
    for (int i_ = lane; i_ < TK * VROW_LINES; i_ += 32) {                       \
      const int j_ = j0_ + i_ / VROW_LINES;                                     \
      if (j_ < kr.y) pf_l2(VROW_B(j_) + 128 * (i_ % VROW_LINES));               \
    }                                                                           \
    if (lane < TK && j0_ + lane < kr.y) PF_SCALES(j0_ + lane)                   \
  }
#else
#define PREFETCH_CHUNK(CI) {}
#endif

// The decode's K/V loads in NVIDIA builds: ld.global.nc (the read-only path: K and V do not
// change during the kernel), L1::no_allocate (each byte is read once: caching it in L1 only
// evicts the lines other warps still need) and an L2 fetch-size hint of 256 bytes. Measured on
// the H100 (GQA 32/8 H=128 L=32768 decode_fused, GPU time, one run): f16 62.4 vs 68.4 us with
// plain loads, bf16 62.3 vs 68.7, int8 45.8 vs 50.1, int4 47.6 vs 48.2; without .nc 62.4,
// without the L2 hint 63.1, L1::evict_first instead 63.7, .nc and the hint alone 68.6.
#if MMA == 1
#define LDG_Q ".nc.L1::no_allocate.L2::256B"
inline uint4 ldg_v4(const __global uint4* p) {
  uint a, b, c, d;
  asm("ld.global" LDG_Q ".v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
  return (uint4)(a, b, c, d);
}
inline uint2 ldg_v2(const __global uint2* p) {
  uint a, b;
  asm("ld.global" LDG_Q ".v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
  return (uint2)(a, b);
}
inline uint ldg_v1(const __global uint* p) {
  uint a;
  asm("ld.global" LDG_Q ".u32 %0, [%1];" : "=r"(a) : "l"(p));
  return a;
}
#define LDG_V4(p) ldg_v4(p)
#define LDG_V2(p) ldg_v2(p)
#define LDG_V1(p) ldg_v1(p)
#else
#define LDG_V4(p) (*(p))
#define LDG_V2(p) (*(p))
#define LDG_V1(p) (*(p))
#endif
// A run of 8 f16 / bf16 values of K or V (D a multiple of 8) as fragment bits (16 bytes).
#define KV_LD16(p, s, R, D) LDG_V4((const __global uint4*)((p) + (R) + (D)))
