// The matrix primitive of flash_prefill_mma in software (flag matrix_units=emulate): the
// contract of mma_hw.wgsl (16x16x16, f16 operands read from workgroup memory, f32
// accumulation) on any device. A "subgroup" is 32 consecutive invocations; lane l of it owns
// the 8 result elements (row l/16 + 2t, column l%16), t = 0..7, which live in its MAcc. The
// operands are read at the call (mma_emu_staged.wgsl: from workgroup memory;
// mma_emu_direct.wgsl: Q and K from storage), where the hardware would load them.

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
