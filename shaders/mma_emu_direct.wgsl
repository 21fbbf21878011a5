// The direct form's operands in software (with mma_emu.wgsl): the contract of
// mma_hw_direct.wgsl on any device. A left operand is where its rows are: (first element,
// row pitch) of q for Q, of p_s for P; the product reads them at the call. A row's two
// softmax lanes (l and l ^ 16 of the 32 consecutive invocations) exchange through pair_s.

// mm_mac's PV depth loop reads its bound at run time (mma_emu.wgsl says why).
const MM_PV_ROLLED: bool = true;

alias MLeft = vec2<u32>;

var<workgroup> pair_s: array<f32, THREADS>;

fn mm_load_q(qo: u32, qs: u32) -> MLeft {
  return MLeft(qo, qs);
}

// mma_hw_direct.wgsl's load where rows past q's end would be read: the emulated product
// reads q element by element, each row's own (those past the end belong to rows that exist
// nowhere, whose results are dropped). Its two barriers are the hardware load's: they make
// CI's compile of this build (no CI device has subgroup matrices) apply WGSL's uniformity
// analysis to its callers as the hardware build's compile does.
fn mm_load_q_edge(qo: u32, qs: u32, rows: u32, pa: u32, lane: u32) -> MLeft {
  workgroupBarrier();
  workgroupBarrier();
  return MLeft(qo, qs);
}

fn mm_load_p(po: u32) -> MLeft {
  return MLeft(po, P_STRIDE);
}

// Q and K as the QK^T product of mma_emu.wgsl's mm_mac reads them: q from storage, K from k_s.
fn emu_q(e: u32) -> f32 {
  return f32(q[e]);
}

fn emu_k(e: u32) -> f32 {
  return f32(k_s[e]);
}

// acc + A x K^T, 16 keys of k_s from element ko, keys K_STRIDE apart.
fn mm_qk_direct(acc: MAcc, a: MLeft, ko: u32) -> MAcc {
  return mm_mac(acc, a, vec2<u32>(ko, K_STRIDE), false);
}

// acc + A (P) x V[vo.., 16 keys x 16 columns of v_s, rows V_STRIDE apart].
fn mm_pv_left(acc: MAcc, a: MLeft, vo: u32) -> MAcc {
  return mm_mac(acc, a, vec2<u32>(vo, V_STRIDE), true);
}

// Called by every invocation (it holds barriers); slot: the invocation's own.
fn pair_max(x: f32, slot: u32) -> f32 {
  workgroupBarrier();
  pair_s[slot] = x;
  workgroupBarrier();
  return max(x, pair_s[slot ^ 16u]);
}

// Whether every half of granule g is finite (mma_common.wgsl's bad4: naga cannot bitcast f16
// vectors to words, which mma_hw_direct.wgsl's test does).
fn mm_finite(g: GV) -> bool {
  return !any(bad4(g[0])) && !any(bad4(g[1]));
}

// g with its non-finite halves as 0.
fn mm_zero_bad(g: GV) -> GV {
  return GV(select(g[0], vec4<f16>(0.0), bad4(g[0])), select(g[1], vec4<f16>(0.0), bad4(g[1])));
}
