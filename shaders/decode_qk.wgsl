// decode_qk: the first kernel of the unfused split-KV decode (FlashInfer's two-kernel form):
// QK^T over one KV split, written out as scores [B, Nq, S, C] float32 (the logits after
// softcap, bias and alibi; MASKED where a key is invisible), and the split's softmax statistics
// per query row: m = max logit, l = sum exp(s - m) (m = MASKED, l = 0 when the split has no
// visible key). decode_pv normalises and multiplies by V. One workgroup = one (batch, kv head,
// split, tile of M_TILE query rows, chunk of GROUP_TILE query heads), like decode_partial: the
// VECTORS = GROUP_TILE*M_TILE query vectors read each K tile once from workgroup memory; SLICES
// lanes per key each take a slice of the head (partial dots meet in workgroup memory when
// SLICES > 1). Scores are written for the keys [klo, khi) of the split that the row tile can
// see; decode_pv reads only keys visible to each row. Prefix constants: M_TILE, GROUP_TILE,
// KV_TILE (keys per tile), THREADS (threads), PREFETCH.

const VECTORS: u32 = GROUP_TILE * M_TILE;
const SLICES: u32 = max(1u, THREADS / KV_TILE);         // QK lanes per key
const PASS_KEYS: u32 = THREADS / SLICES;                  // keys per QK pass
const PASSES: u32 = KV_TILE / min(KV_TILE, PASS_KEYS);        // QK passes per tile
const SLICE_VEC4S: u32 = (QK_VEC4S + SLICES - 1u) / SLICES;      // vec4 chunks per QK lane
const LANE_ELEMS: u32 = (KV_TILE * VECTORS + THREADS - 1u) / THREADS;  // (key, vector) elements per lane
const K_STRIDE: u32 = QK_VEC4S + 1u;                  // padded K row stride: lanes read distinct banks
const K_LOADS: u32 = (KV_TILE * QK_GRANULES + THREADS - 1u) / THREADS; // K granules each lane loads per tile

var<workgroup> q_s: array<vec4<f32>, VECTORS * QK_VEC4S>;    // scaled queries
var<workgroup> k_s: array<TS, KV_TILE * K_STRIDE>;
var<workgroup> p_s: array<f32, KV_TILE * VECTORS>;          // [key][vector] logits
var<workgroup> part_s: array<f32, KV_TILE * VECTORS * SLICES>;  // QK partial dots per head slice

struct Wg {
  b: u32,
  kvh: u32,
  hc: u32,
  i0: u32,
  seq: Seq,
  khi: u32,
}

// Row of query vector r in [B, Nq, S] order, or 0xffffffff when the vector is absent.
fn vec_row(w: Wg, r: u32) -> u32 {
  let gh = w.hc * GROUP_TILE + r / M_TILE;
  let i = w.i0 + r % M_TILE;
  if (gh < P.group_size && i < P.seq_len) {
    return (w.b * P.num_heads + w.kvh * P.group_size + gh) * P.seq_len + i;
  }
  return 0xffffffffu;
}

// Logit of query vector r against key j, or MASKED if j is invisible to it.
fn vec_logit(w: Wg, r: u32, j: u32, dot_qk: f32) -> f32 {
  let gh = w.hc * GROUP_TILE + r / M_TILE;
  let i = w.i0 + r % M_TILE;
  let pos = row_pos(w.seq, i);
  if (gh < P.group_size && i < P.seq_len && j < w.khi && key_visible(i32(j), pos, w.seq)) {
    return logit(dot_qk, w.b, w.kvh * P.group_size + gh, i, j, pos);
  }
  return MASKED;
}

