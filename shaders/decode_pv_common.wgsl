// The PV side that decode_partial and decode_pv share: V tiles staged in v_s [KV_TILE keys x
// V_VEC4S], and O += P V by STREAMS streams x PV_LANES lanes: a lane owns LANE_COLS vec4
// columns of the output for all VECTORS query vectors (its Lanes) and a stream takes every
// STREAMS-th key of a tile; the streams share the running maximum, so their sums simply add
// up at the end (merge_streams), in workgroup memory the family names through its hooks:
//   merge_o(r, c, x, first) / merge_l(r, x, first): add (or, first, store) vector r's
//     column c of o / its sum;
//   merged_o(r, c) / merged_stats(r): them read back, with the (max, sum) of vector r.
// SUMS 1 (decode_partial): the lanes also sum the weights (l); decode_pv has its sums.
// DIRECT 1 (decode_partial, kv_staging "direct"): no v_s; a lane's unit is a whole V load
// unit (kv_units.wgsl's VU, PV_UNIT vec4 columns: vu_col), loaded by the lane itself into
// registers (v_reg: V_REGS units a tile, a key's units by consecutive lanes); its scale
// multiplies the weight.

const PV_UNIT: u32 = 1u + DIRECT * (VUNIT_VEC4S - 1u);          // vec4 columns a lane unit
const PV_UNITS: u32 = V_VEC4S / PV_UNIT;                        // units across v's head
const PV_LANES: u32 = min(THREADS, PV_UNITS);                   // PV lanes across v's head
const STREAMS: u32 = THREADS / PV_LANES;                        // PV streams
const LANE_UNITS: u32 = (PV_UNITS + PV_LANES - 1u) / PV_LANES;  // units per PV lane
const LANE_COLS: u32 = LANE_UNITS * PV_UNIT;                    // vec4 columns per PV lane
const V_LOADS: u32 = (KV_TILE * V_GRANULES + THREADS - 1u) / THREADS;   // V granules per lane
const STREAM_KEYS: u32 = (KV_TILE + STREAMS - 1u) / STREAMS;    // keys of a tile per stream
const V_REGS: u32 = 1u + DIRECT * (STREAM_KEYS * LANE_UNITS - 1u);  // DIRECT: V granules a lane

var<workgroup> v_s: array<TS, 1u + (1u - DIRECT) * (KV_TILE * V_VEC4S - 1u)>;

// A V unit in a lane's registers, with its scale as loaded (kv_units.wgsl's vu_scale_v; 1
// where the loads dequantized).
struct VUnit {
  x: VU,
  s: vec2<u32>,
}

// The output's vec4 column of lane cl's column u.
fn lane_col(cl: u32, u: u32) -> u32 {
  if (DIRECT == 1u) {
    return vu_col(cl + PV_LANES * (u / PV_UNIT), u % PV_UNIT);
  }
  return cl + PV_LANES * u;
}

// DIRECT: unit u of lane (st, cl)'s V registers for the tile of keys jf.. (its stream's key
// u / LANE_UNITS, unit u % LANE_UNITS): zeros unless live and the key lies in [lo, hi).
fn v_reg(u: u32, st: u32, cl: u32, b: u32, kvh: u32, jf: u32, lo: u32, hi: u32, live: bool
         ) -> VUnit {
  let jj = st + STREAMS * (u / LANE_UNITS);
  let gi = cl + PV_LANES * (u % LANE_UNITS);
  var g = VUnit();
  if (live && st < STREAMS && jj < KV_TILE && gi < PV_UNITS && jf + jj >= lo && jf + jj < hi) {
    let e = v_row_at(b, kvh, jf + jj);
    g = VUnit(vu_v(e, gi), vu_scale_v(e, gi));
  }
  return g;
}

// A PV lane's accumulators: its columns of every vector's o and (SUMS 1) its part of every
// vector's sum of weights.
struct Lanes {
  o: array<array<vec4<f32>, LANE_COLS>, VECTORS>,
  l: array<f32, VECTORS>,
}

// One granule of the register tile into workgroup memory (see decode_qk_common's stage_k).
fn stage_v(idx: u32, vr: RG) {
  if (idx < KV_TILE * V_GRANULES) {
    let vg = granule_of(vr);
    let vs = tile_at(idx, V_VEC4S, V_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      v_s[vs + s] = ts_part(vg, s);
    }
  }
}

