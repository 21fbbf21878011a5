// decode_mma.cl's L2 prefetch (the decodes' param l2_prefetch, -D PL2), after mma_kvq.cl:
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
