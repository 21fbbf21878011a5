// The matrix primitive of flash_prefill_mma on the device's matrix units: Dawn's
// chromium_experimental_subgroup_matrix, 16x16x16 f16 products accumulated in f32. Every
// function is called by all 32 lanes of a subgroup together (subgroup-uniform control flow);
// the subgroup's tile is MAcc, one 16x16 f32 result matrix held by the subgroup.
// mma_emu.wgsl is the same contract in software. The products' operands come from
// mma_hw_staged.wgsl (workgroup memory) or mma_hw_direct.wgsl (Q and K from storage).

alias MAcc = subgroup_matrix_result<f32, 16, 16>;

// Subgroup matrix offsets must be uniform in WGSL's analysis, which accepts values derived
// from subgroup_id (not from local_invocation_index): the subgroup comes from the builtin.
@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sid: u32,
        @builtin(subgroup_invocation_id) sl: u32) {
  kernel_body(wid, nwg, lid, sid, sl);
}

fn mm_zero() -> MAcc {
  return MAcc();
}

// The tile, row-major with rows S_STRIDE apart, into s_s from so.
fn mm_store_s(acc: MAcc, so: u32) {
  subgroupMatrixStore<row_major>(&s_s, so, acc, S_STRIDE);
}

// The tile into / from the subgroup's 16 x 16 O scratch s_s[xo..xo+256), rows 16 apart (the
// kernel's x_at: where in s_s it lies).
fn mm_store_x(acc: MAcc, xo: u32) {
  subgroupMatrixStore<row_major>(&s_s, xo, acc, 16u);
}

fn mm_load_x(xo: u32) -> MAcc {
  return subgroupMatrixLoad<MAcc, row_major>(&s_s, xo, 16u);
}
