// copy_bw: a plain device-to-device copy of 16-byte words by the shader cores, for the
// copy-bandwidth probe (memory.py): the roof the bench compares kernels with is what a
// kernel can stream, which a copy command (possibly served by a DMA engine) may not show.
// Each invocation copies every stride-th word from its own (grid-stride over the window).
// The builder (backends/webgpu/program.py) declares THREADS and the bindings.

struct Job {
  n: u32,          // 16-byte words in this window
  stride: u32,     // invocations in the grid
  pad0: u32,
  pad1: u32,
};

@compute @workgroup_size(THREADS)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  for (var i = gid.x; i < job.n; i += job.stride) {
    dst[i] = src[i];
  }
}
