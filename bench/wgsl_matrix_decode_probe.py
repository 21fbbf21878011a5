"""A feasibility probe for a subgroup-matrix split-KV decode on Dawn whose K and V operands are
loaded straight from the KV cache's storage buffers (no staging), one subgroup a workgroup.

Only the plain case: float16, BNSH, one query row, GQA group of G <= 16 heads packed as the
rows of one 16-row left matrix, no mask, L a multiple of the split. Per step of 16 * NT keys:
S = Q K^T (8 depth products per 16 keys, K^T loaded column-major from k), S through
workgroup memory to a scalar softmax (8 lanes a row, lazy reference max with a margin: O is
rescaled through a scratch tile only when a row's max grows past it), P as f16 to workgroup
memory, O += P V (V loaded row-major from v). Writes the contract's partial states; the host
merges them and checks the result against float64 attention.

What it answers: how fast the partial kernel alone runs against the scalar decode's, before any
of it is built into the library. On the H200 (ci/results/h200_wgsl_matrix_decode.txt): twice
the scalar partial kernel's time (L=32768 109 us b2b against ~54; Dawn's f16 matrix loads from
storage move 1.0-1.2 TB/s), so it was not built. --extras adds one workgroup variable: one of
4, 8 or 12 bytes made the products wrong, 16 or 32 did not (tests/backends/wgsl/
test_mma_layout.py keeps the library's matrix kernels to multiples of 16 bytes).

  python3 -m bench.wgsl_matrix_decode_probe [--lengths 8192,32768] [--splits 64,128,256]
      [--steps 1,2] [--modes direct,staged] [--margins 8,1e30] [--extras none,u32,u32x4]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import attnreg
from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import gemm_probe

from . import wgsl_probe_io

D = 128
MASKED = -3.0e38


def kernel(length: int, split: int, group: int, nt: int, scale: float, margin: float,
           mode: str = "direct", extra: str = "none") -> str:
    """The probe's WGSL (products unrolled as text: arrays of matrices spill). mode "direct":
    K and V matrices loaded from storage in the step; "staged": K's matrices loaded from
    storage a step ahead, V's rows loaded a step ahead as 16-byte words by every lane and
    stored to workgroup memory (v_s) after the scores' barrier, its matrices read there.
    extra: a workgroup variable declared after the others and used once (none, u32, u32x2,
    u32x3, u32x4, u32x8): whether its size moves the matrix arrays' placement (wrong
    products)."""
    ex_n = {"none": 0, "u32": 1, "u32x2": 2, "u32x3": 3, "u32x4": 4, "u32x8": 8}[extra]
    ex_decl = ([] if not ex_n else ["var<workgroup> extra_w: u32;"] if ex_n == 1 else
               [f"var<workgroup> extra_w: array<u32, {ex_n}u>;"])
    ex_at = "extra_w" if ex_n == 1 else "extra_w[0]"
    ex_set = [f"  if (lane == 0u) {{ {ex_at} = split; }}"] if ex_n else []
    ex_use = ([f"  if (lane == 0u && {ex_at} != split) {{ lse[kvh * G * NS + split] = 0.0; }}"]
              if ex_n else [])
    ns = length // split
    kw = 16 * nt
    staged = mode == "staged"
    kmat = [(t, d) for t in range(nt) for d in range(D // 16)]

    def kload(t: int, d: int, at: str) -> str:
        return (f"subgroupMatrixLoad<MR, col_major>(&k, kb + ({at} + {16 * t}u) * D + "
                f"{16 * d}u, D)")

    s_tiles = []
    for t in range(nt):
        s_tiles.append(f"    var s{t} = MA();")
        for d in range(D // 16):
            kop = f"k{t}_{d}" if staged else kload(t, d, "j0")
            s_tiles.append(f"    s{t} = subgroupMatrixMultiplyAccumulate(q{d}, {kop}, s{t});")
        s_tiles.append(f"    subgroupMatrixStore<row_major>(&s_s, {16 * t}u, s{t}, KW);")
    ahead, stage_v, pre = [], [], []
    vl = kw * D // 8 // 32        # 16-byte words of a V step per lane
    if staged:
        pre = [f"  var k{t}_{d} = {kload(t, d, 'split * SPLIT')};" for t, d in kmat]
        pre += [f"  var vr: array<vec4<u32>, {vl}u>;",
                f"  for (var u = 0u; u < {vl}u; u++) {{ vr[u] = vw[(kb + split * SPLIT * D) / 8u "
                "+ lane + 32u * u]; }"]
        ahead = ["    let more = j0 + KW < (split + 1u) * SPLIT;",
                 "    if (more) {"]
        ahead += [f"      k{t}_{d} = {kload(t, d, 'j0 + KW')};" for t, d in kmat]
        ahead += ["    }",
                  f"    var vn: array<vec4<u32>, {vl}u>;",
                  f"    for (var u = 0u; u < {vl}u; u++) {{",
                  "      if (more) { vn[u] = vw[(kb + (j0 + KW) * D) / 8u + lane + 32u * u]; }",
                  "    }"]
        stage_v = [f"    for (var u = 0u; u < {vl}u; u++) {{",
                   "      let e = (lane + 32u * u) * 8u;",
                   "      let w = vr[u];",
                   "      let h0 = bitcast<vec2<f16>>(w.x); let h1 = bitcast<vec2<f16>>(w.y);",
                   "      let h2 = bitcast<vec2<f16>>(w.z); let h3 = bitcast<vec2<f16>>(w.w);",
                   "      let r = e / D; let c = e % D;",
                   "      let a = r * VS + c;",
                   "      v_s[a] = h0.x; v_s[a + 1u] = h0.y; v_s[a + 2u] = h1.x; v_s[a + 3u] = h1.y;",
                   "      v_s[a + 4u] = h2.x; v_s[a + 5u] = h2.y; v_s[a + 6u] = h3.x; v_s[a + 7u] = h3.y;",
                   "    }"]
    pv = [f"    let p{t} = subgroupMatrixLoad<ML, row_major>(&p_s, {16 * t}u, KW);" for t in range(nt)]
    for c in range(D // 16):
        for t in range(nt):
            vop = (f"subgroupMatrixLoad<MR, row_major>(&v_s, {16 * t}u * VS + {16 * c}u, VS)"
                   if staged else
                   f"subgroupMatrixLoad<MR, row_major>(&v, kb + (j0 + {16 * t}u) * D + {16 * c}u, D)")
            pv.append(f"    o{c} = subgroupMatrixMultiplyAccumulate(p{t}, {vop}, o{c});")
    if staged:
        pv.append("    vr = vn;")
    resc = []
    for c in range(D // 16):
        resc += ["      workgroupBarrier();",
                 f"      subgroupMatrixStore<row_major>(&x_s, 0u, o{c}, 16u);",
                 "      workgroupBarrier();",
                 "      for (var e = lane; e < 64u; e += 32u) { x_s[e] *= x_s[256u + e / 16u]; }",
                 "      workgroupBarrier();",
                 f"      o{c} = subgroupMatrixLoad<MA, row_major>(&x_s, 0u, 16u);"]
    out = []
    for c in range(D // 16):
        out += [f"  subgroupMatrixStore<row_major>(&x_s, 0u, o{c}, 16u);",
                "  workgroupBarrier();",
                "  for (var e = lane; e < 16u * G; e += 32u) {",
                "    let r = e / 16u;",
                f"    o[((kvh * G + r) * NS + split) * D + {16 * c}u + e % 16u] = x_s[e] / "
                "x_s[272u + r];",
                "  }",
                "  workgroupBarrier();"]
    qs = [f"  let q{d} = subgroupMatrixLoad<ML, row_major>(&q_s, {16 * d}u, D);" for d in range(D // 16)]
    os_ = [f"  var o{c} = MA();" for c in range(D // 16)]
    per = 2 * nt   # keys a lane takes in a step (8 lanes a row)
    return "\n".join([
        "enable f16;", "enable subgroups;", "enable chromium_experimental_subgroup_matrix;",
        "alias ML = subgroup_matrix_left<f16, 16, 16>;",
        "alias MR = subgroup_matrix_right<f16, 16, 16>;",
        "alias MA = subgroup_matrix_result<f32, 16, 16>;",
        f"const D: u32 = {D}u; const G: u32 = {group}u; const SPLIT: u32 = {split}u;",
        f"const NS: u32 = {ns}u; const KW: u32 = {kw}u; const L: u32 = {length}u;",
        f"const SCALE: f32 = {scale!r}; const MARGIN: f32 = {margin!r}; const MASKED: f32 = {MASKED!r};",
        "@group(0) @binding(0) var<storage, read> q: array<f16>;",
        "@group(0) @binding(1) var<storage, read> k: array<f16>;",
        ("@group(0) @binding(2) var<storage, read> vw: array<vec4<u32>>;" if staged else
         "@group(0) @binding(2) var<storage, read> v: array<f16>;"),
        f"const VS: u32 = {D + 8}u;   // v_s row pitch (padded)",
        "@group(0) @binding(3) var<storage, read_write> o: array<f32>;",
        "@group(0) @binding(4) var<storage, read_write> lse: array<f32>;",
        "var<workgroup> s_s: array<f32, 16u * KW>;",
        "var<workgroup> x_s: array<f32, 320u>;   // O scratch, alpha (256..), sums (272..), flag",
        "var<workgroup> q_s: array<f16, 16u * D>;",
        "var<workgroup> p_s: array<f16, 16u * KW>;",
        *(["var<workgroup> v_s: array<f16, KW * VS>;"] if staged else []),
        *ex_decl,
        "@compute @workgroup_size(32)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_invocation_id) lane: u32) {",
        "  let split = wid.x;",
        "  let kvh = wid.y;",
        "  for (var e = lane; e < 16u * D; e += 32u) {",
        "    var x = f16(0.0);",
        "    if (e / D < G) { x = q[(kvh * G + e / D) * D + e % D]; }",
        "    q_s[e] = x;",
        "  }",
        "  for (var e = lane; e < 16u * KW; e += 32u) { p_s[e] = f16(0.0); }",
        "  if (lane < 16u) { x_s[256u + lane] = 1.0; }",
        *ex_set,
        "  workgroupBarrier();",
        *qs, *os_,
        "  let rr = lane / 8u;           // the lane's score row (rows >= G: no query)",
        f"  let c0 = (lane % 8u) * {per}u;",
        "  var m_ref = MASKED;",
        "  var l_sum = 0.0;",
        "  let kb = kvh * L * D;",
        *pre,
        "  for (var j0 = split * SPLIT; j0 < (split + 1u) * SPLIT; j0 += KW) {",
        *s_tiles,
        *ahead,
        "    workgroupBarrier();",
        *stage_v,
        f"    var x: array<f32, {per}>;",
        "    var mx = MASKED;",
        f"    for (var e = 0u; e < {per}u; e++) {{",
        "      x[e] = s_s[rr * KW + c0 + e] * SCALE;",
        "      mx = max(mx, x[e]);",
        "    }",
        "    mx = max(mx, subgroupShuffleXor(mx, 1u));",
        "    mx = max(mx, subgroupShuffleXor(mx, 2u));",
        "    mx = max(mx, subgroupShuffleXor(mx, 4u));",
        "    let need = mx > m_ref + MARGIN;",
        "    let any_r = subgroupAny(need && m_ref > MASKED);",
        "    if (lane == 0u) { x_s[288] = select(0.0, 1.0, any_r); }",
        "    if (workgroupUniformLoad(&x_s[288]) != 0.0) {",
        "      if (lane % 8u == 0u && rr < G) { x_s[256u + rr] = select(1.0, exp(m_ref - mx), need); }",
        *resc,
        "    }",
        "    if (need) {",
        "      l_sum *= exp(m_ref - mx);",
        "      m_ref = mx;",
        "    }",
        f"    for (var e = 0u; e < {per}u; e++) {{",
        "      let p = exp(x[e] - m_ref);",
        "      l_sum += p;",
        "      if (rr < G) { p_s[rr * KW + c0 + e] = f16(p); }",
        "    }",
        "    workgroupBarrier();",
        *pv,
        "  }",
        "  var l_row = l_sum;",
        "  l_row += subgroupShuffleXor(l_row, 1u);",
        "  l_row += subgroupShuffleXor(l_row, 2u);",
        "  l_row += subgroupShuffleXor(l_row, 4u);",
        "  if (lane % 8u == 0u && rr < G) { x_s[272u + rr] = l_row; }",
        *out,
        *ex_use,
        "  if (lane % 8u == 0u && rr < G) { lse[(kvh * G + rr) * NS + split] = m_ref + log(l_row); }",
        "}"])


def _median_s(dev: Any, pipe: Any, group: Any, grid: tuple[int, int, int], repeats: int,
            samples: int) -> float:
    return statistics.median(gemm_probe.pass_times(dev, pipe, group, grid, repeats, samples))


def run(dev: Any, length: int, split: int, nt: int, kvh: int = 8, group: int = 4,
        iters: int = 30, margin: float = 8.0, mode: str = "direct", extra: str = "none") -> str:
    rng = np.random.default_rng(0)
    hq = kvh * group
    q = rng.standard_normal((hq, D)).astype(np.float16)
    k = rng.standard_normal((kvh, length, D)).astype(np.float16)
    v = rng.standard_normal((kvh, length, D)).astype(np.float16)
    scale = 1.0 / np.sqrt(D)
    ns = length // split
    src = kernel(length, split, group, nt, float(scale), margin, mode, extra)
    pipe = dev.compile(f"mdecode_probe[{length},{split},{nt},{margin},{mode},{extra}]", src,
                       ("read",) * 3 + ("rw",) * 2)
    sizes = (hq * ns * D * 4, hq * ns * 4)
    bufs, bg = wgsl_probe_io.bind(dev, (q, k, v), sizes)
    grid = (ns, kvh, 1)
    gemm_probe.pass_times(dev, pipe, bg, grid, 1, 1)
    got = [np.frombuffer(dev.read_buffer(b, n), np.float32) for b, n in zip(bufs[3:], sizes)]
    o = got[0].reshape(hq, ns, D).astype(np.float64)
    ls = got[1].reshape(hq, ns).astype(np.float64)
    w = np.exp(ls - ls.max(axis=1, keepdims=True))
    out = (w[:, :, None] * o).sum(1) / w.sum(1)[:, None]
    qf, kf, vf = (a.astype(np.float64) for a in (q, k, v))
    s = np.einsum("hd,hld->hl", qf, np.repeat(kf, group, axis=0)) * scale
    p = np.exp(s - s.max(1, keepdims=True))
    want = np.einsum("hl,hld->hd", p / p.sum(1, keepdims=True), np.repeat(vf, group, axis=0))
    err = float(np.abs(out - want).max())
    sp = s.reshape(hq, ns, split)           # per split: lse and o, to say which part is wrong
    mp = sp.max(2, keepdims=True)
    ep = np.exp(sp - mp)
    lse_want = (mp[:, :, 0] + np.log(ep.sum(2)))
    o_want = np.einsum("hsl,hsld->hsd", ep / ep.sum(2, keepdims=True),
                       np.repeat(vf, group, axis=0).reshape(hq, ns, split, D))
    parts = (f"lse err {np.nanmax(np.abs(ls - lse_want)):.1e} "
             f"o err {np.nanmax(np.abs(o - o_want)):.1e}")
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        _median_s(dev, pipe, bg, grid, 20, 1)
    one = _median_s(dev, pipe, bg, grid, 1, iters) * 1e6
    b2b = _median_s(dev, pipe, bg, grid, 20, max(5, iters // 4)) * 1e6 / 20
    for b in bufs:
        b.destroy()
    mb = 2 * kvh * length * D * 2 / 1e6
    return (f"L={length:6d} split {split:5d} ({ns:4d} splits) keys/step {16 * nt:3d}: "
            f"{one:7.1f} us a pass, b2b {b2b:6.1f} us ({mb * 1e3 / b2b:6.0f} GB/s of K/V)  "
            f"err {err:.1e} ({parts})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--splits", default="64,128,256", help="split counts")
    ap.add_argument("--steps", default="1,2", help="16-key tiles a step")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--margins", default="8", help="lazy max margins (1e30: never rescale)")
    ap.add_argument("--modes", default="direct,staged", help="direct, staged (see kernel())")
    ap.add_argument("--extras", default="none",
                    help="none, u32, u32x2, u32x3, u32x4, u32x8 (see kernel())")
    a = ap.parse_args()
    for caps in attnreg.devices("dawn"):
        if not caps.available or gemm_probe.refusal(caps):
            print(f"{caps.id}: {caps.reason or gemm_probe.refusal(caps)}")
            continue
        dev = ddevice.get(caps, experimental=True)
        print(f"{caps.id} {caps.name}: GQA 32/8 H=128 f16 decode partials, one subgroup a "
              "workgroup, K/V straight from storage")
        for length in (int(x) for x in a.lengths.split(",")):
            for n in (int(x) for x in a.splits.split(",")):
                for nt, mg, md, ex in ((int(x), float(m), md, ex) for x in a.steps.split(",")
                                       for m in a.margins.split(",")
                                       for md in a.modes.split(",")
                                       for ex in a.extras.split(",")):
                    try:
                        print(f"  {md:6s} margin {mg:g} extra {ex:5s} " + run(
                            dev, length, length // n, nt, iters=a.iters, margin=mg, mode=md,
                            extra=ex), flush=True)
                    except Exception as exc:
                        print(f"  L={length} splits {n} nt {nt}: {type(exc).__name__}: "
                              f"{str(exc)[:400]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
