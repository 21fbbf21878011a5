// The matrix primitive of flash_prefill_mma in software (flag matrix_units=emulate): the
// contract of mma_hw.wgsl (16x16x16, f16 operands read from workgroup memory, f32
// accumulation) on any device. A "subgroup" is 32 consecutive invocations; lane l of it owns
// the 8 result elements (row l/16 + 2t, column l%16), t = 0..7, which live in its MAcc. The
// operands are read from workgroup memory at the call, as the hardware loads them there.

alias MAcc = array<f32, 8>;

var<private> mm_lane: u32;

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  mm_lane = lid % 32u;
  kernel_body(wid, nwg, lid, lid / 32u, lid % 32u);
}

fn mm_zero() -> MAcc {
  return MAcc();
}

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

fn mm_store_s(acc: MAcc, so: u32) {
  for (var t = 0u; t < 8u; t++) {
    s_s[so + (mm_lane / 16u + 2u * t) * S_STRIDE + mm_lane % 16u] = acc[t];
  }
}

// The tile into / from the subgroup's 16 x 16 O scratch o_x[xo..xo+256), rows 16 apart.
fn mm_store_x(acc: MAcc, xo: u32) {
  for (var t = 0u; t < 8u; t++) {
    o_x[xo + (mm_lane / 16u + 2u * t) * 16u + mm_lane % 16u] = acc[t];
  }
}

fn mm_load_x(xo: u32) -> MAcc {
  var c = MAcc();
  for (var t = 0u; t < 8u; t++) {
    c[t] = o_x[xo + (mm_lane / 16u + 2u * t) * 16u + mm_lane % 16u];
  }
  return c;
}
