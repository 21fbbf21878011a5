// The direct form's operands in software (with mma_emu.wgsl): the contract of
// mma_hw_direct.wgsl on any device. A left operand is where its rows are: (first element,
// row pitch) of q for Q, of p_s for P; the product reads them at the call. A row's two
// softmax lanes (l and l ^ 16 of the 32 consecutive invocations) exchange through pair_s.

alias MLeft = vec2<u32>;

var<workgroup> pair_s: array<f32, THREADS>;

fn mm_load_q(qo: u32, qs: u32) -> MLeft {
  return MLeft(qo, qs);
}

fn mm_load_p(po: u32) -> MLeft {
  return MLeft(po, P_STRIDE);
}

// acc + A x K^T over 16 depths for the lane's 8 elements (rows l / 16 + 2t, column l % 16).
fn mm_qk_direct(acc: MAcc, a: MLeft, ko: u32, ks: u32) -> MAcc {
  var c = acc;
  let col = mm_lane % 16u;
  for (var t = 0u; t < 8u; t++) {
    let row = mm_lane / 16u + 2u * t;
    var s = 0.0;
    for (var d = 0u; d < 16u; d++) {
      s += f32(q[a.x + row * a.y + d]) * f32(k[ko + col * ks + d]);
    }
    c[t] += s;
  }
  return c;
}

fn mm_pv_left(acc: MAcc, a: MLeft, vo: u32) -> MAcc {
  var c = acc;
  let col = mm_lane % 16u;
  for (var t = 0u; t < 8u; t++) {
    let row = mm_lane / 16u + 2u * t;
    var s = 0.0;
    for (var d = 0u; d < 16u; d++) {
      s += f32(p_s[a.x + row * a.y + d]) * f32(v_s[vo + d * V_STRIDE + col]);
    }
    c[t] += s;
  }
  return c;
}

// Called by every invocation (it holds barriers); slot: the invocation's own.
fn pair_max(x: f32, slot: u32) -> f32 {
  workgroupBarrier();
  pair_s[slot] = x;
  workgroupBarrier();
  return max(x, pair_s[slot ^ 16u]);
}
