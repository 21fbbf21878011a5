// decode_partial: fused QK^T + online softmax + PV over one KV split (flash decoding).
// One workgroup = one (batch, kv head, split, tile of M query rows, chunk of GT query heads):
// the R = GT*M query vectors that share this kv head read each K/V tile once, from
// workgroup memory. Writes the contract's partial state of the split: o_t normalised over
// the split's visible keys and lse_t (0 and -inf for a split with no visible key).
// Prefix constants: M, GT, BC (keys per tile), WG (threads).
// QK: KW lanes across the keys of a tile, NRG row groups across the query vectors.
// PV: TPROW lanes per query vector, each owning CPT vec4 columns; every lane keeps its row's
// softmax statistics itself (identical across the row's lanes), so no final merge is needed.

const R: u32 = GT * M;
const KW: u32 = min(BC, WG);
const KPT: u32 = BC / KW;                 // keys per lane in QK
const NRG: u32 = WG / KW;
const RPT: u32 = (R + NRG - 1u) / NRG;    // query vectors per lane in QK
const TPROW: u32 = max(1u, WG / R);
const CPT: u32 = (HV + TPROW - 1u) / TPROW;
const KS: u32 = HV + 1u;                  // padded K row stride: lanes read distinct banks
const NLD: u32 = (BC * HG + WG - 1u) / WG; // K (and V) granules each lane loads per tile

@group(0) @binding(7) var<storage, read_write> o_parts: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> lse_parts: array<f32>;

var<workgroup> q_s: array<vec4<f32>, R * HV>;
var<workgroup> k_s: array<vec4<T>, BC * KS>;
var<workgroup> v_s: array<vec4<T>, BC * HV>;
var<workgroup> p_s: array<f32, R * BC>;

