// flash_prefill_mma_direct: the matrix prefill with Q read straight from storage and K, V
// staged by the whole workgroup (params form="direct"; plain f16 K/V rows only). One
// workgroup owns Q_TILE = 16 * SUBGROUPS query rows of one head; subgroup g owns rows
// 16g..16g+15 and keeps, in separate variables (an array of matrices indexed at run time
// spills), its DEPTH_TILES Q operands (q0..q7) and its OUT_TILES output tiles (o0..o7): up to
// 128 columns each, the bounds constants, so the guarded lines of absent tiles compile away.
// K and V go through one workgroup tile each (k_s, v_s, rows padded by 8 halves as the GEMM
// probe's staged blocks), every invocation loading KV_UNITS 16-byte granules of the
// next tile into registers a tile ahead and storing them after the tile's first barrier: the
// subgroups share one copy of K and V, and two barriers a tile suffice. Per tile of KV_TILE
// keys j0..:
//   registers <- K and V of the next tile (zeros outside the keys [lo, hi) some row of the
//   workgroup sees: nothing past the range is read);
//   S = Q K^T from k_s -> the subgroup's rows of s_s;
//   barrier; the registers of this tile's V and the next tile's K -> v_s, k_s (a non-finite
//   v half staged as 0, with flag 2: the granule is tested whole, stage_v_units);
//   softmax (mma_common.wgsl's lane_logits / lane_weights, lazy max): lanes l and l ^ 16
//   share a row, its max exchanged by pair_max; P to p_s as f16;
//   take_flags' barrier; O += P V, P's KEY_TILES operands loaded once for all output tiles.
// O is rescaled through the O scratch (x_at) only on tiles where a row's reference max moved
// (flag 1); a lane's output columns that see a non-finite v are marked after the loop, if
// flag 2 was ever raised (seen_bad_v).
// (Measured on the H100, ci/results/h100_wgsl_mma_prefill_kstaged.txt: storing the registers
// after the softmax instead, or V's loaded in its own tile, were slower.) The rare rescale
// runs on every output tile before the first PV product: this order measured 1401 us at
// S=2048 on the H100 (1409-1432 on the H200); a build that moved each tile's rescale (three
// barriers) into its PV step measured 1734-1766 (with other edits). At q_tile 64 the
// rescale's branch, though rarely taken, costs about 200 us of it at S=2048: without it and
// the non-finite v branch 1197-1221 us; fewer flag barriers, the branch moved to an outer
// loop or its barriers dropped did not recover it (h200_wgsl_mma_prefill_branches.txt).
// q_tile 128 (NVIDIA's rule) took 826-832 us there; with the grid heavy-first, the lanes'
// rotation and the logits' fast path 522-528 us, and the build without the rescale's branch
// is no faster any more (534.5-534.8 us; h200_wgsl_prefill_order.txt).
// Prefix constants: those of flash_prefill_mma (K_STRIDE, V_STRIDE, P_STRIDE and S_STRIDE
// padded) and KV_UNITS.

// Workgroup memory: mma_prefill_common.wgsl's (k_s, v_s, s_s holding the O scratch, p_s,
// red_s, alpha_s).

// This invocation's granules of the K tile of keys j0.. (v: of the V tile) whose key j starts
// at element at + j * pitch (unit u: granule lid + u * THREADS of the tile, key-major); zeros
// for keys outside [lo, hi), which are not read.
fn load_units(at: u32, pitch: u32, j0: u32, lo: u32, hi: u32, lid: u32, v: bool
              ) -> array<GV, KV_UNITS> {
  let per = select(QK_GRANULES, V_GRANULES, v);         // granules a key
  var r: array<GV, KV_UNITS>;
  for (var u = 0u; u < KV_UNITS; u++) {  // @unroll
    let idx = lid + u * THREADS;
    let j = j0 + idx / per;
    if (idx < KV_TILE * per && j >= lo && j < hi) {
      let g = (at + j * pitch) / GRANULE + idx % per;
      if (v) {
        r[u] = load_v(g);
      } else {
        r[u] = load_k(g);
      }
    }
  }
  return r;
}

