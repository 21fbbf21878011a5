// flash_prefill: one workgroup owns BR query rows of one head and streams the keys in tiles
// of BC with an online softmax (FlashAttention-2 order: S = QK^T tile, row max, P = exp,
// O += PV). Threads form BR/TR row groups of NCG lanes: a lane owns TR rows and the columns
// tx, tx+NCG, ... of the S tile (so its K reads fall in different banks), and the O columns
// tx, tx+NCG, ... (vec4s). Row maxima are combined over the NCG lanes of a row group:
// lane_max() (subgroup shuffles over SGW lanes in the subgroup variant, identity otherwise),
// then workgroup memory for the NCG/SGW groups left.
// Prefix constants: BR, BC, TR, NCG, SGW, PREFETCH; functions lane_max, lane_sum.

const TC: u32 = BC / NCG;                 // S columns per lane
const WG: u32 = (BR / TR) * NCG;
const OC: u32 = (HV + NCG - 1u) / NCG;    // O vec4 columns per lane
const KS: u32 = HV + 1u;                  // padded K row stride: lanes read distinct banks
const NG: u32 = NCG / SGW;                // lane groups left after the shuffles
const NLD: u32 = (BC * HG + WG - 1u) / WG; // K (and V) granules each lane loads per tile

@group(0) @binding(7) var<storage, read_write> out: array<vec4<T>>;
@group(0) @binding(8) var<storage, read_write> lse: array<f32>;

var<workgroup> q_s: array<vec4<f32>, BR * HV>;
var<workgroup> k_s: array<vec4<T>, BC * KS>;
var<workgroup> v_s: array<vec4<T>, BC * HV>;
var<workgroup> p_s: array<f32, BR * BC>;
var<workgroup> red_s: array<f32, BR * NG>;


