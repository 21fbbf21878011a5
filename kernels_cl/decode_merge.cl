// The one-launch split-KV finish shared by decode_fused.cl and the tensor-core decode
// (decode_mma.cl built with MMA_OUT 2). Every work-group has written its split's
// partial state into a scratch buffer; an atomic ticket per row tile
// (batch, kv head, head chunk, query-row tile) tells the last of the tile's n_splits
// work-groups to finish, and that one merges all splits and the sink into out/lse with
// the reduce's rule: M = max(lse_t, sink), w_t = exp(lse_t - M),
// out = sum_t w_t o_t / (sum_t w_t + exp(sink - M)), lse = M + log(denominator).
// Ordering: the work-group barrier, then one work-item fences (release) and takes the
// ticket; in the last work-group that item fences again (acquire) before the barrier that
// hands `last` on, and the merge reads the partials through L2 (ld_part below: never a stale
// cached line). PTX fences are cumulative (they order what the barrier made this item
// observe), so on NVIDIA one item's membar.gl serves the work-group, as in CUDA's grid sync;
// OpenCL 1.2's fences order only the item's own accesses, so elsewhere every item fences
// its stores before the barrier and its loads after it (ITEM_FENCE). On the H100 (GQA 32/8
// H=128 f16) one fence instead of every warp's: L=2048 15.1-15.9 vs 15.6-16.3 us, L=8192
// 23.8-24.6 vs 24.6-26.6, three rounds (ci/results/h100_decode_epilogue.txt). The last
// work-group resets its ticket to 0, so the scratch and tickets are ready for the next
// launch without a host fill.
// A padding row (past seqlens_q[b]) takes no sink: its splits are all empty, so it gets out 0
// and lse -inf (the reduce's rule with seqlens_q).

#if NV_FENCE
// NVIDIA: membar.gl orders global memory device-wide (beside OpenCL's own fence).
#define GLOBAL_FENCE()                          \
  do {                                          \
    mem_fence(CLK_GLOBAL_MEM_FENCE);            \
    asm volatile("membar.gl;" ::: "memory");    \
  } while (0)
#define ITEM_FENCE()
#else
#define GLOBAL_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#define ITEM_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#endif

#define MB 16                  // splits whose loads are issued together in the merge

// The other work-groups' partial states, read by the last one: through L2 (never a stale L1
// line). NVIDIA: ld.global.cg (cached in L2 only, and free to be scheduled like any load;
// volatile loads elsewhere). With 16-split batches weighed at once, measured on the H100 (GQA
// 32/8 H=128 f16, 32 splits): L=8192 25.3 vs 26.6 us with volatile loads in 8-split batches
// of one-by-one online updates; whisper 13.5 vs 14.0.
#if NV_FENCE
inline float ld_part(const __global float* p) {
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
}
inline float4 ld_part4(const __global float* p) {
  float a, b, c, d;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(a), "=f"(b), "=f"(c), "=f"(d) : "l"(p));
  return (float4)(a, b, c, d);
}
#else
#define ld_part(p) (*(const volatile __global float*)(p))
#define ld_part4(p) (*(const volatile __global float4*)(p))
#endif