// The 8 halves of granule g into k_s (v: v_s) from element at, in order. (Each lane's words
// in an order rotated by lane / 8, which spreads a subgroup's stores over distinct banks,
// measured slower on the H100: S=2048 2485 against 1813 us, h100_wgsl_mma_prefill_kstaged.txt;
// the driver seems to merge the in-order stores.)
fn put_granule(at: u32, g: GV, v: bool) {
  for (var e = 0u; e < 4u; e++) {  // @unroll
    if (v) {
      v_s[at + e] = g[0][e];
      v_s[at + 4u + e] = g[1][e];
    } else {
      k_s[at + e] = g[0][e];
      k_s[at + 4u + e] = g[1][e];
    }
  }
}

// The K units into k_s (between barriers: no subgroup reads k_s meanwhile).
fn stage_k_units(r: array<GV, KV_UNITS>, lid: u32) {
  for (var u = 0u; u < KV_UNITS; u++) {  // @unroll
    let idx = lid + u * THREADS;
    if (idx < KV_TILE * QK_GRANULES) {
      put_granule((idx / QK_GRANULES) * K_STRIDE + (idx % QK_GRANULES) * GRANULE, r[u], false);
    }
  }
}

// The V units into v_s, non-finite halves as 0 (mm_finite: the granule tested whole, the
// slow path only where one is found); raises flag 2 if there was one (kept to the end).
fn stage_v_units(r: array<GV, KV_UNITS>, lid: u32) {
  var bad = false;
  for (var u = 0u; u < KV_UNITS; u++) {  // @unroll
    let idx = lid + u * THREADS;
    if (idx < KV_TILE * V_GRANULES) {
      var g = r[u];
      if (!mm_finite(g)) {
        g = mm_zero_bad(g);
        bad = true;
      }
      put_granule((idx / V_GRANULES) * V_STRIDE + (idx % V_GRANULES) * GRANULE, g, true);
    }
  }
  if (bad) {
    atomicOr(&flag_a[0], 2u);
  }
}

// Flag 2 (a V tile held a non-finite half) stays raised to the end: the key loop does not
// look (take_flags keeps it), and after the loop the lanes mark which of their output columns
// see one. A test in the loop, though its slow path never ran, cost 1 in 10 at q_tile 128
// (S=2048, H200: both rare branches out 587 us, only the rescale's out 636). Dawn does not
// zero workgroup memory (toggle disable_workgroup_init): kernel_body clears flag_a first.
// (A 4-byte workgroup variable of its own for the flag gave wrong products on the H200: the
// driver places workgroup variables without the 16-byte alignment the matrix arrays need, so
// every one is a multiple of 16 bytes; mma_common.wgsl's flags.)

// Whether a V tile held a non-finite half, the same for every lane (called by all after the
// key loop: its barrier puts every stage_v_units behind it).
fn seen_bad_v(lid: u32) -> bool {
  workgroupBarrier();
  if (lid == 0u) {
    flag_u = vec4<u32>(atomicLoad(&flag_a[0]), 0u, 0u, 0u);
  }
  return (workgroupUniformLoad(&flag_u).x & 2u) != 0u;
}

// vbad for every tile of keys from u_first (of n_units) that this lane's row sees (the slow
// path after a loop that raised flag 2).
fn mark_all_bad_v(w: PrefillWg, u_first: u32, n_units: u32, lo: u32, hi: u32, pos: i32,
                  hf: u32) -> array<u32, MASK_WORDS> {
  var vbad: array<u32, MASK_WORDS>;
  for (var it = 0u; it < n_units; it++) {
    vbad = mark_bad_v(vbad, w, (u_first + it) * KV_TILE, lo, hi, pos, hf);
  }
  return vbad;
}

