// The matrix primitive of flash_prefill_mma on the device's matrix units: Dawn's
// chromium_experimental_subgroup_matrix, 16x16x16 f16 products accumulated in f32. Every
// function is called by all 32 lanes of a subgroup together (subgroup-uniform control flow);
// the subgroup's tile is MAcc, one 16x16 f32 result matrix held by the subgroup.
// mma_emu.wgsl is the same contract in software.

alias MAcc = subgroup_matrix_result<f32, 16, 16>;

fn mm_set_lane(lid: u32) {
}

fn mm_zero() -> MAcc {
  return MAcc();
}

// acc + Q[qo.., 16 x 16, rows QST apart] x K^T, K rows (keys) KST apart in k_s from ko.
fn mm_qk(acc: MAcc, qo: u32, ko: u32) -> MAcc {
  let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&q_s, qo, false, QST);
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&k_s, ko, true, KST);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// acc + P[po.., 16 x 16, rows PST apart] x V[vo.., 16 keys x 16 columns, rows VST apart].
fn mm_pv(acc: MAcc, po: u32, vo: u32) -> MAcc {
  let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&p_s, po, false, PST);
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&v_s, vo, false, VST);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// The tile, row-major with rows SST apart, into s_s from so.
fn mm_store_s(acc: MAcc, so: u32) {
  subgroupMatrixStore(&s_s, so, acc, false, SST);
}

// The tile into / from the subgroup's 16 x 16 scratch o_x[xo..xo+256), rows 16 apart.
fn mm_store_x(acc: MAcc, xo: u32) {
  subgroupMatrixStore(&o_x, xo, acc, false, 16u);
}

fn mm_load_x(xo: u32) -> MAcc {
  return subgroupMatrixLoad<MAcc>(&o_x, xo, false, 16u);
}
