// flash_prefill_mma: flash prefill whose two products run on matrix units, through the mm_*
// primitive (mma_hw.wgsl: subgroup matrices; mma_emu.wgsl: the same contract in software). One
// workgroup owns Q_TILE = 16 * SUBGROUPS query rows of one head; subgroup g (32 lanes) owns
// rows 16g..16g+15. Per tile of KV_TILE keys staged in workgroup memory:
//   S = Q K^T on the matrix units (f32) -> s_s;
//   softmax in scalar code: lanes (row, half) each take half of the row's KV_TILE scores and
//   apply scale, softcap, bias, ALiBi and the masks (attn_common.wgsl's logit), then write
//   P = exp(x - m) as f16 to p_s;
//   O += P V on the matrix units; O stays in the subgroup's result tiles (OUT_TILES of them).
// The running max is lazy (as FlashAttention-4): a row keeps its reference max m until a tile's
// max exceeds it by more than TAU, so P <= e^TAU stays well inside f16 and O needs rescaling
// (through workgroup memory: the tiles are opaque) only on those rare tiles. Non-finite values
// (docs/contract.md "Non-finite values and scalar fields"): keys no row of the workgroup sees
// are never loaded (zeros); a non-finite v is staged as 0 (so 0 * NaN never reaches rows that
// do not see it) and a slow path marks, per lane, the output columns of its row that see it,
// written as NaN. Prefix constants: Q_TILE, KV_TILE, SUBGROUPS, THREADS (32 SUBGROUPS),
// DEPTH_TILES (QK_DIM/16: QK's depth tiles), OUT_TILES (V_DIM/16: output column tiles),
// KEY_TILES (KV_TILE/16), Q_STRIDE, K_STRIDE, V_STRIDE, S_STRIDE, P_STRIDE, LANE_KEYS
// (KV_TILE/2), MASK_WORDS (words of a lane's column mask).

var<workgroup> q_s: array<f16, Q_TILE * Q_STRIDE>;
var<workgroup> k_s: array<f16, KV_TILE * K_STRIDE>;
var<workgroup> v_s: array<f16, KV_TILE * V_STRIDE>;
var<workgroup> s_s: array<f32, Q_TILE * S_STRIDE>;
// Each subgroup's 16 x 16 O scratch (mm_store_x / mm_load_x). Its own array: sharing s_s's
// dead scores (measured) gave wrong products in every cell on the H100 (Dawn/Tint + NVIDIA's
// Vulkan driver), though the emulated build was right.
var<workgroup> o_x: array<f32, SUBGROUPS * 256u>;
var<workgroup> p_s: array<f16, Q_TILE * P_STRIDE>;
var<workgroup> red_s: array<f32, Q_TILE * 2u>;
var<workgroup> alpha_s: array<f32, Q_TILE>;
var<workgroup> flag_a: atomic<u32>;
var<workgroup> flag_u: u32;