// Scores of the subgroup's 16 rows against the 16 keys whose k starts at k_s[ko..].
fn s_tile(q0: MLeft, q1: MLeft, q2: MLeft, q3: MLeft, q4: MLeft, q5: MLeft, q6: MLeft,
          q7: MLeft, ko: u32) -> MAcc {
  var a = mm_qk_direct(mm_zero(), q0, ko);
  a = mm_qk_direct(a, q1, ko + 16u);
  if (DEPTH_TILES > 2u) { a = mm_qk_direct(a, q2, ko + 32u); }
  if (DEPTH_TILES > 3u) { a = mm_qk_direct(a, q3, ko + 48u); }
  if (DEPTH_TILES > 4u) { a = mm_qk_direct(a, q4, ko + 64u); }
  if (DEPTH_TILES > 5u) { a = mm_qk_direct(a, q5, ko + 80u); }
  if (DEPTH_TILES > 6u) { a = mm_qk_direct(a, q6, ko + 96u); }
  if (DEPTH_TILES > 7u) { a = mm_qk_direct(a, q7, ko + 112u); }
  return a;
}

// acc + P V for the output column tile at v_s[vo..]: the tile's KEY_TILES products.
fn pv_col(acc: MAcc, p0: MLeft, p1: MLeft, p2: MLeft, p3: MLeft, vo: u32) -> MAcc {
  var a = mm_pv_left(acc, p0, vo);
  if (KEY_TILES > 1u) { a = mm_pv_left(a, p1, vo + 16u * V_STRIDE); }
  if (KEY_TILES > 2u) { a = mm_pv_left(a, p2, vo + 32u * V_STRIDE); }
  if (KEY_TILES > 3u) { a = mm_pv_left(a, p3, vo + 48u * V_STRIDE); }
  return a;
}

// Where k's (kb, ks: first element, key pitch) and v's (vb, vs) rows of the workgroup's KV
// head lie (uniform).
struct KvRows {
  kb: u32,
  ks: u32,
  vb: u32,
  vs: u32,
}

fn kv_rows(w: PrefillWg) -> KvRows {
  let kb = kv_elem(w.b, w.kvh, 0u);
  let vb = v_row_at(w.b, w.kvh, 0u);
  return KvRows(kb, kv_elem(w.b, w.kvh, 1u) - kb, vb, v_row_at(w.b, w.kvh, 1u) - vb);
}

// Q operand t of the subgroup's 16 rows of q from element at (rows st apart; the last one
// again past DEPTH_TILES: the guarded lines that would use it compile away). edge (q_edge,
// uniform; its own argument, since WGSL's analysis takes a struct holding a lane's values
// as non-uniform): the workgroup's rows would reach past q's end (the last rows of the last
// batch and head), so only the subgroup's `rows` existing rows are read, through its rows
// of p_s (mm_load_q_edge: called by every invocation, barriers).
fn q_operand(qr: QRows, edge: bool, t: u32, pa: u32, lane: u32) -> MLeft {
  let o = qr.at + min(t, DEPTH_TILES - 1u) * 16u;
  if (edge) {
    return mm_load_q_edge(o, qr.st, qr.rows, pa, lane);
  }
  return mm_load_q(o, qr.st);
}

// Where subgroup sg's 16 rows of q lie: first element (at), row pitch (st) and how many of
// the subgroup's rows q holds (rows; those past seq_len that q holds load whatever is
// there: they see no key).
struct QRows {
  at: u32,
  st: u32,
  rows: u32,
}

// The workgroup's first element of q.
fn q_first(w: PrefillWg) -> u32 {
  return w.b * P.q_sb + w.h * P.q_sh + w.i0 * P.q_ss;
}

fn q_tile_rows(w: PrefillWg, sg: u32) -> QRows {
  let rows = min(16u, P.seq_len - min(P.seq_len, w.i0 + sg * 16u));
  return QRows(q_first(w) + sg * 16u * P.q_ss, P.q_ss, rows);
}

