// reduce: merges the split-KV partial states (and the head sink) of one query row into out
// (q layout, spec dtype) and lse:  M = max_t lse_t (and sink), w_t = exp(lse_t - M),
// out = sum_t w_t o_t / (sum_t w_t + exp(sink - M)).
// One workgroup per row; NSG groups of HV lanes take every NSG-th split, then their sums meet
// in workgroup memory. Prefix constants: WG. Partials may come from any backend: a split
// with lse_t = -inf contributes nothing, whatever its o_t holds.

const NSG: u32 = max(1u, WG / HV);
const MASKED: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> o_parts: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> lse_parts: array<f32>;
@group(0) @binding(3) var<storage, read> sink: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<T>>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;

var<workgroup> acc_s: array<vec4<f32>, NSG * HV>;
var<workgroup> den_s: array<f32, NSG>;

@compute @workgroup_size(WG)
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
  if (P.has_sink != 0u) {
    sink_l = max(sink[h], MASKED);
  }
  var mx = sink_l;
  for (var t = 0u; t < nt; t++) {
    mx = max(mx, max(lse_parts[row * nt + t], MASKED));
  }
  let m_use = select(mx, 0.0, mx <= MASKED);

  let col = lid % HV;
  let grp = lid / HV;
  var acc = vec4<f32>(0.0);
  var den = 0.0;
  if (grp < NSG) {
    for (var t = grp; t < nt; t += NSG) {
      let lt = max(lse_parts[row * nt + t], MASKED);
      if (lt > MASKED) {
        let w = exp(lt - m_use);
        den += w;
        acc += w * o_parts[(row * nt + t) * HV + col];
      }
    }
    acc_s[grp * HV + col] = acc;
    if (col == 0u) {
      den_s[grp] = den;
    }
  }
  workgroupBarrier();
  if (lid < HV) {
    var a = vec4<f32>(0.0);
    var d = exp(sink_l - m_use);     // 0 without a sink: exp(MASKED - m) underflows
    for (var g = 0u; g < NSG; g++) {
      a += acc_s[g * HV + lid];
      d += den_s[g];
    }
    var res = vec4<f32>(0.0);
    var lse_v = bitcast<f32>(0xff800000u);
    if (mx > MASKED) {
      res = a / d;
      lse_v = m_use + log(d);
    }
    out[(b * P.q_sb + h * P.q_sh + i * P.q_ss) / 4u + lid] = vec4<T>(res);
    if (P.return_lse != 0u && lid == 0u) {
      lse[row] = lse_v;
    }
  }
}
