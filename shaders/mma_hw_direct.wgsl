// The direct form's operands on the device's matrix units (with mma_hw.wgsl): Q and K loaded
// straight from their storage buffers (bound as arrays of halves, row pitch as the stride),
// left operands kept across key tiles (MLeft), and the exchange between a row's two softmax
// lanes (lanes l and l ^ 16 of the 32-lane subgroup) by a shuffle. mma_emu_direct.wgsl is the
// same contract in software.

alias MLeft = subgroup_matrix_left<f16, 16, 16>;

// 16 rows of q from element qo, rows qs apart.
fn mm_load_q(qo: u32, qs: u32) -> MLeft {
  return subgroupMatrixLoad<MLeft, row_major>(&q, qo, qs);
}

// acc + A x K^T, 16 keys of k from element ko, keys ks apart (K^T: column-major).
fn mm_qk_direct(acc: MAcc, a: MLeft, ko: u32, ks: u32) -> MAcc {
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&k, ko, ks);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// 16 rows of P from p_s[po..], rows P_STRIDE apart.
fn mm_load_p(po: u32) -> MLeft {
  return subgroupMatrixLoad<MLeft, row_major>(&p_s, po, P_STRIDE);
}

// acc + A x V[vo.., 16 keys x 16 columns of v_s, rows V_STRIDE apart].
fn mm_pv_left(acc: MAcc, a: MLeft, vo: u32) -> MAcc {
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_s, vo, V_STRIDE);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// The larger of x and the row's other lane's x (slot: unused here; the emulation's scratch).
fn pair_max(x: f32, slot: u32) -> f32 {
  return max(x, subgroupShuffleXor(x, 16u));
}
