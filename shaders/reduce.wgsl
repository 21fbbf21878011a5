// reduce: merges the split-KV partial states (and the head sink) of one query row into out
// (q layout, spec dtype) and lse:  M = max_t lse_t (and sink), w_t = exp(lse_t - M),
// out = sum_t w_t o_t / (sum_t w_t + exp(sink - M)).
// One workgroup per row. The splits' lse are read in parallel (one lane per split) and their
// weights kept in workgroup memory; then GROUPS groups of V_VEC4S lanes (a partial state's vec4s:
// v_head_size / 4) each sum every GROUPS-th split,
// four independent loads at a time (a loop of dependent loads would wait on memory once per
// split), and the groups meet in workgroup memory. Prefix constants: THREADS.
// Partials may come from any backend: a split with lse_t = -inf contributes nothing,
// whatever its o_t holds; every other split's o_t is multiplied by its weight, 0 included,
// so a NaN in it reaches out (NaN, as an inf does); a NaN or +inf lse_t makes the row NaN.
// NaN is tested with bit tests (see attn_common.wgsl: WGSL may assume no NaN).
// Padding rows (i >= seqlens_q[b], where q_rows reads it) take no sink: their partial states
// are all empty, so they get out 0 and lse -inf.

const GROUPS: u32 = max(1u, THREADS / V_VEC4S);
const MASKED: f32 = -3.0e38;
const WEIGHT_CHUNK: u32 = 1024u;     // split weights held in workgroup memory per pass

var<workgroup> red_s: array<f32, THREADS>;
var<workgroup> w_s: array<f32, WEIGHT_CHUNK>;
var<workgroup> acc_s: array<vec4<f32>, GROUPS * V_VEC4S>;
var<workgroup> den_s: array<f32, GROUPS>;

const EMPTY: u32 = 0xbf800000u;   // the weight of an empty split: -1.0, tested by its bits

fn nan_f32() -> f32 {
  let bits = 0x7fc00000u;       // through a let: Tint rejects non-finite constants
  return bitcast<f32>(bits);
}

