// reduce: merge the split-KV partial states (and the head sink) into out (q layout, spec
// dtype) and lse: M = max(lse_t, sink), w_t = exp(lse_t - M),
// out = sum_t w_t o_t / (sum_t w_t + exp(sink - M)). A split whose lse_t is -inf adds
// nothing, whatever its o_t holds (partials may come from any backend); every other split's
// o_t is multiplied by its weight, 0 included, so a NaN in it reaches out (NaN, as an inf
// does), and a NaN or +inf lse_t makes the row's out and lse NaN.
// One work-group per query row: RW = WG / HV4 split lanes x HV4 float4 dim lanes, so a
// work-item walks n_splits / RW splits instead of all of them (short load chains).
// o_parts and out rows are HV long (v_head_size). With seqlens_q, a padding row (i past
// seqlens_q[b]) takes no sink: its out is 0 and lse -inf when its partials are empty.

#define RW (WG / HV4)

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void reduce(KERNEL_ARGS) {
  __local float red_m[RW];
  __local float red_d[RW];
  __local float4 red_o[RW * HV4];
  const int row = get_group_id(0);                  // (b * Nq + h) * S + i
  const int lid = get_local_id(0);
  const int g = lid % HV4, sl = lid / HV4;
  const int i = row % (int)P->seq_len, bh = row / (int)P->seq_len;
  const int h = bh % (int)P->num_heads, b = bh / (int)P->num_heads;
  const int ns = (int)P->n_splits;
  const __global float* lp = lse_parts + (size_t)row * ns;
  const bool active = sl < RW;                      // WG may not be a multiple of HD4

  // One pass per split lane with online rescaling (no separate max pass: one global
  // round trip less), then the lanes merge through local memory.
  float mx = -INFINITY, den = 0.0f;
  float4 num = (float4)(0.0f);
  if (active) {
#pragma unroll 4
    for (int t = sl; t < ns; t += RW) {
      const float lt = lp[t];
      const float4 ot = vload4(0, o_parts + ((size_t)row * ns + t) * HV + 4 * g);
      if (lt != -INFINITY) {            // an empty split adds nothing, whatever its o holds
        const float m2 = fmax(mx, lt);
        const float f = EXP(mx - m2), wt = EXP(lt - m2);
        den = den * f + wt;
        num = num * f + wt * ot;
        mx = m2;
      }
    }
    red_o[sl * HV4 + g] = num;
    if (g == 0) {
      red_m[sl] = mx;
      red_d[sl] = den;
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (sl == 0) {
    const bool sunk = P->has_sink && (!P->has_seqlens_q || i < seqlens_q[b]);
    float mm = sunk ? sink[h] : -INFINITY;
    for (int k = 0; k < RW; ++k) mm = fmax(mm, red_m[k]);
    const float mu = SAFE_MAX(mm);
    den = sunk ? EXP(sink[h] - mu) : 0.0f;
    num = (float4)(0.0f);
    for (int k = 0; k < RW; ++k) {
      const float f = EXP(red_m[k] - mu);
      den += red_d[k] * f;
      num += red_o[k * HV4 + g] * f;
    }
    ST4(finite_or_nan4(num * inv_sum(den)), out,
        VOFF((size_t)b * P->q_sb + (size_t)h * P->q_sh + (size_t)i * P->q_ss) + 4 * g);
    if (P->return_lse && g == 0) lse[row] = lse_of(mu, den);
  }
}
