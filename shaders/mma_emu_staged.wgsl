// The staged products in software (with mma_emu.wgsl's mm_mac): the contract of
// mma_hw_staged.wgsl, both operands read from the kernel's workgroup tiles at the call.

// mm_mac's PV depth loop keeps its constant bound (mma_emu.wgsl says why).
const MM_PV_ROLLED: bool = false;

fn emu_q(e: u32) -> f32 {
  return f32(q_s[e]);
}

fn emu_k(e: u32) -> f32 {
  return f32(k_s[e]);
}

// acc + Q[qo.., rows Q_STRIDE apart] x K^T (k_s keys K_STRIDE apart from ko).
fn mm_qk(acc: MAcc, qo: u32, ko: u32) -> MAcc {
  return mm_mac(acc, vec2<u32>(qo, Q_STRIDE), vec2<u32>(ko, K_STRIDE), false);
}

// acc + P[po.., rows P_STRIDE apart] x V (v_s keys V_STRIDE apart from vo).
fn mm_pv(acc: MAcc, po: u32, vo: u32) -> MAcc {
  return mm_mac(acc, vec2<u32>(po, P_STRIDE), vec2<u32>(vo, V_STRIDE), true);
}
