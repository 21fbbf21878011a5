// copy_bw: a plain device-to-device copy of 16-byte words by the shader cores, for the
// copy-bandwidth probe (memory.py): the roof the bench compares kernels with is what a
// kernel can stream, which a copy command (possibly served by a DMA engine) may not show.
// Each invocation copies WORDS_PER consecutive-stride words (grid-stride over the window).

const WG: u32 = 256u;

struct Copy {
  n: u32,          // 16-byte words in this window
  stride: u32,     // invocations in the grid
  pad0: u32,
  pad1: u32,
};

@group(0) @binding(0) var<uniform> C: Copy;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  for (var i = gid.x; i < C.n; i += C.stride) {
    dst[i] = src[i];
  }
}
