// PV lane helpers shared by the two decode families that stage V as v_s [BC keys x VV]
// and split the head across PVW lanes of CPL vec4 columns (decode_partial, decode_pv); each
// declares those names itself.

// The PV lane cl's columns (cl, cl+PVW, ...) of the value of tile key jj.
fn tile_values(jj: u32, cl: u32) -> array<vec4<f32>, CPL> {
  var vv: array<vec4<f32>, CPL>;
  for (var u = 0u; u < CPL; u++) {
    let c = cl + PVW * u;
    vv[u] = select(vec4<f32>(0.0), ts_f32(v_s[jj * VV + min(c, VV - 1u)]), c < VV);
  }
  return vv;
}
