// The staged products in software (with mma_emu.wgsl): the contract of mma_hw_staged.wgsl,
// both operands read from the kernel's workgroup tiles at the call.

fn mm_qk(acc: MAcc, qo: u32, ko: u32) -> MAcc {
  return mm_mac(acc, qo, ko, false);
}

fn mm_pv(acc: MAcc, po: u32, vo: u32) -> MAcc {
  return mm_mac(acc, po, vo, true);
}

// acc + A x B over 16 depths for the lane's 8 elements: A rows from ao, B from bo; QK^T
// (pv false: q_s rows Q_STRIDE apart, k_s keys K_STRIDE apart) or PV (p_s rows P_STRIDE
// apart, v_s keys V_STRIDE apart). pv is a literal at both calls, so each inlined call keeps
// one of the two branches.
fn mm_mac(acc: MAcc, ao: u32, bo: u32, pv: bool) -> MAcc {
  var c = acc;
  let col = mm_lane % 16u;
  for (var t = 0u; t < 8u; t++) {
    let row = mm_lane / 16u + 2u * t;
    var s = 0.0;
    for (var d = 0u; d < 16u; d++) {
      if (pv) {
        s += f32(p_s[ao + row * P_STRIDE + d]) * f32(v_s[bo + d * V_STRIDE + col]);
      } else {
        s += f32(q_s[ao + row * Q_STRIDE + d]) * f32(k_s[bo + col * K_STRIDE + d]);
      }
    }
    c[t] += s;
  }
  return c;
}
