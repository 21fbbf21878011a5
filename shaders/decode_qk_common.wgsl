// The QK side that decode_partial and decode_qk share: the workgroup's query vectors staged
// once in q_s (scaled, rows Q_STRIDE vec4s apart), K tiles staged in k_s, and QK^T of a tile
// into p_s as logits. QK: SLICES lanes per key, each a slice of SLICE_VEC4S vec4s of the
// head, all VECTORS query vectors; consecutive lanes take consecutive keys (distinct banks);
// with SLICES > 1 the slices' partial dots meet in part_s.
// Each family declares Q_STRIDE and LOW_KEYS (1 where a tile may start before the split's
// first key klo: decode_partial's listed blocks). DIRECT 1 (decode_partial, kv_staging
// "direct"): no k_s; lane (slice h = lid % SLICES, key lid / SLICES) loads the load units
// (kv_units.wgsl's KU: a granule, or 16 bytes of quantized codes) h, h + SLICES, ... of its
// keys straight into registers (k_reg: K_REGS units a tile, the SLICES lanes of a key reading
// its row's consecutive units together) and dots them there, a unit's scale applied once.

const SLICES: u32 = max(1u, THREADS / KV_TILE);                 // QK lanes per key
const PASS_KEYS: u32 = THREADS / SLICES;                        // keys per QK pass
const PASSES: u32 = KV_TILE / min(KV_TILE, PASS_KEYS);          // QK passes per tile
const SLICE_VEC4S: u32 = (QK_VEC4S + SLICES - 1u) / SLICES;     // vec4s per QK lane
const K_STRIDE: u32 = QK_VEC4S + 1u;    // padded K row stride: lanes read distinct banks
const K_LOADS: u32 = (KV_TILE * QK_GRANULES + THREADS - 1u) / THREADS;  // K granules per lane
const QK_UNITS: u32 = QK_VEC4S / UNIT_VEC4S;                    // DIRECT: load units a row
const SLICE_UNITS: u32 = (QK_UNITS + SLICES - 1u) / SLICES;     // DIRECT: units per slice
const K_REGS: u32 = 1u + DIRECT * (PASSES * SLICE_UNITS - 1u);  // DIRECT: K units a lane
// DIRECT: the Q_LANE_VEC4S vec4s of q a QK lane reads are the same every tile (its slice's
// units, every vector). With Q_IN_REGS (a prefix constant, decode_partial's:
// tiles.decode_q_regs, where they fit its register budget) the lane holds them in q_r;
// otherwise it reads them from q_s each tile, a 16-byte load for 4 FMAs.
const Q_LANE_VEC4S: u32 = SLICE_UNITS * UNIT_VEC4S * VECTORS;

var<workgroup> q_s: array<vec4<f32>, VECTORS * Q_STRIDE>;
var<workgroup> k_s: array<TS, 1u + (1u - DIRECT) * (KV_TILE * K_STRIDE - 1u)>;
var<workgroup> part_s: array<f32, KV_TILE * VECTORS * SLICES>;
var<private> q_r: array<vec4<f32>, 1u + Q_IN_REGS * (Q_LANE_VEC4S - 1u)>;   // the lane's q

// The workgroup's vectors and the keys [klo, khi) of its split that they may see.
struct Wg {
  b: u32,
  kvh: u32,
  hc: u32,
  i0: u32,
  seq: Seq,
  klo: u32,
  khi: u32,
}

// Logit of query vector r against key j, or MASKED if j is invisible to it or outside the
// split's keys (or r is past the GQA group, or its row past the queries). with_bias false:
// the tile's bias is known to be all 0; plain: a tile_plain tile, whose keys need no tests
// and whose logits are the scores themselves (plain_logit).
fn vec_logit(w: Wg, r: u32, j: u32, dot_qk: f32, with_bias: bool, plain: bool) -> f32 {
  let gh = w.hc * GROUP_TILE + r / M_TILE;
  let i = w.i0 + r % M_TILE;
  if (plain) {
    return select(MASKED, plain_logit(dot_qk), gh < P.group_size && i < P.seq_len);
  }
  let pos = row_pos(w.seq, i);
  if (gh < P.group_size && i < P.seq_len && (LOW_KEYS == 0u || j >= w.klo) && j < w.khi
      && key_visible(i32(j), pos, w.seq)) {
    return logit_b(dot_qk, w.b, w.kvh * P.group_size + gh, i, j, pos, with_bias);
  }
  return MASKED;
}