// Whether the workgroup's Q_TILE rows would reach past q's end (uniform).
fn q_edge(w: PrefillWg) -> bool {
  return q_first(w) + (Q_TILE - 1u) * P.q_ss + QK_DIM > arrayLength(&q);
}

// The tile's softmax on this lane's half of its row (mma_common.wgsl's lane_logits /
// lane_weights, the row's max exchanged by pair_max): P to p_s, the row's (max, sum) after.
fn tile_softmax(at: LanePlace, j0: u32, hi: u32, w: PrefillWg, ml: vec2<f32>, lid: u32
                ) -> vec2<f32> {
  let x = place_logits(at, j0, hi, w);
  var best = MASKED;
  for (var e = 0u; e < LANE_KEYS; e++) {
    best = max(best, x[e]);
  }
  return lane_weights(x, ml, pair_max(best, lid), at.rr * P_STRIDE + at.hf * LANE_KEYS, at.rr,
                      at.hf, at.rot);
}

// P's operand of key tile t (the last one again past KEY_TILES, as q_operand).
fn p_tile(at: u32, t: u32) -> MLeft {
  return mm_load_p(at + min(t, KEY_TILES - 1u) * 16u);
}

// The kernel, entered through the primitive file's main (sg: the subgroup, lane its
// invocation, lid the workgroup-linear invocation).
fn kernel_body(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, sg: u32, lane: u32) {
  let w = prefill_wg(wid, nwg, Q_TILE);
  if (!w.ok) {
    return;
  }
  let qr = q_tile_rows(w, sg);          // the subgroup's Q rows (none past q's end read)
  let edge = q_edge(w);
  let pa = sg * 16u * P_STRIDE;
  let q0 = q_operand(qr, edge, 0u, pa, lane);
  let q1 = q_operand(qr, edge, 1u, pa, lane);
  let q2 = q_operand(qr, edge, 2u, pa, lane);
  let q3 = q_operand(qr, edge, 3u, pa, lane);
  let q4 = q_operand(qr, edge, 4u, pa, lane);
  let q5 = q_operand(qr, edge, 5u, pa, lane);
  let q6 = q_operand(qr, edge, 6u, pa, lane);
  let q7 = q_operand(qr, edge, 7u, pa, lane);
  let at = lane_place(w, sg, lane);
  let lo = u32(w.span.x);               // the keys some row of the workgroup sees (kept
  let hi = u32(w.span.y);               // apart from at: uniform)
  let kv = kv_rows(w);
  var o0 = mm_zero(); var o1 = mm_zero(); var o2 = mm_zero(); var o3 = mm_zero();
  var o4 = mm_zero(); var o5 = mm_zero(); var o6 = mm_zero(); var o7 = mm_zero();
  var ml = vec2<f32>(MASKED, 0.0);     // the row's max, this lane's half of its sum
  let sa = sg * 16u * S_STRIDE;

  if (lid == 0u) {
    atomicStore(&flag_a[0], 0u);       // before the barrier ahead of the loop
  }
  let u_first = lo / KV_TILE;
  let n_units = select(0u, cdiv(hi, KV_TILE) - u_first, hi > lo);
  stage_k_units(load_units(kv.kb, kv.ks, u_first * KV_TILE, lo, hi, lid, false), lid);
  var vr = load_units(kv.vb, kv.vs, u_first * KV_TILE, lo, hi, lid, true);
  workgroupBarrier();
  for (var it = 0u; it < n_units; it++) {
    let j0 = (u_first + it) * KV_TILE;
    // the next tile's K and V in flight during this tile
    let kr = load_units(kv.kb, kv.ks, j0 + KV_TILE, lo, hi, lid, false);
    let vn = load_units(kv.vb, kv.vs, j0 + KV_TILE, lo, hi, lid, true);
    for (var kc = 0u; kc < KEY_TILES; kc++) {
      mm_store_s(s_tile(q0, q1, q2, q3, q4, q5, q6, q7, kc * 16u * K_STRIDE), sa + kc * 16u);
    }
    // every subgroup's QK (k_s) and PV of the last tile (v_s) are done: both take their next
    workgroupBarrier();
    stage_k_units(kr, lid);
    stage_v_units(vr, lid);
    vr = vn;

    ml = tile_softmax(at, j0, hi, w, ml, lid);
    let flags = take_flags(lid, 2u);
    // some row's reference max moved: O rows *= alpha, all before the products (see the top)
    if ((flags & 1u) != 0u) {
      o0 = rescaled(o0, sg, lane, sg * 16u);
      if (OUT_TILES > 1u) { o1 = rescaled(o1, sg, lane, sg * 16u); }
      if (OUT_TILES > 2u) { o2 = rescaled(o2, sg, lane, sg * 16u); }
      if (OUT_TILES > 3u) { o3 = rescaled(o3, sg, lane, sg * 16u); }
      if (OUT_TILES > 4u) { o4 = rescaled(o4, sg, lane, sg * 16u); }
      if (OUT_TILES > 5u) { o5 = rescaled(o5, sg, lane, sg * 16u); }
      if (OUT_TILES > 6u) { o6 = rescaled(o6, sg, lane, sg * 16u); }
      if (OUT_TILES > 7u) { o7 = rescaled(o7, sg, lane, sg * 16u); }
    }

    let p0 = p_tile(pa, 0u);
    let p1 = p_tile(pa, 1u);
    let p2 = p_tile(pa, 2u);
    let p3 = p_tile(pa, 3u);
    o0 = pv_col(o0, p0, p1, p2, p3, 0u);
    if (OUT_TILES > 1u) { o1 = pv_col(o1, p0, p1, p2, p3, 16u); }
    if (OUT_TILES > 2u) { o2 = pv_col(o2, p0, p1, p2, p3, 32u); }
    if (OUT_TILES > 3u) { o3 = pv_col(o3, p0, p1, p2, p3, 48u); }
    if (OUT_TILES > 4u) { o4 = pv_col(o4, p0, p1, p2, p3, 64u); }
    if (OUT_TILES > 5u) { o5 = pv_col(o5, p0, p1, p2, p3, 80u); }
    if (OUT_TILES > 6u) { o6 = pv_col(o6, p0, p1, p2, p3, 96u); }
    if (OUT_TILES > 7u) { o7 = pv_col(o7, p0, p1, p2, p3, 112u); }
  }
  var vbad: array<u32, MASK_WORDS>;    // output columns of this lane poisoned by a v (zeros)
  if (seen_bad_v(lid)) {
    vbad = mark_all_bad_v(w, u_first, n_units, lo, hi, at.pos, at.hf);
  }
  write_out(o0, o1, o2, o3, o4, o5, o6, o7, ml, vbad, w, at.rr, at.hf, sg, lane);
}

// The row's factor and lse, then out tile by tile through the O scratch (x_at).
fn write_out(o0: MAcc, o1: MAcc, o2: MAcc, o3: MAcc, o4: MAcc, o5: MAcc, o6: MAcc, o7: MAcc,
             ml: vec2<f32>, vbad: array<u32, MASK_WORDS>, w: PrefillWg, rr: u32, hf: u32,
             sg: u32, lane: u32) {
  let i = w.i0 + rr;
  finish_lane_row(ml, w, rr, hf, i);
  let base = out_vec4(w.b, w.h, i);
  let live = i < P.seq_len;
  write_tile(o0, 0u, vbad, base, rr, hf, sg, lane, live);
  if (OUT_TILES > 1u) { write_tile(o1, 1u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 2u) { write_tile(o2, 2u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 3u) { write_tile(o3, 3u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 4u) { write_tile(o4, 4u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 5u) { write_tile(o5, 5u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 6u) { write_tile(o6, 6u, vbad, base, rr, hf, sg, lane, live); }
  if (OUT_TILES > 7u) { write_tile(o7, 7u, vbad, base, rr, hf, sg, lane, live); }
}
