// reduce: merge the split-KV partial states (and the head sink) into out (q layout, spec
// dtype) and lse. One work-item per (row, float4 of head dims); M = max(lse_t, sink),
// out = sum_t w_t o_t / (sum_t w_t + exp(sink - M)), w_t = exp(lse_t - M). A split whose
// lse_t is -inf contributes nothing, whatever its o_t holds (partials may come from any
// backend).

__kernel void reduce(const Params P, const __global float* o_parts,
                     const __global float* lse_parts, const __global float* sink,
                     __global elem_t* out, __global float* lse) {
  const int gid = get_global_id(0);
  const int rows = (int)(P.batch * P.num_heads * P.seq_len);
  if (gid >= rows * HD4) return;
  const int g = gid % HD4, row = gid / HD4;        // row = (b * Nq + h) * S + i
  const int i = row % (int)P.seq_len, bh = row / (int)P.seq_len;
  const int h = bh % (int)P.num_heads, b = bh / (int)P.num_heads;
  const int ns = (int)P.n_splits;
  const __global float* lp = lse_parts + (size_t)row * ns;

  float mx = P.has_sink ? sink[h] : -INFINITY;
  for (int t = 0; t < ns; ++t) mx = fmax(mx, lp[t]);
  const float mu = SAFE_MAX(mx);
  float den = P.has_sink ? exp(sink[h] - mu) : 0.0f;
  float4 num = (float4)(0.0f);
  for (int t = 0; t < ns; ++t) {
    float wt = exp(lp[t] - mu);
    if (wt > 0.0f) {
      den += wt;
      num += wt * vload4(0, o_parts + ((size_t)row * ns + t) * HD + 4 * g);
    }
  }
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  ST4(num * inv, out, (size_t)b * P.q_sb + (size_t)h * P.q_sh + (size_t)i * P.q_ss + 4 * g);
  if (P.return_lse && g == 0) lse[row] = den > 0.0f ? mu + log(den) : -INFINITY;
}
