// flash_prefill: one workgroup owns Q_TILE query rows of one head and streams the keys with an
// online softmax (FlashAttention-2 order: S = QK^T, row max, P = exp, O += PV). Threads form
// Q_TILE / ROWS_PER_LANE row groups of ROW_LANES lanes: a lane owns ROWS_PER_LANE rows and the
// score columns tx, tx+ROW_LANES, ... of each step, and a share of the output columns.
// Its constants, workgroup memory and helpers are flash_prefill_steps.wgsl; main is here.
// Its variants, and the prefix constants that pick them, are told there too.
//
// main is one body of about 290 lines, past the house's 80 a function: a measured exception
// (#34), every split of it slower on the H100 (engineering-notes.md, "main is one body").
// Loops over the lane's tiles are marked @unroll, for the program builder to write out: Dawn's
// NVIDIA build kept their private arrays in local memory otherwise (engineering-notes.md).
// Why NVIDIA's build of the splits is slower is not known. The twins in main (the staging
// for both PREFETCH orders, the PV loop for full and edge steps) stay for the same reason.

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, li: LaneInfo) {
  let w = prefill_wg(wid, nwg, Q_TILE);
  if (!w.ok) {
    return;
  }
  let rt = w.rt;
  let n_rt = w.n_rt;
  let h = w.h;
  let b = w.b;
  let kvh = w.kvh;
  let sq = w.seq;
  let sg = subgroup_lanes(li);
  let wide = sg >= ROW_LANES;     // rows_reduce's shuffles span a row group
  // SLICED's QK where the subgroups hold whole row groups (and the workgroup whole subgroups)
  let sliced = SLICED == 1u && wide && THREADS % sg == 0u;
  let xs = select(1u, sg / ROW_LANES, sliced);    // lane distance from tx to tx+1 (uniform)
  let place = lane_place(lid, sg, sliced);
  let ty = place.x;
  let tx = place.y;
  // SLICED with at most two keys a lane a step: the weights reach the PV lanes by shuffles
  // from the lanes that own their keys, not through p_s and its two barriers a step (a
  // select per key a lane holds picks the value to send). Faster on the H200 at 2 keys a
  // lane, slower at 4, which keep p_s (ci/results/h200_wgsl_sliced_prefill.txt, calls 6-7).
  // lane0: the row group's first lane in the subgroup.
  let p_shuffled = sliced && LANE_KEYS <= 2u;
  let lane0 = (lid % sg) % xs;
  let i0 = w.i0;
  let span = w.span;
  let seen_all = common_span(sq, i0, min(i0 + Q_TILE, P.seq_len) - 1u);
  var rk: array<vec2<i32>, ROWS_PER_LANE>;    // the keys each of the lane's rows sees
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    rk[a] = row_span(row_pos(sq, i0 + ty * ROWS_PER_LANE + a), sq);
  }
  let lo = u32(span.x);
  let hi = u32(span.y);

  for (var u = 0u; u < (Q_TILE * QK_GRANULES + THREADS - 1u) / THREADS; u++) {
    let idx = lid + u * THREADS;
    if (SLICED == 1u || idx >= Q_TILE * QK_GRANULES) {
      break;                              // SLICED: q is read into registers below
    }
    let r = idx / QK_GRANULES;
    let g = idx % QK_GRANULES;
    var gv = GV();
    if (i0 + r < sq.rows) {               // padding rows' q is never read
      gv = load_q(q_granule(b, h, i0 + r) + g);
    }
    for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
      q_s[r * QK_VEC4S + g * GRANULE_VEC4S + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  workgroupBarrier();     // q_s is read by every lane (STAGED 0 has no staging barrier first)
  // SLICED: the lane's vec4s tx, tx+ROW_LANES, ... of its rows' q, scaled
  var qr: array<array<vec4<f32>, SLICE_VEC4S>, ROWS_PER_LANE>;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    for (var u = 0u; u < SLICE_VEC4S; u++) {  // @unroll
      qr[a][u] = vec4<f32>(0.0);
      let r = i0 + ty * ROWS_PER_LANE + a;
      let c = tx + ROW_LANES * u;
      if (sliced && r < sq.rows && c < QK_VEC4S) {
        qr[a][u] = q_vec(b, h, r, c);
      }
    }
  }

  var m: array<f32, ROWS_PER_LANE>;
  var l: array<f32, ROWS_PER_LANE>;
  var o: array<array<vec4<f32>, O_REGS>, ROWS_PER_LANE>;
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    m[a] = MASKED;
    l[a] = 0.0;
    for (var c = 0u; c < O_REGS; c++) {  // @unroll
      o[a][c] = vec4<f32>(0.0);
    }
    for (var c = 0u; c < WG_SLOTS; c++) {  // @unroll
      o_s[osi(ty * ROWS_PER_LANE + a, tx, c)] = vec4<f32>(0.0);
    }
  }

  // The units to visit: every unit meeting [span.x, span.y), or the listed blocks there.
  let u_first = u32(span.x) / KV_TILE;
  var n_units = select(0u, cdiv(hi, KV_TILE) - u_first, hi > u32(span.x));
  var l_first = 0u;
  if (BLOCKS == 1u) {
    let ls = blk_span(blk_row(b, h, rt, n_rt), u32(span.x), hi, KV_TILE);
    l_first = ls.x;
    n_units = ls.y - ls.x;
  }

  // Unit loop. STAGED 1 with PREFETCH: iteration it stores tile it-1 (already in registers)
  // to workgroup memory, issues the loads of tile it, then computes tile it-1, so the loads
  // fly during the compute. The loads have a constant trip count (the compiler unrolls them
  // and issues all before the first use) and sit in main with their staging, written out
  // for both orders, as in decode_partial (which says why).
  var kr: array<RG, K_LOADS>;    // granules as loaded (kv_units.wgsl's RG)
  var vr: array<RG, V_LOADS>;
  for (var it = 0u; it < n_units + AHEAD; it++) {
    if (STAGED == 1u) {
      if (AHEAD == 1u && it > 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < K_LOADS; u++) {  // @unroll
          stage_k(lid + u * THREADS, kr[u]);
        }
        for (var u = 0u; u < V_LOADS; u++) {  // @unroll
          stage_v(lid + u * THREADS, vr[u]);
        }
        workgroupBarrier();
      }
      var jf = 0u;
      if (it < n_units) {
        jf = unit_of(it, u_first, l_first).x;
      }
      for (var u = 0u; u < K_LOADS; u++) {  // @unroll
        let idx = lid + u * THREADS;
        let jj = idx / QK_GRANULES;
        kr[u] = RG();
        // min(): V_LOADS == K_LOADS where this runs; it keeps the unrolled copies' constant
        // index in bounds where V_LOADS < K_LOADS and the branch is dead
        if (V_GRANULES == QK_GRANULES) {
          vr[min(u, V_LOADS - 1u)] = RG();
        }
        // only keys some row sees: never past the valid length, never left of the window
        // or of kv_start
        if (idx < KV_TILE * QK_GRANULES && it < n_units && jf + jj >= lo && jf + jj < hi) {
          let at = kv_granule(b, kvh, jf + jj) + idx % QK_GRANULES;
          kr[u] = raw_k(at);
          if (V_GRANULES == QK_GRANULES) {    // v's rows are k's: the same granules
            vr[min(u, V_LOADS - 1u)] = raw_v(at);
          }
        }
      }
      if (V_GRANULES != QK_GRANULES) {
        for (var u = 0u; u < V_LOADS; u++) {  // @unroll
          let idx = lid + u * THREADS;
          let jj = idx / V_GRANULES;
          vr[u] = RG();
          if (idx < KV_TILE * V_GRANULES && it < n_units && jf + jj >= lo && jf + jj < hi) {
            vr[u] = raw_v(v_granule(b, kvh, jf + jj) + idx % V_GRANULES);
          }
        }
      }
      if (AHEAD == 0u) {
        workgroupBarrier();   // the previous tile's readers are done with k_s/v_s
        for (var u = 0u; u < K_LOADS; u++) {  // @unroll
          stage_k(lid + u * THREADS, kr[u]);
        }
        for (var u = 0u; u < V_LOADS; u++) {  // @unroll
          stage_v(lid + u * THREADS, vr[u]);
        }
        workgroupBarrier();
      }
      if (it < AHEAD) {
        continue;
      }
    }
    let cur = unit_of(it - AHEAD, u_first, l_first);
    let wb = cur.y == 1u;

    for (var st = 0u; st < STEPS; st++) {
      let js = cur.x + st * K_STEP;           // first key of this step

      // S = QK^T for the lane's ROWS_PER_LANE rows and LANE_KEYS keys, in private memory.
      var sc: array<array<f32, LANE_KEYS>, ROWS_PER_LANE>;
      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
          sc[a][e] = 0.0;
        }
      }
      if (STAGED == 1u && sliced) {
        // group g of ROW_LANES keys: every lane's partial dots of all of them over its slice,
        // then reduce-scattered (level lv halves the keys a lane keeps: the upper half where
        // tx's bit says so), ending with key g * ROW_LANES + tx whole in x[a][0]
        // (KEY_GROUPS is LANE_KEYS here: its copies may pass the unroller's size cap, and sc
        // is then written by a compare per group below, never at a run-time index)
        for (var g = 0u; g < KEY_GROUPS; g++) {  // @unroll
          var x: array<array<f32, SLICE_LANES>, ROWS_PER_LANE>;
          for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
            for (var e = 0u; e < SLICE_LANES; e++) {  // @unroll
              x[a][e] = 0.0;
            }
          }
          for (var e = 0u; e < SLICE_LANES; e++) {  // @unroll
            let kr = (st * K_STEP + g * ROW_LANES + e) * K_STRIDE;
            for (var u = 0u; u < SLICE_VEC4S; u++) {  // @unroll
              let c = tx + ROW_LANES * u;
              if (SLICE_VEC4S * ROW_LANES == QK_VEC4S || c < QK_VEC4S) {
                let kv = k_at(kr + c);
                for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
                  x[a][e] += dot(qr[a][u], kv);
                }
              }
            }
          }
          for (var lv = 0u; lv < SLICE_LEVELS; lv++) {  // @unroll
            let half = ROW_LANES >> (lv + 1u);
            let upper = (tx & half) != 0u;
            for (var i = 0u; i < SLICE_LANES / 2u; i++) {  // @unroll
              if (i < half) {
                for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
                  let keep = select(x[a][i], x[a][i + half], upper);
                  let give = select(x[a][i + half], x[a][i], upper);
                  x[a][i] = keep + lane_xor(give, half * xs);
                }
              }
            }
          }
          for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
            for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
              sc[a][e] = select(sc[a][e], x[a][0], e == g);
            }
          }
        }
      } else if (STAGED == 1u) {
        for (var c = 0u; c < QK_VEC4S; c++) {
          var kc: array<vec4<f32>, LANE_KEYS>;
          for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
            kc[e] = k_at((st * K_STEP + tx + ROW_LANES * e) * K_STRIDE + c);
          }
          for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
            var qa: vec4<f32>;
            if (SLICED == 1u) {   // subgroups narrower than a row group: q from memory
              qa = vec4<f32>(0.0);
              let r = i0 + ty * ROWS_PER_LANE + a;
              if (r < sq.rows) {
                qa = q_vec(b, h, r, c);
              }
            } else {
              qa = q_s[(ty * ROWS_PER_LANE + a) * QK_VEC4S + c];
            }
            for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
              sc[a][e] += dot(qa, kc[e]);
            }
          }
        }
      } else {
        var kb: array<u32, LANE_KEYS>;
        var ok: array<bool, LANE_KEYS>;
        for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
          let j = js + tx + ROW_LANES * e;
          ok[e] = j >= lo && j < hi;        // only keys some row sees
          kb[e] = 0u;
          if (ok[e]) {
            kb[e] = kv_granule(b, kvh, j);
          }
        }
        for (var g = 0u; g < QK_GRANULES; g++) {
          var kg: array<GV, LANE_KEYS>;
          for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
            kg[e] = GV();
            if (ok[e]) {
              kg[e] = load_k(kb[e] + g);
            }
          }
          for (var s = 0u; s < GRANULE_VEC4S; s++) {  // @unroll
            for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
              let qa = q_s[(ty * ROWS_PER_LANE + a) * QK_VEC4S + g * GRANULE_VEC4S + s];
              for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
                sc[a][e] += dot(qa, vec4<f32>(g_part(kg[e], s)));
              }
            }
          }
        }
      }

      // every row of the tile sees every key of the step (off the causal diagonal and the
      // window's edges): no test a key (H200, S=2048: 2243 against 2293 us)
      let full = i32(js) >= max(span.x, seen_all.x)
          && i32(js + K_STEP) <= min(span.y, seen_all.y);
      var mx: array<f32, ROWS_PER_LANE>;
      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        let i = i0 + ty * ROWS_PER_LANE + a;
        let pos = row_pos(sq, i);
        var best = MASKED;
        for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
          let j = js + tx + ROW_LANES * e;
          var x = MASKED;
          if (PLAIN_LOGITS == 1u && full) {
            x = plain_logit(sc[a][e]);
          } else if (full || (i < P.seq_len && j < hi && key_visible(i32(j), pos, sq))) {
            x = logit_b(sc[a][e], b, h, i, j, pos, wb);
          }
          sc[a][e] = x;
          best = max(best, x);
        }
        mx[a] = best;
      }
      mx = rows_reduce(mx, ty, tx, true, wide, xs);
      if ((STAGED == 0u || st > 0u) && !p_shuffled) {
        workgroupBarrier();   // the previous step's readers are done with p_s (a staged tile's
      }                       // first step has its staging barriers: h200_wgsl_scalar_prefill)

      for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
        let m_new = max(m[a], mx[a]);
        // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
        let m_use = select(m_new, 0.0, m_new <= MASKED);
        let alpha = exp(m[a] - m_use);
        m[a] = m_new;
        var psum = 0.0;
        for (var e = 0u; e < LANE_KEYS; e++) {  // @unroll
          let p = weight_of(sc[a][e], m_use);
          psum += p;
          sc[a][e] = p;
          if (!p_shuffled) {
            p_s[(ty * ROWS_PER_LANE + a) * K_STEP + tx + ROW_LANES * e] = p;
          }
        }
        l[a] = l[a] * alpha + psum;
        for (var c = 0u; c < O_REGS; c++) {  // @unroll
          o[a][c] *= alpha;
        }
        for (var c = 0u; c < WG_SLOTS; c++) {  // @unroll
          o_s[osi(ty * ROWS_PER_LANE + a, tx, c)] *= alpha;
        }
      }
      if (!p_shuffled) {
        workgroupBarrier();   // p_s written
      }

      // O += P V over the step's keys; the lane's output units are tx, tx+ROW_LANES, ... A step
      // on the causal diagonal or the window's edge adds only the keys each row sees.
      if (all_see(js, js + K_STEP, span, seen_all)) {
        for (var jj = 0u; jj < K_STEP; jj++) {
          let vv = full_values(st, jj, js + jj, tx, b, kvh, lo, hi);
          for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
            let p = step_weight(sc[a], ty * ROWS_PER_LANE + a, jj, p_shuffled, lane0, xs);
            for (var c = 0u; c < REG_SLOTS; c++) {  // @unroll
              o[a][c] += p * vv[c];
            }
            for (var c = 0u; c < WG_SLOTS; c++) {  // @unroll
              let at = osi(ty * ROWS_PER_LANE + a, tx, c);
              o_s[at] += p * vv[REG_SLOTS + c];
            }
          }
        }
      } else {
        for (var jj = 0u; jj < K_STEP; jj++) {
          let j = js + jj;
          let vv = step_values(st, jj, j, tx, b, kvh, lo, hi);
          for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
            // (shuffled in uniform control flow, before the branch)
            let p = step_weight(sc[a], ty * ROWS_PER_LANE + a, jj, p_shuffled, lane0, xs);
            // a branch per (key, row), not a select per element: the edge steps then
            // cost what the full ones do
            if (i32(j) >= rk[a].x && i32(j) < rk[a].y) {
              for (var c = 0u; c < REG_SLOTS; c++) {  // @unroll
                o[a][c] += p * vv[c];
              }
              for (var c = 0u; c < WG_SLOTS; c++) {  // @unroll
                let at = osi(ty * ROWS_PER_LANE + a, tx, c);
                o_s[at] += p * vv[REG_SLOTS + c];
              }
            }
          }
        }
      }
    }
  }

  // Each lane summed only its own columns: the row sum is the sum over the row group.
  l = rows_reduce(l, ty, tx, false, wide, xs);
  for (var a = 0u; a < ROWS_PER_LANE; a++) {  // @unroll
    let i = i0 + ty * ROWS_PER_LANE + a;
    if (i < P.seq_len) {
      let fin = finish_row(m[a], l[a], row_sink(h, sq, i));
      let base = out_vec4(b, h, i);
      for (var c = 0u; c < LANE_SLOTS; c++) {  // @unroll
        let un = tx + ROW_LANES * (c / OUT_UNIT);
        if (un < OUT_UNITS) {
          var acc = vec4<f32>(0.0);
          if (c < REG_SLOTS) {
            acc = o[a][min(c, O_REGS - 1u)];   // c < REG_SLOTS here; the min keeps an unrolled
                                                // dead branch's constant index in bounds
          } else {
            acc = o_s[osi(ty * ROWS_PER_LANE + a, tx, c - REG_SLOTS)];
          }
          store_out(base + un * OUT_UNIT + c % OUT_UNIT, finite_or_nan4(acc * fin.x));
        }
      }
      if (P.return_lse != 0u && tx == 0u) {
        lse[(b * P.num_heads + h) * P.seq_len + i] = fin.y;
      }
    }
  }
}
