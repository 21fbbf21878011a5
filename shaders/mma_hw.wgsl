// The matrix primitive of flash_prefill_mma on the device's matrix units: Dawn's
// chromium_experimental_subgroup_matrix, 16x16x16 f16 products accumulated in f32. Every
// function is called by all 32 lanes of a subgroup together (subgroup-uniform control flow);
// the subgroup's tile is MAcc, one 16x16 f32 result matrix held by the subgroup.
// mma_emu.wgsl is the same contract in software.

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

// acc + Q[qo.., 16 x 16, rows Q_STRIDE apart] x K^T, K rows (keys) K_STRIDE apart in k_s from ko.
fn mm_qk(acc: MAcc, qo: u32, ko: u32) -> MAcc {
  let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&q_s, qo, Q_STRIDE);
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&k_s, ko, K_STRIDE);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// acc + P[po.., 16 x 16, rows P_STRIDE apart] x V[vo.., 16 keys x 16 columns, rows V_STRIDE apart].
fn mm_pv(acc: MAcc, po: u32, vo: u32) -> MAcc {
  let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&p_s, po, P_STRIDE);
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_s, vo, V_STRIDE);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// The tile, row-major with rows S_STRIDE apart, into s_s from so.
fn mm_store_s(acc: MAcc, so: u32) {
  subgroupMatrixStore<row_major>(&s_s, so, acc, S_STRIDE);
}

// The tile into / from the subgroup's 16 x 16 O scratch o_x[xo..xo+256), rows 16 apart.
fn mm_store_x(acc: MAcc, xo: u32) {
  subgroupMatrixStore<row_major>(&o_x, xo, acc, 16u);
}

fn mm_load_x(xo: u32) -> MAcc {
  return subgroupMatrixLoad<MAcc, row_major>(&o_x, xo, 16u);
}