// The PV lane cl's columns (lane_col) of the value of tile key jj, its n-th of the stream,
// unscaled: from the lane's registers vt (DIRECT) or the staged tile.
fn tile_values(jj: u32, n: u32, cl: u32, vt: array<VUnit, V_REGS>) -> array<vec4<f32>, LANE_COLS> {
  var vv: array<vec4<f32>, LANE_COLS>;
  for (var u = 0u; u < LANE_COLS; u++) {
    let c = lane_col(cl, u);
    if (DIRECT == 1u) {
      vv[u] = vu_part(vt[n * LANE_UNITS + u / PV_UNIT].x, u % PV_UNIT);
    } else {
      vv[u] = select(vec4<f32>(0.0), ts_f32(v_s[jj * V_VEC4S + min(c, V_VEC4S - 1u)]),
                     c < V_VEC4S);
    }
  }
  return vv;
}

// The scale of the unit of the lane's column u of its stream's n-th key (1 when staged).
fn col_scale(n: u32, u: u32, vt: array<VUnit, V_REGS>) -> f32 {
  return select(1.0, scale_of_v(vt[min(n * LANE_UNITS + u / PV_UNIT, V_REGS - 1u)].s),
                DIRECT == 1u);
}

// Whether the tile of keys j0.. lies, as far as its keys are loaded ([klo, khi)), in what
// every row of the row tile sees: then PV adds every key's weight unmasked. A tile on the
// causal diagonal or the window's edge adds only the keys each row sees (their weights of 0
// must not meet the others' values). M_TILE == 1: the rows share one position, so no tile
// has an edge (the test folds away).
fn tile_full(d: DecodeWg, j0: u32, klo: u32, khi: u32) -> bool {
  return M_TILE == 1u || all_see(j0, j0 + KV_TILE, vec2<i32>(i32(klo), i32(khi)), d.seen_all);
}

// acc plus stream st's keys of the staged tile (keys j0..) times their weights p_s, on the
// lane's columns cl, cl+PV_LANES, ...; full: every key for every vector (tile_full), else
// each vector only the keys its row sees. Both calls pass full as a literal, so each inlined
// call is the loop it needs: a branch per (key, vector) only on edge tiles.
fn pv_keys(acc: Lanes, st: u32, cl: u32, j0: u32, full: bool, d: DecodeWg,
           vt: array<VUnit, V_REGS>) -> Lanes {
  var a = acc;
  for (var n = 0u; n < STREAM_KEYS; n++) {
    let jj = st + STREAMS * n;
    if (jj < KV_TILE) {
      let vv = tile_values(jj, n, cl, vt);
      for (var r = 0u; r < VECTORS; r++) {
        let p = p_s[jj * VECTORS + r];
        if (SUMS == 1u) {
          a.l[r] += p;
        }
        if (full || key_visible(i32(j0 + jj), row_pos(d.seq, d.i0 + r % M_TILE), d.seq)) {
          for (var u = 0u; u < LANE_COLS; u++) {
            a.o[r][u] += (p * col_scale(n, u, vt)) * vv[u];
          }
        }
      }
    }
  }
  return a;
}

// The streams' accumulators added up through the family's merge_o / merge_l, one stream
// after the other (barriers between; called by every lane).
fn merge_streams(acc: Lanes, st: u32, cl: u32) {
  workgroupBarrier();
  for (var s = 0u; s < STREAMS; s++) {
    if (st == s) {
      for (var r = 0u; r < VECTORS; r++) {
        for (var u = 0u; u < LANE_COLS; u++) {
          let c = lane_col(cl, u);
          if (c < V_VEC4S) {
            merge_o(r, c, acc.o[r][u], s == 0u);
          }
        }
        if (SUMS == 1u && cl == 0u) {
          merge_l(r, acc.l[r], s == 0u);
        }
      }
    }
    workgroupBarrier();
  }
}

// The contract's partial state of split d.t for every present vector: o_t (the merged o over
// its sum) and lse_t, from the family's merged_o / merged_stats.
fn write_partials(d: DecodeWg, lid: u32) {
  for (var u = 0u; u < (VECTORS * V_VEC4S + THREADS - 1u) / THREADS; u++) {
    let e = lid + u * THREADS;
    if (e < VECTORS * V_VEC4S) {
      let r = e / V_VEC4S;
      let c = e % V_VEC4S;
      let gh = d.hc * GROUP_TILE + r / M_TILE;
      let i = d.i0 + r % M_TILE;
      if (gh < P.group_size && i < P.seq_len) {
        let ml = merged_stats(r);
        let fin = finish_row(ml.x, ml.y, MASKED);
        let row = ((d.b * P.num_heads + d.kvh * P.group_size + gh) * P.seq_len + i)
                  * P.n_splits + d.t;
        o_parts[row * V_VEC4S + c] = finite_or_nan4(merged_o(r, c) * fin.x);
        if (c == 0u) {
          lse_parts[row] = fin.y;
        }
      }
    }
  }
}
