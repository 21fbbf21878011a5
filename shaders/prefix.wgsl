// Pieces of the generated prefix that differ by variant; the program builder
// (backends/webgpu/program.py) takes one of each pair. Absent inputs get stubs, so one family
// source serves every variant and a variant never refers to a binding its layout lacks.
//
// kv_elem(b, n, j): element offset of key j of (batch b, kv head n), contiguous or through
// the paged block table (strides within a page). blk_range / blk_entry: a masked-block list
// packed as [entries base, CSR offsets, entries], entry = block id | all-zero flag << 31.
// kv_first(b) (kv_start[b], the first existing key) and q_rows(b) (seqlens_q[b], S_b) read
// the tensors where the variant binds them; otherwise they are constants (0 and seq_len),
// and KV_START / Q_ROWS 0 let the families drop the tests that need them, so a spec without
// these features compiles to what it did before they existed. The builder writes those
// flags (PAGED, BLOCKS, KV_START, Q_ROWS: 1 where the input is bound) before each piece.
// lane_max / lane_sum: row reductions over SHUFFLE_LANES lanes, by subgroup shuffles in subgroup
// variants; absent otherwise, so a non-subgroup variant never mentions a subgroup builtin
// (its device may lack them).

// piece: kv_paged
fn kv_elem(b: u32, n: u32, j: u32) -> u32 {
  let page = u32(block_table[b * P.pages_per_seq + j / P.page_size]);
  return page * P.kv_sb + n * P.kv_sh + (j % P.page_size) * P.kv_ss;
}

// piece: kv_flat
fn kv_elem(b: u32, n: u32, j: u32) -> u32 {
  return b * P.kv_sb + n * P.kv_sh + j * P.kv_ss;
}

// piece: blocks
fn blk_range(r: u32) -> vec2<u32> {
  return vec2<u32>(block_list[1u + r], block_list[2u + r]);
}
fn blk_entry(i: u32) -> u32 {
  return block_list[block_list[0] + i];
}

// piece: no_blocks
fn blk_range(r: u32) -> vec2<u32> {
  return vec2<u32>(0u, 0u);
}
fn blk_entry(i: u32) -> u32 {
  return 0u;
}

// piece: kv_start
fn kv_first(b: u32) -> u32 {
  return u32(kv_start[b]);
}

// piece: no_kv_start
fn kv_first(b: u32) -> u32 {
  return 0u;
}

// piece: q_rows
fn q_rows(b: u32) -> u32 {
  return u32(seqlens_q[b]);
}

// piece: no_q_rows
fn q_rows(b: u32) -> u32 {
  return P.seq_len;
}

// piece: lanes_subgroup
// LaneInfo, an entry point's parameter, holds this dispatch's subgroup size: adapters report
// only a range (NVIDIA's: 4-128, for subgroups that are 32 lanes), so SHUFFLE_LANES, sized by
// the range's smallest, is a floor that a kernel may exceed where subgroup_lanes() allows.
struct LaneInfo {
  @builtin(subgroup_size) size: u32,
}
fn subgroup_lanes(li: LaneInfo) -> u32 {
  return li.size;
}
fn lane_xor(x: f32, s: u32) -> f32 {
  return subgroupShuffleXor(x, s);
}
fn lane_shuffle(x: f32, id: u32) -> f32 {
  return subgroupShuffle(x, id);
}
fn lane_max(x: f32) -> f32 {
  var v = x;
  for (var s = 1u; s < SHUFFLE_LANES; s = s << 1u) {
    v = max(v, subgroupShuffleXor(v, s));
  }
  return v;
}
fn lane_sum(x: f32) -> f32 {
  var v = x;
  for (var s = 1u; s < SHUFFLE_LANES; s = s << 1u) {
    v = v + subgroupShuffleXor(v, s);
  }
  return v;
}

// piece: lanes_plain
// No subgroups: one lane a subgroup (LaneInfo carries a builtin only because a struct
// parameter needs a member).
struct LaneInfo {
  @builtin(local_invocation_id) unused: vec3<u32>,
}
fn subgroup_lanes(li: LaneInfo) -> u32 {
  return 1u;
}
fn lane_xor(x: f32, s: u32) -> f32 {
  return x;
}
fn lane_shuffle(x: f32, id: u32) -> f32 {
  return x;
}
fn lane_max(x: f32) -> f32 {
  return x;
}
fn lane_sum(x: f32) -> f32 {
  return x;
}
