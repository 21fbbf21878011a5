// What the split-KV decode families (decode_partial, decode_qk, decode_pv) share. A
// workgroup (attn_common's decode_wg) holds the VECTORS = GROUP_TILE * M_TILE query vectors
// that share one kv head: vector r is head hc * GROUP_TILE + r / M_TILE of the GQA group and
// query row i0 + r % M_TILE; a vector past the group or past seq_len is absent. Keys come in
// tiles of KV_TILE; p_s holds a tile's value per (key, vector), [key][vector]. The entry
// point is here: each family's decode_body does the work of one workgroup.
// Prefix constants: M_TILE, GROUP_TILE, KV_TILE, THREADS, PREFETCH (decode_partial: BALANCE).

const VECTORS: u32 = GROUP_TILE * M_TILE;
// (key, vector) elements of a tile per lane
const LANE_ELEMS: u32 = (KV_TILE * VECTORS + THREADS - 1u) / THREADS;

var<workgroup> p_s: array<f32, KV_TILE * VECTORS>;

// A load unit (kv_units.wgsl's KU) in a lane's registers, with its scale as loaded
// (kv_units.wgsl's ku_scale_k; 1 where the loads dequantized): the direct decode_partial's
// register tiles (DIRECT 1).
struct KUnit {
  x: KU,
  s: vec2<u32>,
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let d = decode_wg(wid, nwg, M_TILE, GROUP_TILE);
  if (d.ok) {                           // past the end of the grid: nothing to do
    decode_body(d, lid);
  }
}