// One granule of the register tile into workgroup memory: by value, never the register
// tile, for the reason given at decode_partial's stage_kv.
fn stage_k(idx: u32, kg: GV) {
  if (idx < KV_TILE * QK_GRANULES) {
    let at = tile_at(idx, K_STRIDE, QK_GRANULES);
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      k_s[at + s] = ts_part(kg, s);
    }
  }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M_TILE, GROUP_TILE);
  if (!d.ok) {
    return;
  }
  let w = Wg(d.b, d.kvh, d.hc, d.i0, d.seq, d.khi);

  // Query vector r is head hc*GROUP_TILE + r/M_TILE of the group, row i0 + r%M_TILE; absent ones
  // load zeros.
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
    if (gh < P.group_size && i < d.seq.rows) {     // padding rows' q is never read
      gv = load_q(q_granule(d.b, d.kvh * P.group_size + gh, i) + g);
    }
    for (var s = 0u; s < GRANULE_VEC4S; s++) {
      q_s[r * QK_VEC4S + g * GRANULE_VEC4S + s] = vec4<f32>(g_part(gv, s)) * P.scale;
    }
  }
  workgroupBarrier();

  // Running statistics of vector lid (lanes lid < VECTORS), in private memory.
  var m_run = MASKED;
  var l_run = 0.0;

  // Tile loop, software-pipelined as in decode_partial (PREFETCH=1: store tile it-1, load
  // tile it, compute tile it-1).
  let n_tiles = select(0u, cdiv(d.khi - d.klo, KV_TILE), d.khi > d.klo);
  var kr: array<GV, K_LOADS>;
  for (var it = 0u; it < n_tiles + PREFETCH; it++) {
    if (PREFETCH == 1u && it > 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      workgroupBarrier();
    }
    let jf = d.klo + it * KV_TILE;
    for (var u = 0u; u < K_LOADS; u++) {
      let idx = lid + u * THREADS;
      kr[u] = GV();
      // only this split's keys, never past the valid length (nor before kv_start: klo)
      if (idx < KV_TILE * QK_GRANULES && jf + idx / QK_GRANULES < d.khi) {
        kr[u] = load_k(kv_granule(d.b, d.kvh, jf + idx / QK_GRANULES) + idx % QK_GRANULES);
      }
    }
    if (PREFETCH == 0u) {
      workgroupBarrier();   // the previous tile's readers are done with k_s/p_s
      for (var u = 0u; u < K_LOADS; u++) {
        stage_k(lid + u * THREADS, kr[u]);
      }
      workgroupBarrier();
    }
    if (it < PREFETCH) {
      continue;
    }
    let j0 = d.klo + (it - PREFETCH) * KV_TILE;

    // QK: lane (slice h, key jj); consecutive lanes take consecutive keys (distinct banks).
    let h = lid / min(KV_TILE, PASS_KEYS);
    for (var kk = 0u; kk < PASSES; kk++) {
      let jj = lid % min(KV_TILE, PASS_KEYS) + PASS_KEYS * kk;
      var sc: array<f32, VECTORS>;
      for (var r = 0u; r < VECTORS; r++) {
        sc[r] = 0.0;
      }
      for (var cc = 0u; cc < SLICE_VEC4S; cc++) {
        let c = min(h * SLICE_VEC4S + cc, QK_VEC4S - 1u);
        let kc = select(vec4<f32>(0.0), ts_f32(k_s[jj * K_STRIDE + c]), h * SLICE_VEC4S + cc < QK_VEC4S);
        for (var r = 0u; r < VECTORS; r++) {
          sc[r] += dot(q_s[r * QK_VEC4S + c], kc);
        }
      }
      for (var r = 0u; r < VECTORS; r++) {
        if (SLICES == 1u) {
          p_s[jj * VECTORS + r] = vec_logit(w, r, j0 + jj, sc[r]);
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
          p_s[e] = vec_logit(w, e % VECTORS, j0 + e / VECTORS, s);
        }
      }
      workgroupBarrier();
    }

    // Scores out, one lane per (key, vector) of the tile's keys below khi.
    for (var u = 0u; u < LANE_ELEMS; u++) {
      let e = lid + u * THREADS;
      if (e < KV_TILE * VECTORS) {
        let row = vec_row(w, e % VECTORS);
        let j = j0 + e / VECTORS;
        if (row != 0xffffffffu && j < d.khi) {
          scores[row * P.capacity + j] = p_s[e];
        }
      }
    }
    // Statistics, one lane per query vector (online: rescale the sum to the new maximum).
    if (lid < VECTORS) {
      var mx = MASKED;
      for (var jj = 0u; jj < KV_TILE; jj++) {
        mx = max(mx, p_s[jj * VECTORS + lid]);
      }
      let m_new = max(m_run, mx);
      // Nothing visible yet: subtract 0 so that exp(MASKED - 0) == 0 keeps the sum at 0.
      let m_use = select(m_new, 0.0, m_new <= MASKED);
      var lsum = l_run * exp(m_run - m_use);
      for (var jj = 0u; jj < KV_TILE; jj++) {
        lsum += weight_of(p_s[jj * VECTORS + lid], m_use);
      }
      m_run = m_new;
      l_run = lsum;
    }
  }

  if (lid < VECTORS) {
    let row = vec_row(w, lid);
    if (row != 0xffffffffu) {
      stats[row * P.n_splits + d.t] = vec2<f32>(m_run, l_run);
    }
  }
}
