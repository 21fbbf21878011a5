// The staged products on the device's matrix units (with mma_hw.wgsl): both operands loaded
// from the kernel's workgroup tiles (q_s, k_s for QK^T; p_s, v_s for PV), as
// flash_prefill_mma and decode_mma stage them. mma_emu_staged.wgsl is the same in software.

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