// Called, not inlined, for int4 K/V: only the last work-group of a row tile runs the merge,
// and inlined it changed ptxas's register allocation of the whole kernel. On the H100 (GQA
// 32/8 H=128 L=32768, int4) the inlined merge left the key loop 168 registers and 168 bytes
// of spills, 56.0-57.3 us; called, 220 registers, no spills, 44.2-46.3 us. Where nothing
// spilled the call changed nothing beyond noise (f16 62.0-62.3 vs 61.7-61.8 us inlined, int8
// 40.7-40.8 vs 41.3-41.6), so the rest stay inlined (ci/results/h100_decode_epilogue.txt).
#if KV_Q == 2
__attribute__((noinline))
#else
inline
#endif
void merge_row_tile(PARAMS P, const Rows* w, const __global float* sink,
                    const __global float* o_parts, const __global float* lse_parts,
                    __global elem_t* out, __global float* lse) {
  const int ns = (int)P->n_splits;
  for (int idx = get_local_id(0); idx < R_ROWS * HV4; idx += WG) {
    const int r = idx / HV4, g = idx % HV4;
    if (!row_ok(P, w, r)) continue;
    const int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
    const size_t row = part_row(P, w, r, 0);
    // One online pass. A split of lse -inf has weight 0 (SAFE_MAX keeps -inf - -inf out)
    // and adds nothing, whatever its o holds (as in the reduce); every other split's o is
    // multiplied by its weight, so a NaN in it reaches out, and a NaN lse makes den NaN.
    // A batch's max first, then its weights (independent of each other) and one rescale
    // of the running sums per batch.
    float mx = -INFINITY, den = 0.0f;
    float4 num = (float4)(0.0f);
    for (int t0 = 0; t0 < ns; t0 += MB) {
      float lt[MB];
      float4 ot[MB];
      for (int u = 0; u < MB; ++u) {            // clamped indices: loads issue together
        const int t = min(t0 + u, ns - 1);
        lt[u] = t0 + u < ns ? ld_part(lse_parts + row + t) : -INFINITY;
        ot[u] = ld_part4(o_parts + (row + t) * HV + 4 * g);
      }
      float m2 = mx;
      for (int u = 0; u < MB; ++u) m2 = fmax(m2, lt[u]);
      const float mu = SAFE_MAX(m2), f = EXP(mx - mu);
      den *= f;
      num *= f;
      for (int u = 0; u < MB; ++u) {
        const float wt = EXP(lt[u] - mu);
        den += wt;
        num += lt[u] == -INFINITY ? (float4)(0.0f) : wt * ot[u];
      }
      mx = m2;
    }
    if (P->has_sink && row_live(P, w, r)) {
      const float sk = sink[h];
      const float m2 = fmax(mx, sk), mu = SAFE_MAX(m2);
      const float f = EXP(mx - mu);
      den = den * f + EXP(sk - mu);
      num *= f;
      mx = m2;
    }
    ST4(finite_or_nan4(num * inv_sum(den)), out, OUT_OFF(P, w->b, h, i) + 4 * g);
    if (P->return_lse && g == 0)
      lse[((size_t)w->b * P->num_heads + h) * P->seq_len + i] = lse_of(SAFE_MAX(mx), den);
  }
}

// After a work-group has stored its split's partial state: take the row tile's ticket; the
// last of its n_splits work-groups merges every split into out/lse. `last` is local scratch.
inline void fused_finish(PARAMS P, const Rows* w, const __global float* sink,
                         const __global float* o_parts, const __global float* lse_parts,
                         __global elem_t* out, __global float* lse,
                         volatile __global uint* tickets, __local int* last) {
  ITEM_FENCE();                       // OpenCL 1.2: each item's own stores (not on NVIDIA)
  barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
  if (get_local_id(0) == 0) {
    GLOBAL_FENCE();                   // release the work-group's stores, then take the ticket
    // Row tile of this work-group: decompose()'s order with the split index taken out.
    const int ns = (int)P->n_splits;
    const int inner = ((int)P->seq_len + MQ - 1) / MQ * (((int)P->group_size + GC - 1) / GC);
    const int gid = get_group_id(0);
    const int tile = gid / (inner * ns) * inner + gid % inner;
    const uint ticket = atomic_inc(&tickets[tile]);
    *last = ticket == (uint)(ns - 1);
    if (*last) {                      // every split has arrived
      atomic_xchg(&tickets[tile], 0u);
      GLOBAL_FENCE();                 // acquire the other splits' stores, for the whole group
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (*last) {
    ITEM_FENCE();
    merge_row_tile(P, w, sink, o_parts, lse_parts, out, lse);
  }
}