// The kernel, entered through the primitive file's main (it knows how the device numbers
// subgroups: sg is the subgroup, lane its invocation; lid the workgroup-linear invocation).
fn kernel_body(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, sg: u32, lane: u32) {
  let w = prefill_wg(wid, nwg, Q_TILE);
  if (!w.ok) {
    return;
  }
  let h = w.h;
  let b = w.b;
  let kvh = w.kvh;
  let sq = w.seq;
  let i0 = w.i0;
  let rr = sg * 16u + lane % 16u;      // this lane's row in the workgroup (softmax, output)
  let hf = lane / 16u;                 // which half of the row's scores / column tiles
  let i = i0 + rr;
  let pos = row_pos(sq, i);
  let lo = u32(w.span.x);
  let hi = u32(w.span.y);

  // Q tile (raw: the scale is applied to the f32 scores), rows past seq_len (and padding
  // rows) zero.
  for (var idx = lid; idx < Q_TILE * QK_GRANULES; idx += THREADS) {
    let r = idx / QK_GRANULES;
    let g = idx % QK_GRANULES;
    var gv = GV();
    if (i0 + r < sq.rows) {
      gv = load_q(q_granule(b, h, i0 + r) + g);
    }
    for (var e = 0u; e < GRANULE; e++) {
      q_s[r * Q_STRIDE + g * GRANULE + e] = g_part(gv, e / 4u)[e % 4u];
    }
  }

  var o: array<MAcc, OUT_TILES>;
  for (var c = 0u; c < OUT_TILES; c++) {
    o[c] = mm_zero();
  }
  var m = MASKED;
  var l = 0.0;                         // this lane's half of the row sum
  var vbad: array<u32, MASK_WORDS>;            // output columns of this lane poisoned by a v
  for (var w = 0u; w < MASK_WORDS; w++) {
    vbad[w] = 0u;
  }

  let u_first = lo / KV_TILE;
  let n_units = select(0u, cdiv(hi, KV_TILE) - u_first, hi > lo);
  for (var it = 0u; it < n_units; it++) {
    let j0 = (u_first + it) * KV_TILE;
    workgroupBarrier();                // the previous tile's readers are done
    // Stage K and V: keys some row sees; a non-finite v half is staged as 0 and flagged.
    for (var idx = lid; idx < KV_TILE * QK_GRANULES; idx += THREADS) {
      let jj = idx / QK_GRANULES;
      let ld = j0 + jj >= lo && j0 + jj < hi;
      stage_k_granule(b, kvh, j0 + jj, jj, idx % QK_GRANULES, ld);
      if (V_GRANULES == QK_GRANULES && stage_v_granule(b, kvh, j0 + jj, jj, idx % QK_GRANULES, ld)) {
        atomicOr(&flag_a, 2u);
      }
    }
    if (V_GRANULES != QK_GRANULES) {                    // v's rows differ from k's: their own granules
      for (var idx = lid; idx < KV_TILE * V_GRANULES; idx += THREADS) {
        let jj = idx / V_GRANULES;
        if (stage_v_granule(b, kvh, j0 + jj, jj, idx % V_GRANULES, j0 + jj >= lo && j0 + jj < hi)) {
          atomicOr(&flag_a, 2u);
        }
      }
    }
    workgroupBarrier();

    // S = Q K^T for the subgroup's 16 rows and the tile's keys.
    for (var kc = 0u; kc < KEY_TILES; kc++) {
      var acc = mm_zero();
      for (var dc = 0u; dc < DEPTH_TILES; dc++) {
        acc = mm_qk(acc, sg * 16u * Q_STRIDE + dc * 16u, kc * 16u * K_STRIDE + dc * 16u);
      }
      mm_store_s(acc, sg * 16u * S_STRIDE + kc * 16u);
    }
    workgroupBarrier();

    // Logits of this lane's half of the row, and their max.
    var x: array<f32, LANE_KEYS>;
    var best = MASKED;
    for (var e = 0u; e < LANE_KEYS; e++) {
      let jl = hf * LANE_KEYS + e;
      let j = j0 + jl;
      var xv = MASKED;
      if (i < P.seq_len && j < hi && key_visible(i32(j), pos, sq)) {
        xv = logit(s_s[rr * S_STRIDE + jl] * P.scale, b, h, i, j, pos);
      }
      x[e] = xv;
      best = max(best, xv);
    }
    red_s[rr * 2u + hf] = best;
    workgroupBarrier();
    let m_tile = max(red_s[rr * 2u], red_s[rr * 2u + 1u]);
    let lm = lazy_max(m, m_tile);
    let alpha = lm.y;
    if (lm.x != m && m > MASKED) {
      atomicOr(&flag_a, 1u);
    }
    m = lm.x;
    // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p at 0.
    let m_use = select(m, 0.0, m <= MASKED);
    var psum = 0.0;
    for (var e = 0u; e < LANE_KEYS; e++) {
      let p = weight_of(x[e], m_use);
      psum += p;
      p_s[rr * P_STRIDE + hf * LANE_KEYS + e] = f16(p);
    }
    l = l * alpha + psum;
    if (hf == 0u) {
      alpha_s[rr] = alpha;
    }
    workgroupBarrier();
    if (lid == 0u) {
      flag_u = atomicExchange(&flag_a, 0u);
    }
    let flags = workgroupUniformLoad(&flag_u);

    if ((flags & 1u) != 0u) {
      // Some row's reference max moved: O rows *= alpha, tile by tile through o_x.
      for (var c = 0u; c < OUT_TILES; c++) {
        mm_store_x(o[c], sg * 256u);
        workgroupBarrier();
        for (var e = lane; e < 256u; e += 32u) {
          o_x[sg * 256u + e] *= alpha_s[sg * 16u + e / 16u];
        }
        workgroupBarrier();
        o[c] = mm_load_x(sg * 256u);
        workgroupBarrier();
      }
    }
    if ((flags & 2u) != 0u && i < P.seq_len) {
      // A non-finite v in this tile: mark the columns of this lane's row that see it.
      for (var jl = 0u; jl < KV_TILE; jl++) {
        let j = j0 + jl;
        if (j >= lo && j < hi && key_visible(i32(j), pos, sq)) {
          for (var c = hf; c < OUT_TILES; c += 2u) {
            for (var d = 0u; d < 16u; d++) {
              if (is_bad_f16(v_elem(b, kvh, j, c * 16u + d))) {
                let bit = (c / 2u) * 16u + d;
                vbad[bit / 32u] |= 1u << (bit % 32u);
              }
            }
          }
        }
      }
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

  // The row sum over both halves, the row's factor and lse.
  workgroupBarrier();
  red_s[rr * 2u + hf] = l;
  workgroupBarrier();
  let fin = finish_row(m, red_s[rr * 2u] + red_s[rr * 2u + 1u], row_sink(h, sq, i));
  if (hf == 0u) {
    alpha_s[rr] = fin.x;
    if (P.return_lse != 0u && i < P.seq_len) {
      lse[(b * P.num_heads + h) * P.seq_len + i] = fin.y;
    }
  }
  // Out, tile by tile through o_x: column tile c is written by the lanes of half c % 2.
  let base = out_vec4(b, h, i);
  for (var c = 0u; c < OUT_TILES; c++) {
    mm_store_x(o[c], sg * 256u);
    workgroupBarrier();
    if (c % 2u == hf && i < P.seq_len) {
      for (var u = 0u; u < 4u; u++) {
        var acc = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
          acc[e] = o_x[sg * 256u + (lane % 16u) * 16u + u * 4u + e] * alpha_s[rr];
          let bit = (c / 2u) * 16u + u * 4u + e;
          if ((vbad[bit / 32u] & (1u << (bit % 32u))) != 0u) {
            acc[e] = nan_f32();
          }
        }
        store_out(base + c * 4u + u, finite_or_nan4(acc));
      }
    }
    workgroupBarrier();
  }
}
