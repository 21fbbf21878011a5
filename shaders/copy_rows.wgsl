// copy_rows: rows of ROW bytes from src (rows SRC_PITCH bytes apart) into dst (DST_PITCH
// apart), zeros in the rest of each dst row (attnreg/headpad.py widens and narrows a
// tensor's last axis with it). Pitches are any byte counts (a float16 row of 5 values is 10
// bytes), so each invocation assembles one whole destination word from its bytes: no two
// invocations write the same word, and words past the last row (the allocation's rounding)
// get zeros.

struct Rows {
  rows: u32,
  row_bytes: u32,
  src_pitch: u32,
  dst_pitch: u32,
  nwords: u32,       // destination words to write
  pad0: u32,
  pad1: u32,
  pad2: u32,
};

@group(0) @binding(0) var<uniform> RP: Rows;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

fn src_byte(i: u32) -> u32 {
  return (src[i / 4u] >> ((i % 4u) * 8u)) & 0xffu;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let w = (wid.x + nwg.x * wid.y) * 64u + lid;
  if (w >= RP.nwords) {
    return;
  }
  let aligned = RP.row_bytes % 4u == 0u && RP.src_pitch % 4u == 0u && RP.dst_pitch % 4u == 0u;
  let row = w * 4u / RP.dst_pitch;
  let col = w * 4u % RP.dst_pitch;
  if (aligned) {
    // whole words: a word lies in one row, all data or all padding
    var word = 0u;
    if (row < RP.rows && col < RP.row_bytes) {
      word = src[(row * RP.src_pitch + col) / 4u];
    }
    dst[w] = word;
    return;
  }
  var word = 0u;
  for (var k = 0u; k < 4u; k++) {
    let b = w * 4u + k;
    let r = b / RP.dst_pitch;
    let c = b % RP.dst_pitch;
    if (r < RP.rows && c < RP.row_bytes) {
      word = word | (src_byte(r * RP.src_pitch + c) << (k * 8u));
    }
  }
  dst[w] = word;
}
