// The entry point of the utility kernels with one invocation per item of their job (patch16,
// copy_rows, quantize_kv): invocation t of the dispatch (grids past 65535 workgroups fold
// into y) runs the file's job_item(t) when t < job.count. The builder
// (backends/webgpu/program.py) declares THREADS and the bindings (job, the file's struct
// Job, first).

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let t = (wid.x + nwg.x * wid.y) * THREADS + lid;
  if (t >= job.count) {
    return;
  }
  job_item(t);
}