// Combine one value per row over the NCG lanes of a row group (max or sum). Called in
// uniform control flow by every invocation (it holds a barrier when NG > 1).
fn rows_reduce(x: array<f32, TR>, ty: u32, tx: u32, is_max: bool) -> array<f32, TR> {
  var r = x;
  for (var a = 0u; a < TR; a++) {
    if (is_max) {
      r[a] = lane_max(r[a]);
    } else {
      r[a] = lane_sum(r[a]);
    }
  }
  if (NG > 1u) {
    if (tx % SGW == 0u) {
      for (var a = 0u; a < TR; a++) {
        red_s[(ty * TR + a) * NG + tx / SGW] = r[a];
      }
    }
    workgroupBarrier();
    for (var a = 0u; a < TR; a++) {
      var acc = red_s[(ty * TR + a) * NG];
      for (var g = 1u; g < NG; g++) {
        let y = red_s[(ty * TR + a) * NG + g];
        acc = select(acc + y, max(acc, y), is_max);
      }
      r[a] = acc;
    }
    workgroupBarrier();
  }
  return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  // Grids past 65535 workgroups are folded into y/z; unfold to one linear id.
  let n_rt = cdiv(P.seq_len, BR);
  let lin = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
  if (lin >= n_rt * P.num_heads * P.batch) {
    return;
  }
  // Row tiles run last-first: under causal masking the late tiles have the most keys.
  let rt = n_rt - 1u - lin % n_rt;
  let h = (lin / n_rt) % P.num_heads;
  let b = lin / (n_rt * P.num_heads);
  let kvh = h / P.group_size;
  let len = valid_len(b);
  let ty = lid / NCG;
  let tx = lid % NCG;
  let i0 = rt * BR;
  let span = key_span(len, i0, min(i0 + BR, P.seq_len) - 1u);

  for (var u = 0u; u < (BR * HG + WG - 1u) / WG; u++) {
    let idx = lid + u * WG;
    if (idx >= BR * HG) {
      break;
    }
    let r = idx / HG;
    let g = idx % HG;
    var gv = GV();
    if (i0 + r < P.seq_len) {
      gv = q[q_granule(b, h, i0 + r) + g];
    }
    for (var s = 0u; s < GS; s++) {
      q_s[r * HV + g * GS + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }

  var m: array<f32, TR>;
  var l: array<f32, TR>;
  var o: array<array<vec4<f32>, OC>, TR>;
  for (var a = 0u; a < TR; a++) {
    m[a] = MASKED;
    l[a] = 0.0;
    for (var c = 0u; c < OC; c++) {
      o[a][c] = vec4<f32>(0.0);
    }
  }

  let j_begin = u32(span.x) / BC * BC;
  // Tile loop. With PREFETCH=1 it is software-pipelined: iteration it stores tile it-1
  // (already in registers) to workgroup memory, issues the loads of tile it, then computes
  // tile it-1, so the loads fly during the compute. PREFETCH=0: load, store, compute tile it.
  // The loads have a constant trip count (the compiler unrolls them and issues all before
  // the first use) and sit in main: a helper taking the register tile by pointer made a
  // driver keep it in local memory.
  let n_tiles = select(0u, cdiv(u32(span.y) - j_begin, BC), u32(span.y) > j_begin);
  var kr: array<GV, NLD>;
  var vr: array<GV, NLD>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
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
    }
    let jf = j_begin + it * BC;
    for (var u = 0u; u < NLD; u++) {
      let idx = lid + u * WG;
      let jj = idx / HG;
      kr[u] = GV();
      vr[u] = GV();
      if (idx < BC * HG && jf < u32(span.y) && jf + jj < len) {   // never past the valid length
        let at = kv_granule(b, kvh, jf + jj) + idx % HG;
        kr[u] = k[at];
        vr[u] = v[at];
      }
    }
    if (PREFETCH == 0u) {
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
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = j_begin + (it - PREFETCH) * BC;

    var sc: array<array<f32, TC>, TR>;
    for (var a = 0u; a < TR; a++) {
      for (var e = 0u; e < TC; e++) {
        sc[a][e] = 0.0;
      }
    }
    for (var c = 0u; c < HV; c++) {
      var kc: array<vec4<f32>, TC>;
      for (var e = 0u; e < TC; e++) {
        kc[e] = vec4<f32>(k_s[(tx + NCG * e) * KS + c]);
      }
      for (var a = 0u; a < TR; a++) {
        let qa = q_s[(ty * TR + a) * HV + c];
        for (var e = 0u; e < TC; e++) {
          sc[a][e] += dot(qa, kc[e]);
        }
      }
    }

    var mx: array<f32, TR>;
    for (var a = 0u; a < TR; a++) {
      let i = i0 + ty * TR + a;
      let pos = row_pos(len, i);
      var best = MASKED;
      for (var e = 0u; e < TC; e++) {
        let j = j0 + tx + NCG * e;
        var x = MASKED;
        if (i < P.seq_len && key_visible(i32(j), pos, len)) {
          x = logit(sc[a][e], b, h, i, j, pos);
        }
        sc[a][e] = x;
        best = max(best, x);
      }
      mx[a] = best;
    }
    mx = rows_reduce(mx, ty, tx, true);

    for (var a = 0u; a < TR; a++) {
      let m_new = max(m[a], mx[a]);
      // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps p and alpha at 0.
      let m_use = select(m_new, 0.0, m_new <= MASKED);
      let alpha = exp(m[a] - m_use);
      m[a] = m_new;
      var psum = 0.0;
      for (var e = 0u; e < TC; e++) {
        let p = exp(sc[a][e] - m_use);
        psum += p;
        p_s[(ty * TR + a) * BC + tx + NCG * e] = p;
      }
      l[a] = l[a] * alpha + psum;
      for (var c = 0u; c < OC; c++) {
        o[a][c] *= alpha;
      }
    }
    workgroupBarrier();

    for (var jj = 0u; jj < BC; jj++) {
      var vv: array<vec4<f32>, OC>;
      for (var c = 0u; c < OC; c++) {
        let col = tx + NCG * c;
        vv[c] = vec4<f32>(0.0);
        if (col < HV) {
          vv[c] = vec4<f32>(v_s[jj * HV + col]);
        }
      }
      for (var a = 0u; a < TR; a++) {
        let p = p_s[(ty * TR + a) * BC + jj];
        for (var c = 0u; c < OC; c++) {
          o[a][c] += p * vv[c];
        }
      }
    }
  }

  // Each lane summed only its own columns: the row sum is the sum over the row group.
  l = rows_reduce(l, ty, tx, false);
  for (var a = 0u; a < TR; a++) {
    let i = i0 + ty * TR + a;
    if (i < P.seq_len) {
      let fin = finish_row(m[a], l[a], sink_logit(h));
      let base = (b * P.q_sb + h * P.q_sh + i * P.q_ss) / 4u;
      for (var c = 0u; c < OC; c++) {
        let col = tx + NCG * c;
        if (col < HV) {
          out[base + col] = vec4<T>(o[a][c] * fin.x);
        }
      }
      if (P.return_lse != 0u && tx == 0u) {
        lse[(b * P.num_heads + h) * P.seq_len + i] = fin.y;
      }
    }
  }
}