fn is_nan(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// Sum (is_max false) or max over the workgroup of one value per lane.
fn wg_reduce(x: f32, lid: u32, is_max: bool) -> f32 {
  red_s[lid] = x;
  workgroupBarrier();
  for (var step = THREADS / 2u; step > 0u; step = step / 2u) {
    if (lid < step) {
      let y = red_s[lid + step];
      red_s[lid] = select(red_s[lid] + y, max(red_s[lid], y), is_max);
    }
    workgroupBarrier();
  }
  let r = red_s[0];
  workgroupBarrier();
  return r;
}

// The weight of split t: -1 (EMPTY) for an empty split (its o_t is never used); NaN for a
// NaN or +inf lse_t.
fn weight(row: u32, t: u32, m_use: f32) -> f32 {
  let lt = lse_parts[row * P.n_splits + t];
  let u = bitcast<u32>(lt);
  let poison = u == 0x7f800000u || (u & 0x7fffffffu) > 0x7f800000u;
  return select(select(exp(lt - m_use), bitcast<f32>(EMPTY), lt <= MASKED), nan_f32(), poison);
}

// w * o, 0 for an empty split.
fn part(w: f32, o: vec4<f32>) -> vec4<f32> {
  return select(w * o, vec4<f32>(0.0), bitcast<u32>(w) == EMPTY);
}

fn den_of(w: f32) -> f32 {
  return select(w, 0.0, bitcast<u32>(w) == EMPTY);
}

// Lane lid's vec4 of out's row (batch b, head h, query row i; and, lane 0, its lse): the
// groups' sums (acc_s, den_s) merged with the sink's exp(sink_l - m_use); mx: the row's max
// lse_t (and sink).
fn write_row(row: u32, b: u32, h: u32, i: u32, mx: f32, m_use: f32, sink_l: f32, lid: u32) {
  var a = vec4<f32>(0.0);
  var d = exp(sink_l - m_use);     // 0 without a sink: exp(MASKED - m) underflows
  for (var g = 0u; g < GROUPS; g++) {
    a += acc_s[g * V_VEC4S + lid];
    d += den_s[g];
  }
  var res = vec4<f32>(0.0);
  let neg_inf_bits = 0xff800000u;      // not a folded constant: Tint rejects infinite ones
  var lse_v = bitcast<f32>(neg_inf_bits);
  if (is_nan(d)) {                     // a NaN or +inf lse_t (the max may have dropped it)
    res = vec4<f32>(nan_f32());
    lse_v = nan_f32();
  } else if (mx > MASKED) {
    res = a / d;
    lse_v = m_use + log(d);
  }
  // an inf in some o_t: NaN (as every writer of out)
  let e = bitcast<vec4<u32>>(res) & vec4<u32>(0x7f800000u);
  res = select(res, vec4<f32>(nan_f32()), e == vec4<u32>(0x7f800000u));
  // out has q's layout with rows of V_DIM elements (every q stride is a multiple of QK_DIM)
  let e0 = b * P.q_sb + h * P.q_sh + i * P.q_ss;
  var ob = e0 / 4u;
  if (V_DIM != QK_DIM) {
    ob = e0 / QK_DIM * V_DIM / 4u;
  }
  store_out(ob + lid, res);
  if (P.return_lse != 0u && lid == 0u) {
    lse[row] = lse_v;
  }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let rows = P.batch * P.num_heads * P.seq_len;
  let row = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
  if (row >= rows) {
    return;
  }
  let i = row % P.seq_len;
  let h = (row / P.seq_len) % P.num_heads;
  let b = row / (P.seq_len * P.num_heads);
  let nt = P.n_splits;

  var sink_l = MASKED;
  if (P.has_sink != 0u && i < q_rows(b)) {
    sink_l = max(sink[h], MASKED);
  }
  var mx = sink_l;
  for (var t = lid; t < nt; t += THREADS) {
    mx = max(mx, max(lse_parts[row * nt + t], MASKED));
  }
  mx = wg_reduce(mx, lid, true);
  let m_use = select(mx, 0.0, mx <= MASKED);

  let col = lid % V_VEC4S;
  let grp = lid / V_VEC4S;
  var acc = vec4<f32>(0.0);
  var den = 0.0;
  for (var t0 = 0u; t0 < nt; t0 += WEIGHT_CHUNK) {
    let n = min(WEIGHT_CHUNK, nt - t0);
    for (var t = lid; t < n; t += THREADS) {
      w_s[t] = weight(row, t0 + t, m_use);
    }
    workgroupBarrier();
    if (grp < GROUPS) {
      let base = row * nt + t0;
      var t = grp;
      for (; t + 3u * GROUPS < n; t += 4u * GROUPS) {
        let w0 = w_s[t];
        let w1 = w_s[t + GROUPS];
        let w2 = w_s[t + 2u * GROUPS];
        let w3 = w_s[t + 3u * GROUPS];
        let o0 = o_parts[(base + t) * V_VEC4S + col];
        let o1 = o_parts[(base + t + GROUPS) * V_VEC4S + col];
        let o2 = o_parts[(base + t + 2u * GROUPS) * V_VEC4S + col];
        let o3 = o_parts[(base + t + 3u * GROUPS) * V_VEC4S + col];
        acc += (part(w0, o0) + part(w1, o1)) + (part(w2, o2) + part(w3, o3));
        den += (den_of(w0) + den_of(w1)) + (den_of(w2) + den_of(w3));
      }
      for (; t < n; t += GROUPS) {
        let w = w_s[t];
        acc += part(w, o_parts[(base + t) * V_VEC4S + col]);
        den += den_of(w);
      }
    }
    workgroupBarrier();
  }
  if (grp < GROUPS) {
    acc_s[grp * V_VEC4S + col] = acc;
    if (col == 0u) {
      den_s[grp] = den;
    }
  }
  workgroupBarrier();
  if (lid < V_VEC4S) {
    write_row(row, b, h, i, mx, m_use, sink_l, lid);
  }
}
