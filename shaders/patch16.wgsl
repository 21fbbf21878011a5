// patch16: writes a strip of 16-bit values (f16) at a 2-byte aligned byte offset into a
// buffer of 32-bit words, keeping the other half of each edge word. queue.writeBuffer
// needs 4-byte offsets and sizes; this serves the strips that are not (an odd f16 element
// offset or count) without a read-back. One invocation per destination word, so no two
// invocations touch the same word.

struct Patch {
  dst_off: u32,      // byte offset of the strip, relative to the bound window
  nbytes: u32,       // strip length in bytes (even)
  first_word: u32,   // first destination word touched
  nwords: u32,       // destination words touched
};

@group(0) @binding(0) var<uniform> PP: Patch;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// The i-th 16-bit value of the source strip (little-endian halves of each word).
fn src_half(i: u32) -> u32 {
  let w = src[i / 2u];
  return select(w & 0xffffu, w >> 16u, (i & 1u) == 1u);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let t = (wid.x + nwg.x * wid.y) * 64u + lid;
  if (t >= PP.nwords) {
    return;
  }
  let w = PP.first_word + t;
  var word = dst[w];
  for (var h = 0u; h < 2u; h++) {
    let byte = w * 4u + h * 2u;
    if (byte >= PP.dst_off && byte < PP.dst_off + PP.nbytes) {
      let v = src_half((byte - PP.dst_off) / 2u);
      word = select((word & 0xffff0000u) | v, (word & 0x0000ffffu) | (v << 16u), h == 1u);
    }
  }
  dst[w] = word;
}
