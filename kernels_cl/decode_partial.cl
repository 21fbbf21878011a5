// decode_partial: fused QK^T + online softmax + P.V over one KV split (flash decoding),
// the first kernel of the two-launch split-KV route (decode_partial -> reduce). The grid
// covers every split and every row tile of any seq_len; the tile itself is decode_core.cl.

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void decode_partial(KERNEL_ARGS) {
  DECODE_LOCALS
  Rows w;
  decode_tile(DECODE_ARG_NAMES, o_parts, lse_parts, &w, DECODE_LOCAL_NAMES);
}