// Whether the tile of keys j0.. needs none of vec_logit's tests: a spec without softcap, bias
// or ALiBi (PLAIN_LOGITS), every key of the tile inside the split's [klo, khi), and each of
// them seen by every row of the row tile (decode_pv_common's tile_full, stricter).
fn tile_plain(d: DecodeWg, j0: u32, klo: u32, khi: u32) -> bool {
  return PLAIN_LOGITS == 1u && j0 >= klo && j0 + KV_TILE <= khi
      && all_see(j0, j0 + KV_TILE, vec2<i32>(i32(klo), i32(khi)), d.seen_all);
}

// The scaled query vectors into q_s; absent vectors and padding rows (whose q is never read)
// load zeros.
fn stage_queries(d: DecodeWg, lid: u32) {
  for (var u = 0u; u < (VECTORS * QK_GRANULES + THREADS - 1u) / THREADS; u++) {
    let idx = lid + u * THREADS;
    if (idx >= VECTORS * QK_GRANULES) {
      break;
    }
    let r = idx / QK_GRANULES;
    let g = idx % QK_GRANULES;
    let gh = d.hc * GROUP_TILE + r / M_TILE;
    let i = d.i0 + r % M_TILE;
    var gv = GV();
    if (gh < P.group_size && i < d.seq.rows) {
      gv = load_q(q_granule(d.b, d.kvh * P.group_size + gh, i) + g);
    }
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      q_s[r * Q_STRIDE + g * GRANULE_VEC4S + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
}

// Q_IN_REGS (DIRECT only): lane lid's q vec4s (slice_dots' order) from q_s, once after
// stage_queries' barrier; units past the head are zeros.
fn load_q_regs(lid: u32) {
  if (Q_IN_REGS == 1u) {
    let h = lid % SLICES;
    for (var g = 0u; g < SLICE_UNITS; g++) {
      let gi = min(h + SLICES * g, QK_UNITS - 1u);
      let live = h + SLICES * g < QK_UNITS;
      for (var s = 0u; s < UNIT_VEC4S; s++) {
        for (var r = 0u; r < VECTORS; r++) {
          q_r[(g * UNIT_VEC4S + s) * VECTORS + r] =
              select(vec4<f32>(0.0), q_s[r * Q_STRIDE + gi * UNIT_VEC4S + s], live);
        }
      }
    }
  }
}

// One granule of the register tile into workgroup memory, called from the unrolled loops of
// both pipeline orders. It takes the granule as loaded (kv_units.wgsl's RG), never the
// register tile: a helper taking the tile by pointer made a driver keep it in local memory.
fn stage_k(idx: u32, kr: RG) {
  if (idx < KV_TILE * QK_GRANULES) {
    let kg = granule_of(kr);
    let ks = tile_at(idx, K_STRIDE, QK_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      k_s[ks + s] = ts_part(kg, s);
    }
  }
}

// DIRECT: unit u of the lane's K registers for the tile of keys jf.. (pass u / SLICE_UNITS,
// slice unit u % SLICE_UNITS): zeros unless live and the key lies in [lo, hi), as
// kv_granules.
fn k_reg(u: u32, lid: u32, b: u32, kvh: u32, jf: u32, lo: u32, hi: u32, live: bool) -> KUnit {
  let jj = lid / SLICES + PASS_KEYS * (u / SLICE_UNITS);
  let gi = lid % SLICES + SLICES * (u % SLICE_UNITS);
  var g = KUnit();
  if (live && gi < QK_UNITS && jf + jj >= lo && jf + jj < hi) {
    let e = kv_elem(b, kvh, jf + jj) + gi * UNIT_VEC4S * 4u;
    g = KUnit(ku_k(e), ku_scale_k(e));
  }
  return g;
}

// The dots of key jj's slice h with every query vector: from the lane's registers kt
// (DIRECT, pass kk) or the staged tile.
fn slice_dots(jj: u32, h: u32, kk: u32, kt: array<KUnit, K_REGS>) -> array<f32, VECTORS> {
  var sc: array<f32, VECTORS>;
  for (var r = 0u; r < VECTORS; r++) {
    sc[r] = 0.0;
  }
  if (DIRECT == 1u) {
    for (var g = 0u; g < SLICE_UNITS; g++) {
      let gi = h + SLICES * g;
      if (gi < QK_UNITS) {
        let ku = kt[kk * SLICE_UNITS + g];
        var t: array<f32, VECTORS>;
        for (var r = 0u; r < VECTORS; r++) {
          t[r] = 0.0;
        }
        for (var s = 0u; s < UNIT_VEC4S; s++) {
          let kc = ku_part(ku.x, s);
          for (var r = 0u; r < VECTORS; r++) {
            if (Q_IN_REGS == 1u) {
              t[r] += dot(q_r[(g * UNIT_VEC4S + s) * VECTORS + r], kc);
            } else {
              t[r] += dot(q_s[r * Q_STRIDE + gi * UNIT_VEC4S + s], kc);
            }
          }
        }
        for (var r = 0u; r < VECTORS; r++) {
          sc[r] += t[r] * scale_of_k(ku.s);
        }
      }
    }
    return sc;
  }
  for (var cc = 0u; cc < SLICE_VEC4S; cc++) {
    let c = min(h * SLICE_VEC4S + cc, QK_VEC4S - 1u);
    let kc = select(vec4<f32>(0.0), ts_f32(k_s[jj * K_STRIDE + c]),
                    h * SLICE_VEC4S + cc < QK_VEC4S);
    for (var r = 0u; r < VECTORS; r++) {
      sc[r] += dot(q_s[r * Q_STRIDE + c], kc);
    }
  }
  return sc;
}

// p_s = the logits of the K tile (keys j0..: staged, or DIRECT in the lanes' registers kt)
// for every query vector; with_bias false: the tile's bias is known to be 0. Ends with p_s
// complete (a barrier).
fn tile_logits(w: Wg, j0: u32, with_bias: bool, plain: bool, lid: u32,
               kt: array<KUnit, K_REGS>) {
  // Lane (slice h, key jj): staged, consecutive lanes take consecutive keys (distinct banks);
  // DIRECT, consecutive lanes take a key's consecutive slices (its row's bytes together).
  var h = lid / min(KV_TILE, PASS_KEYS);
  var jl = lid % min(KV_TILE, PASS_KEYS);
  if (DIRECT == 1u) {
    h = lid % SLICES;
    jl = lid / SLICES;
  }
  // DIRECT with one lane a key writes p_s below, before any barrier of this tile, while other
  // lanes may still read the previous tile's weights there (pv_tile): wait for them. (With
  // SLICES > 1 the partial dots go to part_s, which nothing reads past the tile; staged, the
  // staging's barrier already separates them.)
  if (DIRECT == 1u && SLICES == 1u) {
    workgroupBarrier();
  }
  for (var kk = 0u; kk < PASSES; kk++) {
    let jj = jl + PASS_KEYS * kk;
    let sc = slice_dots(jj, h, kk, kt);
    for (var r = 0u; r < VECTORS; r++) {
      if (SLICES == 1u) {
        p_s[jj * VECTORS + r] = vec_logit(w, r, j0 + jj, sc[r], with_bias, plain);
      } else {
        part_s[(jj * VECTORS + r) * SLICES + h] = sc[r];
      }
    }
  }
  workgroupBarrier();
  if (SLICES > 1u) {
    for (var u = 0u; u < LANE_ELEMS; u++) {
      let e = lid + u * THREADS;
      if (e < KV_TILE * VECTORS) {
        var s = 0.0;
        for (var hh = 0u; hh < SLICES; hh++) {
          s += part_s[e * SLICES + hh];
        }
        p_s[e] = vec_logit(w, e % VECTORS, j0 + e / VECTORS, s, with_bias, plain);
      }
    }
    workgroupBarrier();
  }
}
