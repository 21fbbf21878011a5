// patch16: writes a strip of 16-bit values (f16) at a 2-byte aligned byte offset into a
// buffer of 32-bit words, keeping the other half of each edge word. queue.writeBuffer
// needs 4-byte offsets and sizes; this serves the strips that are not (an odd f16 element
// offset or count) without a read-back. One invocation per destination word, so no two
// invocations touch the same word.

struct Job {
  dst_off: u32,      // byte offset of the strip, relative to the bound window
  nbytes: u32,       // strip length in bytes (even)
  first_word: u32,   // first destination word touched
  count: u32,        // destination words touched
};

// The i-th 16-bit value of the source strip (little-endian halves of each word).
fn src_half(i: u32) -> u32 {
  let w = src[i / 2u];
  return select(w & 0xffffu, w >> 16u, (i & 1u) == 1u);
}

// Destination word first_word + t (utility_common.wgsl calls it for t < count).
fn job_item(t: u32) {
  let w = job.first_word + t;
  var word = dst[w];
  for (var h = 0u; h < 2u; h++) {
    let byte = w * 4u + h * 2u;
    if (byte >= job.dst_off && byte < job.dst_off + job.nbytes) {
      let v = src_half((byte - job.dst_off) / 2u);
      word = select((word & 0xffff0000u) | v, (word & 0x0000ffffu) | (v << 16u), h == 1u);
    }
  }
  dst[w] = word;
}