// Loads tile [j0, j0+BC) of this split into registers. The constant trip count lets the
// compiler unroll and issue every load before the first use; a loop starting at the lane
// id does not unroll, and then each lane waits for memory once per granule.
fn fetch(kr: ptr<function, array<GV, NLD>>, vr: ptr<function, array<GV, NLD>>,
         lid: u32, b: u32, kvh: u32, j0: u32, khi: u32) {
  for (var u = 0u; u < NLD; u++) {
    let idx = lid + u * WG;
    let jj = idx / HG;
    if (idx < BC * HG && j0 + jj < khi) {   // only this split's keys, never past the valid length
      let at = kv_granule(b, kvh, j0 + jj) + idx % HG;
      (*kr)[u] = k[at];
      (*vr)[u] = v[at];
    } else {
      (*kr)[u] = GV();
      (*vr)[u] = GV();
    }
  }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let n_rt = cdiv(P.seq_len, M);
  let n_hc = cdiv(P.group_size, GT);
  let lin = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
  if (lin >= P.n_splits * n_rt * n_hc * P.kv_num_heads * P.batch) {
    return;
  }
  let t = lin % P.n_splits;
  var rest = lin / P.n_splits;
  let rt = rest % n_rt;
  rest = rest / n_rt;
  let hc = rest % n_hc;
  rest = rest / n_hc;
  let kvh = rest % P.kv_num_heads;
  let b = rest / P.kv_num_heads;
  let len = valid_len(b);
  let i0 = rt * M;

  let span = key_span(len, i0, min(i0 + M, P.seq_len) - 1u);
  let split_lo = t * P.split_size;
  let klo = max(split_lo, u32(span.x));
  let khi = min(min(split_lo + P.split_size, P.capacity), u32(span.y));

  // Query vector r is head hc*GT + r/M of the group, row i0 + r%M; absent ones load zeros.
  for (var u = 0u; u < (R * HG + WG - 1u) / WG; u++) {
    let idx = lid + u * WG;
    if (idx >= R * HG) {
      break;
    }
    let r = idx / HG;
    let g = idx % HG;
    let gh = hc * GT + r / M;
    let i = i0 + r % M;
    var gv = GV();
    if (gh < P.group_size && i < P.seq_len) {
      gv = q[q_granule(b, kvh * P.group_size + gh, i) + g];
    }
    for (var s = 0u; s < GS; s++) {
      q_s[r * HV + g * GS + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }

  let pr = min(lid / TPROW, R - 1u);      // PV role: query vector and column lane
  let sub = lid % TPROW;
  var m = MASKED;
  var l = 0.0;
  var o: array<vec4<f32>, CPT>;
  for (var c = 0u; c < CPT; c++) {
    o[c] = vec4<f32>(0.0);
  }

  // Software pipelining: the next tile's loads are in flight while this one is computed.
  var kr: array<GV, NLD>;
  var vr: array<GV, NLD>;
  fetch(&kr, &vr, lid, b, kvh, klo, khi);
  for (var j0 = klo; j0 < khi; j0 += BC) {
    workgroupBarrier();   // the previous tile's readers are done with k_s/v_s/p_s
    for (var u = 0u; u < NLD; u++) {
      let idx = lid + u * WG;
      if (idx < BC * HG) {
        let jj = idx / HG;
        let g = idx % HG;
        for (var s = 0u; s < GS; s++) {
          k_s[jj * KS + g * GS + s] = g_part(kr[u], s);
          v_s[jj * HV + g * GS + s] = g_part(vr[u], s);
        }
      }
    }
    workgroupBarrier();
    if (j0 + BC < khi) {
      fetch(&kr, &vr, lid, b, kvh, j0 + BC, khi);
    }

    let rg = lid / KW;
    for (var kk = 0u; kk < KPT; kk++) {
      let jj = lid % KW + KW * kk;
      var sc: array<f32, RPT>;
      for (var u = 0u; u < RPT; u++) {
        sc[u] = 0.0;
      }
      for (var c = 0u; c < HV; c++) {
        let kc = vec4<f32>(k_s[jj * KS + c]);
        for (var u = 0u; u < RPT; u++) {
          let r = min(rg + NRG * u, R - 1u);
          sc[u] += dot(q_s[r * HV + c], kc);
        }
      }
      let j = j0 + jj;
      for (var u = 0u; u < RPT; u++) {
        let r = rg + NRG * u;
        if (r < R) {
          let gh = hc * GT + r / M;
          let i = i0 + r % M;
          let pos = row_pos(len, i);
          var x = MASKED;
          if (gh < P.group_size && i < P.seq_len && j < khi && key_visible(i32(j), pos, len)) {
            x = logit(sc[u], b, kvh * P.group_size + gh, i, j, pos);
          }
          p_s[r * BC + jj] = x;
        }
      }
    }
    workgroupBarrier();

    var mx = MASKED;
    for (var jj = 0u; jj < BC; jj++) {
      mx = max(mx, p_s[pr * BC + jj]);
    }
    let m_new = max(m, mx);
    // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
    let m_use = select(m_new, 0.0, m_new <= MASKED);
    let alpha = exp(m - m_use);
    m = m_new;
    l = l * alpha;
    for (var c = 0u; c < CPT; c++) {
      o[c] *= alpha;
    }
    for (var jj = 0u; jj < BC; jj++) {
      let p = exp(p_s[pr * BC + jj] - m_use);
      l += p;
      for (var c = 0u; c < CPT; c++) {
        let col = min(sub + TPROW * c, HV - 1u);
        o[c] += p * vec4<f32>(v_s[jj * HV + col]);
      }
    }
  }

  let gh = hc * GT + pr / M;
  let i = i0 + pr % M;
  if (lid < R * TPROW && gh < P.group_size && i < P.seq_len) {
    let fin = finish_row(m, l, MASKED);
    let row = ((b * P.num_heads + kvh * P.group_size + gh) * P.seq_len + i) * P.n_splits + t;
    for (var c = 0u; c < CPT; c++) {
      let col = sub + TPROW * c;
      if (col < HV) {
        o_parts[row * HV + col] = o[c] * fin.x;
      }
    }
    if (sub == 0u) {
      lse_parts[row] = fin.y;
    }
  }
}
