// PV lane helpers shared by the two decode families that stage V as v_s [KV_TILE keys x
// V_VEC4S] and split the head across PV_LANES lanes of LANE_COLS vec4 columns
// (decode_partial, decode_pv); each declares those names itself.

// The PV lane cl's columns (cl, cl+PV_LANES, ...) of the value of tile key jj.
fn tile_values(jj: u32, cl: u32) -> array<vec4<f32>, LANE_COLS> {
  var vv: array<vec4<f32>, LANE_COLS>;
  for (var u = 0u; u < LANE_COLS; u++) {
    let c = cl + PV_LANES * u;
    vv[u] = select(vec4<f32>(0.0), ts_f32(v_s[jj * V_VEC4S + min(c, V_VEC4S - 1u)]), c < V_VEC4S);
  }
  return vv;
}
