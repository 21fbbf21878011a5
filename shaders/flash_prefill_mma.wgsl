// flash_prefill_mma: flash prefill whose two products run on matrix units, through the mm_*
// primitive (mma_hw.wgsl: subgroup matrices; mma_emu.wgsl: the same contract in software). One
// workgroup owns Q_TILE = 16 * SUBGROUPS query rows of one head; subgroup g (32 lanes) owns
// rows 16g..16g+15. Per tile of KV_TILE keys staged in workgroup memory:
//   S = Q K^T on the matrix units (f32) -> s_s;
//   softmax in scalar code (mma_common.wgsl): lanes (row, half) each take half of the row's
//   KV_TILE scores and apply scale, softcap, bias, ALiBi and the masks (attn_common.wgsl's
//   logit), then write P = exp(x - m) as f16 to p_s;
//   O += P V on the matrix units; O stays in the subgroup's result tiles (OUT_TILES of them).
// The running max is lazy (as FlashAttention-4): a row keeps its reference max m until a tile's
// max exceeds it by more than TAU, so P <= e^TAU stays well inside f16 and O needs rescaling
// (through workgroup memory: the tiles are opaque) only on those rare tiles. Non-finite values
// (docs/contract.md "Non-finite values and scalar fields"): keys no row of the workgroup sees
// are never loaded (zeros); a non-finite v is staged as 0 (so 0 * NaN never reaches rows that
// do not see it) and a slow path marks, per lane, the output columns of its row that see it,
// written as NaN.
// Prefix constants: Q_TILE, KV_TILE, SUBGROUPS, THREADS (32 SUBGROUPS), DEPTH_TILES (QK_DIM/16:
// QK's depth tiles), OUT_TILES (V_DIM/16: output column tiles), KEY_TILES (KV_TILE/16),
// Q_STRIDE, K_STRIDE, V_STRIDE, S_STRIDE, P_STRIDE, ROW_LANES (2), LANE_KEYS (KV_TILE/2),
// MASK_WORDS (words of a lane's column mask).

// Workgroup memory: q_s here, the rest mma_prefill_common.wgsl's.
var<workgroup> q_s: array<f16, Q_TILE * Q_STRIDE>;

// The kernel, entered through the primitive file's main (it knows how the device numbers
// subgroups: sg is the subgroup, lane its invocation; lid the workgroup-linear invocation).
fn kernel_body(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, sg: u32, lane: u32) {
  let w = prefill_wg(wid, nwg, Q_TILE);
  if (!w.ok) {
    return;
  }
  let at = lane_place(w, sg, lane);
  let lo = u32(w.span.x);               // the keys some row of the workgroup sees
  let hi = u32(w.span.y);               // (kept apart from at: uniform)
  if (lid == 0u) {
    atomicStore(&flag_a[0], 0u);        // Dawn leaves workgroup memory as it was; stage_tiles'
  }                                     // first barrier puts this before any flag

  // Q tile, rows past seq_len (and padding rows) zero.
  for (var idx = lid; idx < Q_TILE * QK_GRANULES; idx += THREADS) {
    let r = idx / QK_GRANULES;
    stage_q_granule(r, idx % QK_GRANULES, q_granule(w.b, w.h, w.i0 + r), w.i0 + r < w.seq.rows);
  }

  var o: array<MAcc, OUT_TILES>;
  for (var c = 0u; c < OUT_TILES; c++) {
    o[c] = mm_zero();
  }
  var ml = vec2<f32>(MASKED, 0.0);     // the row's max, this lane's half of its sum
  var vbad: array<u32, MASK_WORDS>;    // output columns of this lane poisoned by a v (zeros)

  let u_first = lo / KV_TILE;
  let n_units = select(0u, cdiv(hi, KV_TILE) - u_first, hi > lo);
  for (var it = 0u; it < n_units; it++) {
    let j0 = (u_first + it) * KV_TILE;
    stage_tiles(w.b, w.kvh, j0, lo, hi, lid);   // keys some row sees

    // S = Q K^T for the subgroup's 16 rows and the tile's keys.
    for (var kc = 0u; kc < KEY_TILES; kc++) {
      var acc = mm_zero();
      for (var dc = 0u; dc < DEPTH_TILES; dc++) {
        acc = mm_qk(acc, sg * 16u * Q_STRIDE + dc * 16u, kc * 16u * K_STRIDE + dc * 16u);
      }
      mm_store_s(acc, sg * 16u * S_STRIDE + kc * 16u);
    }
    workgroupBarrier();

    // The softmax of this lane's half of the row.
    let x = place_logits(at, j0, hi, w);
    workgroupBarrier();
    ml = lane_weights(x, ml, max(red_s[at.rr * ROW_LANES], red_s[at.rr * ROW_LANES + 1u]),
                          at.rr * P_STRIDE + at.hf * LANE_KEYS, at.rr, at.hf, at.rot);
    let flags = take_flags(lid, 0u);

    if ((flags & 1u) != 0u) {
      // Some row's reference max moved: O rows *= alpha, tile by tile through the O scratch (x_at).
      for (var c = 0u; c < OUT_TILES; c++) {
        o[c] = rescaled(o[c], sg, lane, sg * 16u);
      }
    }
    if ((flags & 2u) != 0u && at.i < P.seq_len) {
      vbad = mark_bad_v(vbad, w, j0, lo, hi, at.pos, at.hf);
    }

    // O += P V. The bound is read at run time (it equals OUT_TILES): with OUT_TILES and KEY_TILES
    // both 2 the unrolled loop gave wrong products on the H100 (Dawn/Tint + NVIDIA's Vulkan
    // driver).
    for (var c = 0u; c < min(OUT_TILES, P.seq_len + OUT_TILES); c++) {
      var acc = o[c];
      for (var kc = 0u; kc < KEY_TILES; kc++) {
        acc = mm_pv(acc, sg * 16u * P_STRIDE + kc * 16u, kc * 16u * V_STRIDE + c * 16u);
      }
      o[c] = acc;
    }
  }

  finish_lane_row(ml, w, at.rr, at.hf, at.i);
  // Out, tile by tile through the O scratch (x_at).
  let base = out_vec4(w.b, w.h, at.i);
  for (var c = 0u; c < OUT_TILES; c++) {
    write_tile(o[c], c, vbad, base, at.rr, at.hf, sg, lane, at.i < P.seq_len);
  }
}
