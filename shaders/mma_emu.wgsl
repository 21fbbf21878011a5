// The matrix primitive of flash_prefill_mma in software (flag matrix_units=emulate): the
// contract of mma_hw.wgsl (16x16x16, f16 operands read from workgroup memory, f32
// accumulation) on any device. A "subgroup" is 32 consecutive invocations; lane l of it owns
// the 8 result elements (row l/16 + 2t, column l%16), t = 0..7, which live in its MAcc. The
// operands are read at the call (mma_emu_staged.wgsl: from workgroup memory;
// mma_emu_direct.wgsl: Q and K from storage), where the hardware would load them.

alias MAcc = array<f32, 8>;

var<private> mm_lane: u32;
var<private> mm_steps: u32;     // 8, read at run time (mm_mac)
var<private> mm_depth: u32;     // 16, read at run time (mm_mac)

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  mm_lane = lid % 32u;
  mm_steps = min(8u, nwg.x + 8u);
  mm_depth = min(16u, nwg.x + 16u);
  kernel_body(wid, nwg, lid, lid / 32u, lid % 32u);
}

fn mm_zero() -> MAcc {
  return MAcc();
}

// acc + A x B over 16 depths for the lane's 8 elements (row l / 16 + 2t, column l % 16):
// A's rows from a.x, a.y apart; B from b.x. PV (pv true): A = P in p_s, B = V in v_s, keys
// b.y apart; QK^T: A = Q, B = K^T with keys b.y apart, read through emu_q / emu_k (the
// staged file: q_s, k_s; the direct one: the storage buffers). pv is a literal at every
// call, so each inlined call keeps one branch.
// The element loop's bound is read at run time (it is 8): with constant bounds lavapipe
// unrolled every inlined product (the direct form inlines up to 64) and one build took 100 s.
// The depth loop's bound is read at run time too (mm_depth, 16) for QK^T, and for PV where
// the form says so (MM_PV_ROLLED): written out, it made CI's compiles of the emulated builds
// 1.8x longer (the direct form's webgpu cells: 69.1 -> 38.8 s cold). The staged form keeps
// its PV depth loop constant: with both loops rolled, lavapipe's build of it gave wrong
// values (NaN on webgpu) in one staged cell (gqa7 h64 s4 L1500 alibi), with either one
// rolled, right ones.
fn mm_mac(acc: MAcc, a: vec2<u32>, b: vec2<u32>, pv: bool) -> MAcc {
  var c = acc;
  let col = mm_lane % 16u;
  for (var t = 0u; t < mm_steps; t++) {
    let row = mm_lane / 16u + 2u * t;
    // assigned, not initialised where declared: some WGSL -> SPIR-V paths hoist a loop-local
    // initialiser out of its loop
    var s: f32;
    s = 0.0;
    for (var d = 0u; d < select(mm_depth, select(16u, mm_depth, MM_PV_ROLLED), pv); d++) {
      if (pv) {
        s += f32(p_s[a.x + row * a.y + d]) * f32(v_s[b.x + d * b.y + col]);
      } else {
        s += emu_q(a.x + row * a.y + d) * emu_k(b.x + col * b.y + d);
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

// The tile into / from the subgroup's 16 x 16 O scratch s_s[xo..xo+256), rows 16 apart (the
// kernel's x_at).
fn mm_store_x(acc: MAcc, xo: u32) {
  for (var t = 0u; t < 8u; t++) {
    s_s[xo + (mm_lane / 16u + 2u * t) * 16u + mm_lane % 16u] = acc[t];
  }
}

fn mm_load_x(xo: u32) -> MAcc {
  var c = MAcc();
  for (var t = 0u; t < 8u; t++) {
    c[t] = s_s[xo + (mm_lane / 16u + 2u * t) * 16u + mm_lane % 16u];
  }
  return c;
}
