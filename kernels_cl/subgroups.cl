// Sub-group operations for the sg variants, one spelling per mechanism (-D SG_IMPL):
//   1 cl_khr_subgroups (+ cl_khr_subgroup_shuffle for SG_XOR), 2 cl_intel_subgroups,
//   3 NVIDIA warps through inline PTX, 9 a local-memory emulation the tests run anywhere.
// SG_MAX/SG_SUM reduce over the sub-group, SG_BCAST(x, i) reads lane i (i uniform),
// SG_XOR(x, m) reads lane (lane ^ m).

#if SG_IMPL == 1
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#pragma OPENCL EXTENSION cl_khr_subgroup_shuffle : enable
#define SG_LANE ((int)get_sub_group_local_id())
#define SG_ID ((int)get_sub_group_id())
#define SG_MAX(x) sub_group_reduce_max(x)
#define SG_SUM(x) sub_group_reduce_add(x)
#define SG_BCAST(x, i) sub_group_broadcast((x), (uint)(i))
#define SG_XOR(x, m) sub_group_shuffle_xor((x), (uint)(m))
#define SG_SCRATCH_DECL
#elif SG_IMPL == 2
#pragma OPENCL EXTENSION cl_intel_subgroups : enable
#define SG_LANE ((int)get_sub_group_local_id())
#define SG_ID ((int)get_sub_group_id())
#define SG_MAX(x) sub_group_reduce_max(x)
#define SG_SUM(x) sub_group_reduce_add(x)
#define SG_BCAST(x, i) intel_sub_group_shuffle((x), (uint)(i))
#define SG_XOR(x, m) intel_sub_group_shuffle_xor((x), (uint)(m))
#define SG_SCRATCH_DECL
#elif SG_IMPL == 3
// NVIDIA's OpenCL has no sub-group extension, but its warps are sub-groups of 32
// consecutive work-items and its compiler accepts inline PTX.
inline float nv_xor(float x, int mask) {
  float r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(x), "r"(mask));
  return r;
}
inline float nv_idx(float x, int lane) {
  float r;
  asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(x), "r"(lane));
  return r;
}
inline float nv_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmax(x, nv_xor(x, o));
  return x;
}
inline float nv_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += nv_xor(x, o);
  return x;
}
#define SG_LANE ((int)(get_local_id(0) & 31))
#define SG_ID ((int)(get_local_id(0) >> 5))
#define SG_MAX(x) nv_max(x)
#define SG_SUM(x) nv_sum(x)
#define SG_BCAST(x, i) nv_idx((x), (i))
#define SG_XOR(x, m) nv_xor((x), (m))
#define SG_SCRATCH_DECL
#elif SG_IMPL == 9
// Same code path through local memory (slow: two barriers per operation; every call
// site is work-group uniform, which the sg kernels guarantee).
inline float emu_op(__local float* scr, float x, int op, int src) {
  const int lid = get_local_id(0), base = lid - lid % SG;
  barrier(CLK_LOCAL_MEM_FENCE);
  scr[lid] = x;
  barrier(CLK_LOCAL_MEM_FENCE);
  if (op == 2) return scr[base + src];
  if (op == 3) return scr[base + ((lid % SG) ^ src)];
  float r = scr[base];
  for (int i = 1; i < SG; ++i) r = op ? r + scr[base + i] : fmax(r, scr[base + i]);
  return r;
}
#define SG_LANE ((int)(get_local_id(0) % SG))
#define SG_ID ((int)(get_local_id(0) / SG))
#define SG_MAX(x) emu_op(sg_scr, (x), 0, 0)
#define SG_SUM(x) emu_op(sg_scr, (x), 1, 0)
#define SG_BCAST(x, i) emu_op(sg_scr, (x), 2, (i))
#define SG_XOR(x, m) emu_op(sg_scr, (x), 3, (m))
#define SG_SCRATCH_DECL __local float sg_scr[WG];
#endif

// Functions that use sub-group operations take the emulation's scratch as a parameter.
#if SG_IMPL == 9
#define SG_SCRATCH_PARAM , __local float* sg_scr
#define SG_SCRATCH_ARG , sg_scr
#else
#define SG_SCRATCH_PARAM
#define SG_SCRATCH_ARG
#endif

// The decodes' end (decode_core.cl's sub-group variant, decode_mma.cl): row R's states of the
// work-group's NW sub-groups, left in local memory red_m, red_l ([NW][ROWS]) and red_o
// ([NW][ROWS][COLS]), merged at column COL: declares mm (the largest max), ll (the sum) and oo
// (of type T) with each sub-group's share weighed by exp(its max - mm) (mm -inf: by exp(max)).
#define MERGE_SUBGROUPS(T, ROWS, COLS, R, COL)                          \
  float mm = -INFINITY;                                                 \
  for (int ww = 0; ww < NW; ++ww) mm = fmax(mm, red_m[ww * (ROWS) + (R)]); \
  const float mu_ = SAFE_MAX(mm);                                       \
  float ll = 0.0f;                                                      \
  T oo = (T)(0.0f);                                                     \
  for (int ww = 0; ww < NW; ++ww) {                                     \
    const float f_ = EXP(red_m[ww * (ROWS) + (R)] - mu_);               \
    ll += red_l[ww * (ROWS) + (R)] * f_;                                \
    oo += red_o[(ww * (ROWS) + (R)) * (COLS) + (COL)] * f_;             \
  }
