// decode_partial: fused QK^T + online softmax + P->V over one KV split (flash decoding).
// A work-group takes GC query heads of one GQA group x MQ (= m_tile) query rows, so the
// heads sharing a KV head read each K/V tile once. The grid covers every split and every
// row tile of any seq_len (on devices without sub-groups all attention comes here).
// Writes the CONTRACT partial states: o_parts [B,Nq,S,T,H] and lse_parts [B,Nq,S,T],
// float32, with o = 0 and lse = -inf where a split has no visible key.

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void decode_partial(PARAMS P, const __global elem_t* q, const __global elem_t* k,
                    const __global elem_t* v, const __global bias_t* bias,
                    const __global int* seqlens, __global float* o_parts,
                    __global float* lse_parts) {
  __local float Qs[R_ROWS * KP];
  __local float Ks[TK * KP];
#if STAGE_V
  __local float Vs[TK * HD];
#else
  __local float* Vs = 0;
#endif
  __local float Ss[R_ROWS * TK];
  __local float Ps[R_ROWS * TK];
  __local float Mrun[R_ROWS];
  __local float Mnew[R_ROWS];

  const int ns = (int)P->n_splits;
  int t;
  Rows w = decompose(P, seqlens, get_group_id(0), ns, &t);
  const int lo = t * (int)P->split_size;
  const int hi = min(lo + (int)P->split_size, (int)P->capacity);
  const int i1 = min(w.i0 + MQ, (int)P->seq_len) - 1;
  int2 kr = key_range(P, w.L, w.i0, i1, lo, hi);

  const size_t kv_base = (size_t)w.b * P->kv_sb + (size_t)w.kvh * P->kv_sh;
  load_q(P, &w, q, Qs);
  float4 acc[PMR][DV];
  float l[PMR], m[PMR];
  flash_rows(P, &w, kr, k + kv_base, v + kv_base, bias, Qs, Ks, Vs, Ss, Ps, Mrun, Mnew,
             acc, l, m);

  const int lid = get_local_id(0);
  const int dl = lid % DL, prl = lid / DL;
  for (int pm = 0; pm < PMR; ++pm) {
    int r = prl + pm * PRL;
    if (!row_ok(P, &w, r)) continue;
    int h = w.h0 + r / MQ, i = w.i0 + r % MQ;
    size_t row = ((size_t)(w.b * (int)P->num_heads + h) * P->seq_len + i) * ns + t;
    float inv = l[pm] > 0.0f ? 1.0f / l[pm] : 0.0f;
    for (int dv = 0; dv < DV; ++dv) {
      int g = dl + dv * DL;
      if (g < HD4) vstore4(acc[pm][dv] * inv, 0, o_parts + row * HD + 4 * g);
    }
    if (dl == 0)
      lse_parts[row] = l[pm] > 0.0f ? m[pm] + alibi_offset(P, &w, r, kr.y) + log(l[pm]) : -INFINITY;
  }
}
