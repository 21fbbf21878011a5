// The direct form's operands on the device's matrix units (with mma_hw.wgsl): Q loaded
// straight from its storage buffer (bound as an array of halves, row pitch as the stride),
// left operands kept across key tiles (MLeft), K and V from the workgroup tiles, the exchange
// between a row's two softmax lanes (lanes l and l ^ 16 of the 32-lane subgroup) by a
// shuffle, and v granules tested for non-finite halves by their bits (Tint: naga cannot
// bitcast f16 vectors to words). mma_emu_direct.wgsl is the same contract in software.

alias MLeft = subgroup_matrix_left<f16, 16, 16>;

// 16 rows of q from element qo, rows qs apart.
fn mm_load_q(qo: u32, qs: u32) -> MLeft {
  return subgroupMatrixLoad<MLeft, row_major>(&q, qo, qs);
}

// acc + A x K^T, 16 keys of k_s from element ko, keys K_STRIDE apart (K^T: column-major).
fn mm_qk_direct(acc: MAcc, a: MLeft, ko: u32) -> MAcc {
  let bm = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&k_s, ko, K_STRIDE);
  return subgroupMatrixMultiplyAccumulate(a, bm, acc);
}

// The same where rows past q's end would be read (Tint's robustness then moves or drops the
// whole load): the first `rows` of them (zeros for the others) copied by the subgroup's
// lanes into its 16 rows of p_s from pa (free before the key loop), loaded from there.
// Called by every invocation (barriers).
fn mm_load_q_edge(qo: u32, qs: u32, rows: u32, pa: u32, lane: u32) -> MLeft {
  workgroupBarrier();
  for (var e = lane; e < 256u; e += 32u) {
    var x = f16(0.0);
    if (e / 16u < rows) {
      x = q[qo + (e / 16u) * qs + e % 16u];
    }
    p_s[pa + (e / 16u) * P_STRIDE + e % 16u] = x;
  }
  workgroupBarrier();
  return subgroupMatrixLoad<MLeft, row_major>(&p_s, pa, P_STRIDE);
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

// Which halves of g are not finite (all exponent bits set), as a mask over its words: 0xffff
// in each such half.
fn mm_bad_bits(g: GV) -> vec4<u32> {
  let u = vec4<u32>(bitcast<vec2<u32>>(g[0]), bitcast<vec2<u32>>(g[1]));
  let e = u & vec4<u32>(0x7c007c00u);
  return select(vec4<u32>(0u), vec4<u32>(0xffffu), (e & vec4<u32>(0xffffu)) == vec4<u32>(0x7c00u))
      | select(vec4<u32>(0u), vec4<u32>(0xffff0000u), (e >> vec4<u32>(16u)) == vec4<u32>(0x7c00u));
}

// Whether every half of granule g is finite (one test of the granule's words).
fn mm_finite(g: GV) -> bool {
  let u = vec4<u32>(bitcast<vec2<u32>>(g[0]), bitcast<vec2<u32>>(g[1]));
  let e = u & vec4<u32>(0x7c007c00u);
  return all((e & vec4<u32>(0x7c00u)) != vec4<u32>(0x7c00u))
      && all((e & vec4<u32>(0x7c000000u)) != vec4<u32>(0x7c000000u));
}

// g with its non-finite halves as 0 (the slow path of a granule that has one).
fn mm_zero_bad(g: GV) -> GV {
  let u = vec4<u32>(bitcast<vec2<u32>>(g[0]), bitcast<vec2<u32>>(g[1]));
  let c = u & ~mm_bad_bits(g);
  return GV(bitcast<vec4<f16>>(c.xy), bitcast<vec4<f16>>(c.zw));
}
