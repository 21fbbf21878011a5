// copy_rows: rows of ROW bytes from src (rows SRC_PITCH bytes apart) into dst (DST_PITCH
// apart), zeros in the rest of each dst row (attnreg/headpad.py widens and narrows a
// tensor's last axis with it). Pitches are any byte counts (a float16 row of 5 values is 10
// bytes), so each invocation assembles one whole destination word from its bytes: no two
// invocations write the same word, and words past the last row (the allocation's rounding)
// get zeros. utility_common.wgsl calls job_item(w) for each destination word w < count.

struct Job {
  rows: u32,
  row_bytes: u32,
  src_pitch: u32,
  dst_pitch: u32,
  count: u32,        // destination words to write
  pad0: u32,
  pad1: u32,
  pad2: u32,
};

fn src_byte(i: u32) -> u32 {
  return (src[i / 4u] >> ((i % 4u) * 8u)) & 0xffu;
}

fn job_item(w: u32) {
  let aligned = job.row_bytes % 4u == 0u && job.src_pitch % 4u == 0u && job.dst_pitch % 4u == 0u;
  let row = w * 4u / job.dst_pitch;
  let col = w * 4u % job.dst_pitch;
  if (aligned) {
    // whole words: a word lies in one row, all data or all padding
    var word = 0u;
    if (row < job.rows && col < job.row_bytes) {
      word = src[(row * job.src_pitch + col) / 4u];
    }
    dst[w] = word;
    return;
  }
  var word = 0u;
  for (var k = 0u; k < 4u; k++) {
    let b = w * 4u + k;
    let r = b / job.dst_pitch;
    let c = b % job.dst_pitch;
    if (r < job.rows && c < job.row_bytes) {
      word = word | (src_byte(r * job.src_pitch + c) << (k * 8u));
    }
  }
  dst[w] = word;
}
