// decode_fused: split-KV decode in one launch. Every work-group computes its split's
// partial state (decode_core.cl); decode_merge.cl's ticket lets the last work-group of a row
// tile merge all splits and the sink into out/lse.

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void decode_fused(KERNEL_ARGS) {
  DECODE_LOCALS
  __local int last;
  Rows w;
  decode_tile(DECODE_ARG_NAMES, o_parts, lse_parts, &w, DECODE_LOCAL_NAMES);
  fused_finish(P, &w, sink, o_parts, lse_parts, out, lse, tickets, &last);
}
