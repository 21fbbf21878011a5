"""The WGSL of bench/wgsl_scalar_prefill_probe.py's standalone scalar prefills: a probe
config (Config, parsed from its text) and the two layouts' generators, kernel() (each lane of a
row group its own keys, q from workgroup memory) and kernel_sliced() (a row group's lanes split
the head dimension, q in registers, partial dots reduce-scattered by shuffles), with what they
share (header, kv_pipeline, softmax). The probe's docstring says what each layout answers."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

H = 128


# Variant flags: phases compiled out (wrong values; their error shows the phase went) and
# the library's flash_prefill habits put back one at a time, to say which of them cost.
FLAGS = {
    "noqk": "no S = Q K^T (scores 0)",
    "nopv": "no O += P V",
    "nostage": "no K/V staging stores (the compiler drops the loads too)",
    "b4": "a fourth barrier a tile, before P is written (the library's, per step)",
    "sp": "P row-major, read one scalar a row and key (the library's p_s)",
    "pair": "sliced: the row groups of a subgroup interleaved (lane = slice x groups + group), "
            "so lanes n and n^1 read the same K/V address (NVIDIA returns such 16-byte loads "
            "in 2 cycles instead of 4)",
}


@dataclass(frozen=True)
class Config:
    br: int            # query rows a workgroup
    bc: int            # keys a tile
    tr: int            # rows a lane (2 or 4)
    nl: int            # lanes a row group
    kt: str = "h"      # K staged as f16 (h) or f32 (f)
    vt: str = "h"
    x: frozenset[str] = frozenset()   # variant flags (FLAGS)
    sliced: bool = False  # the sliced layout (kernel_sliced): nl lanes split the head dim


    @property
    def tc(self) -> int:
        return self.bc // self.nl

    @property
    def threads(self) -> int:
        return self.br // self.tr * self.nl

    @property
    def cv(self) -> int:
        return H // 4 // self.nl        # vec4 output columns a lane

    def storage(self) -> int:
        ks = 16 if self.kt == "f" else 8
        if self.sliced:          # no q_s (q in registers), no P (shuffled)
            vs = 16 if self.vt == "f" else 8
            return self.bc * (H // 4) * (ks + vs)
        vs = 16 if self.vt == "f" else 8
        # q_s, k_s, v_s, p_s (flag sp's row-major P is no larger)
        return (self.br * (H // 4 + 1) * 16 + self.bc * (H // 4 + 1) * ks
                + self.bc * (H // 4) * vs + self.bc * (self.br // self.tr + 1) * 4 * self.tr)

    def text(self) -> str:
        x = ":" + "+".join(sorted(self.x)) if self.x else ""
        lay = "s" if self.sliced else ""
        return f"{lay}{self.br}x{self.bc}x{self.tr}x{self.nl}:{self.kt}{self.vt}{x}"

    @staticmethod
    def parse(s: str) -> Config:
        dims, _, rest = s.partition(":")
        sliced = dims.startswith("s")
        dims = dims.removeprefix("s")
        kv, _, flags = rest.partition(":")
        br, bc, tr, nl = (int(x) for x in dims.split("x"))
        kv = kv or "hh"
        x = frozenset(f for f in flags.split("+") if f)
        if x - FLAGS.keys():
            raise SystemExit(f"unknown flags {sorted(x - FLAGS.keys())}: {sorted(FLAGS)}")
        # P is read as a vec<TR>; a row group's lanes shuffle within one 32-lane subgroup
        rows_ok = tr in (2, 4) or (sliced and 1 <= tr <= 8)
        if (not rows_ok or nl not in (2, 4, 8, 16, 32) or bc % nl or br % tr
                or len(kv) != 2 or set(kv) - {"h", "f"}):
            raise SystemExit(f"config {s!r}: rows a lane 2 or 4, lanes a power of two <= 32 "
                             "dividing the keys, K/V types h or f")
        if sliced and (H // 4 % nl or bc % nl or nl > 32):
            raise SystemExit(f"config {s!r}: sliced lanes must divide {H // 4} vec4s and the keys")
        return Config(br, bc, tr, nl, kv[0], kv[1], x, sliced)


def kv_pipeline(c: Config, ks: int, vs: int) -> list[str]:
    """Both layouts' K/V tiles: the register words, the first tile's loads, then the tile
    loop's head (its opening line included): the staging stores between two barriers (rows
    ks / vs vec4s apart in k_s / v_s) and the next tile's loads."""
    words = c.bc * H // 8                        # 16-byte words of a K (or V) tile
    lw = -(-words // c.threads)                  # of them a lane
    L = []
    for w in range(lw):
        L.append(f"  var kr{w}: mat2x4<f16>;")
        L.append(f"  var vr{w}: mat2x4<f16>;")
    load = []
    for w in range(lw):
        idx = f"lid + {w * c.threads}u"
        guard = f"({idx}) < {words}u" if lw * c.threads > words else "true"
        load += [f"    if ({guard}) {{",
                 f"      kr{w} = k[kbase + jn * 16u + {idx}];",
                 f"      vr{w} = v[kbase + jn * 16u + {idx}];",
                 "    }"]
    L += ["  {", "    let jn = 0u;", *load, "  }"]
    L.append("  for (var t = 0u; t < n_t; t++) {")
    L.append("    workgroupBarrier();")
    for w in range(lw if "nostage" not in c.x else 0):
        idx = f"lid + {w * c.threads}u"
        guard = f"({idx}) < {words}u" if lw * c.threads > words else "true"
        kk, kc = f"({idx}) / 16u", f"(({idx}) % 16u) * 2u"
        L.append(f"    if ({guard}) {{")
        L.append(f"      let kh = kr{w};")
        L.append(f"      let vh = vr{w};")
        for x in range(2):
            kx = f"vec4<f32>(kh[{x}])" if c.kt == "f" else f"kh[{x}]"
            vx = f"vec4<f32>(vh[{x}])" if c.vt == "f" else f"vh[{x}]"
            L.append(f"      k_s[{kk} * {ks}u + {kc} + {x}u] = {kx};")
            L.append(f"      v_s[{kk} * {vs}u + {kc} + {x}u] = {vx};")
        L.append("    }")
    L.append("    workgroupBarrier();")
    L.append("    if (t + 1u < n_t) {")
    L.append("      let jn = (t + 1u) * BC;")
    L += ["  " + x for x in load]
    L.append("    }")
    return L


def header(c: Config, seq: int, heads: int, kv_heads: int, tint: bool,
           consts: dict[str, int]) -> list[str]:
    """Both layouts' first lines: extensions, the shape's constants and ``consts``, the
    bindings (q, k, v as 16-byte words of f16; the output f32)."""
    return [
        "enable f16;",
        *(["enable subgroups;"] if tint else []),     # naga takes subgroups without it
        f"const S: u32 = {seq}u;",
        f"const G: u32 = {heads // kv_heads}u;",
        f"const NRT: u32 = {seq // c.br}u;",
        f"const BR: u32 = {c.br}u;",
        f"const BC: u32 = {c.bc}u;",
        *(f"const {k}: u32 = {v}u;" for k, v in consts.items()),
        f"const TH: u32 = {c.threads}u;",
        "const MASKED: f32 = -3.0e38;",
        "@group(0) @binding(0) var<storage, read> q: array<mat2x4<f16>>;",
        "@group(0) @binding(1) var<storage, read> k: array<mat2x4<f16>>;",
        "@group(0) @binding(2) var<storage, read> v: array<mat2x4<f16>>;",
        "@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;",
    ]


def softmax(tr: int, n: int, name: str, lane: str, lanes: int, xs: int, cols: int) -> list[str]:
    """Both layouts' online softmax over a lane's n scores {name}{a}_{e} of each of its tr
    rows (key j0 + lane + lanes * e; the causal mask on the diagonal tile): row maxima over
    the row group's lanes (xs apart), p = exp2, sums and the cols output vec4s rescaled."""
    L = []
    for a in range(tr):
        L.append(f"    {{ let i = i0 + rg * {tr}u + {a}u;")
        L.append("      var mx = MASKED;")
        for e in range(n):
            L.append(f"      if (diag && j0 + {lane} + {lanes * e}u > i) {{ {name}{a}_{e} = MASKED; }}")
            L.append(f"      mx = max(mx, {name}{a}_{e});")
        d = 1
        while d < lanes:
            L.append(f"      mx = max(mx, subgroupShuffleXor(mx, {d * xs}u));")
            d *= 2
        L.append(f"      let mn = max(m{a}, mx);")
        L.append(f"      let al = exp2(m{a} - mn);")
        L.append(f"      m{a} = mn;")
        L.append(f"      l{a} *= al;")
        for e in range(n):
            L.append(f"      {name}{a}_{e} = exp2({name}{a}_{e} - mn);")
            L.append(f"      l{a} += {name}{a}_{e};")
        for u in range(cols):
            L.append(f"      o{a}_{u} *= al;")
        L.append("    }")
    return L


def kernel(c: Config, seq: int, heads: int, kv_heads: int, tint: bool = True) -> str:
    tr, tc, nl, cv = c.tr, c.tc, c.nl, c.cv
    qs, ks, vs, ps = H // 4 + 1, H // 4 + 1, H // 4, c.br // tr + 1
    kty = "vec4<f32>" if c.kt == "f" else "vec4<f16>"
    vty = "vec4<f32>" if c.vt == "f" else "vec4<f16>"
    pty = f"vec{tr}<f32>"
    scale = 1.0 / math.sqrt(H) * math.log2(math.e)
    L = [
        *header(c, seq, heads, kv_heads, tint, {"NL": nl}),
        f"var<workgroup> q_s: array<vec4<f32>, {c.br * qs}u>;",
        f"var<workgroup> k_s: array<{kty}, {c.bc * ks}u>;",
        f"var<workgroup> v_s: array<{vty}, {c.bc * vs}u>;",
        (f"var<workgroup> p_r: array<f32, {c.br * c.bc}u>;" if "sp" in c.x else
         f"var<workgroup> p_s: array<{pty}, {c.bc * ps}u>;"),
        "",
        "@compute @workgroup_size(TH)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {",
        "  let rt = NRT - 1u - wid.x;               // heavy first",
        "  let h = wid.y;",
        "  let kvh = h / G;",
        "  let i0 = rt * BR;",
        "  let rg = lid / NL;",
        "  let tx = lid % NL;",
        f"  for (var w = lid; w < {c.br * 16}u; w += TH) {{",
        "    let r = w / 16u;",
        "    let hv = q[(h * S + i0 + r) * 16u + w % 16u];",
        f"    q_s[r * {qs}u + (w % 16u) * 2u] = vec4<f32>(hv[0]) * {scale!r};",
        f"    q_s[r * {qs}u + (w % 16u) * 2u + 1u] = vec4<f32>(hv[1]) * {scale!r};",
        "  }",
        "  let kbase = kvh * S * 16u;",
        "  let n_t = (i0 + BR + BC - 1u) / BC;      // causal: the tiles up to the last row",
    ]
    for a in range(tr):
        L.append(f"  var m{a} = MASKED;")
        L.append(f"  var l{a} = 0.0;")
        for u in range(cv):
            L.append(f"  var o{a}_{u} = vec4<f32>(0.0);")
    L += kv_pipeline(c, ks, vs)
    # S = Q K^T
    for a in range(tr):
        for e in range(tc):
            L.append(f"    var s{a}_{e} = 0.0;")
    L.append(f"    for (var cc = 0u; cc < {0 if 'noqk' in c.x else H // 4}u; cc++) {{")
    for e in range(tc):
        kx = f"k_s[(tx + {nl * e}u) * {ks}u + cc]"
        L.append(f"      let k{e} = {kx if c.kt == 'f' else f'vec4<f32>({kx})'};")
    for a in range(tr):
        L.append(f"      let q{a} = q_s[(rg * {tr}u + {a}u) * {qs}u + cc];")
        for e in range(tc):
            L.append(f"      s{a}_{e} += dot(q{a}, k{e});")
    L.append("    }")
    # softmax
    L.append("    let j0 = t * BC;")
    L.append("    let diag = j0 + BC - 1u > i0;")
    L += softmax(tr, tc, "s", "tx", nl, 1, cv)
    if "b4" in c.x:
        L.append("    workgroupBarrier();")
    sp = "sp" in c.x
    for e in range(tc):
        if sp:
            for a in range(tr):
                L.append(f"    p_r[(rg * {tr}u + {a}u) * BC + tx + {nl * e}u] = s{a}_{e};")
        else:
            vals = ", ".join(f"s{a}_{e}" for a in range(tr))
            L.append(f"    p_s[(tx + {nl * e}u) * {ps}u + rg] = {pty}({vals});")
    L.append("    workgroupBarrier();")
    L.append(f"    for (var jj = 0u; jj < {0 if 'nopv' in c.x else c.bc}u; jj++) {{")
    if sp:
        vals = ", ".join(f"p_r[(rg * {tr}u + {a}u) * BC + jj]" for a in range(tr))
        L.append(f"      let pv = {pty}({vals});")
    else:
        L.append(f"      let pv = p_s[jj * {ps}u + rg];")
    for u in range(cv):
        vx = f"v_s[jj * {vs}u + tx + {nl * u}u]"
        L.append(f"      let v{u} = {vx if c.vt == 'f' else f'vec4<f32>({vx})'};")
    comp = "xyzw"
    for a in range(tr):
        for u in range(cv):
            L.append(f"      o{a}_{u} += pv.{comp[a]} * v{u};")
    L.append("    }")
    L.append("  }")
    for a in range(tr):
        d = 1
        while d < nl:
            L.append(f"  l{a} += subgroupShuffleXor(l{a}, {d}u);")
            d *= 2
        L.append(f"  {{ let row = h * S + i0 + rg * {tr}u + {a}u;")
        for u in range(cv):
            L.append(f"    out[row * {H // 4}u + tx + {nl * u}u] = o{a}_{u} / l{a};")
        L.append("  }")
    L.append("}")
    return "\n".join(L) + "\n"


def kernel_sliced(c: Config, seq: int, heads: int, kv_heads: int, tint: bool = True) -> str:
    """The sliced layout: a row group's NS = c.nl lanes split the head dimension. Lane s of a
    row group holds vec4s s, s+NS, ... of its TR rows of q in registers (loaded once) and the
    same output columns; for each key it dots its slices (k_s read as NS consecutive vec4s,
    one bank wavefront, the other row groups of the subgroup reading the same: broadcast),
    then NS keys' partial dots are reduce-scattered over the row group by shuffles (lane s
    ends with key s's whole score). P reaches the PV lanes by shuffles: no P in workgroup
    memory and two barriers a tile (staging done, readers done). The point: a vec4 loaded
    from workgroup memory feeds 4 x TR FMAs with nothing else loaded, where the layout of
    kernel() loads a q and a k vec4 for each 4 x TR x TC."""
    ns, tr = c.nl, c.tr
    pair = "pair" in c.x
    sgw = int(os.environ.get("PROBE_SUBGROUP", "32"))   # the device's subgroup width
    xs = sgw // ns if pair else 1                 # lane distance between slices s and s+1
    du = H // 4 // ns                             # vec4 slices a lane (q and output)
    ng = c.bc // ns                               # groups of NS keys a tile
    ks = vs = H // 4
    kty = "vec4<f32>" if c.kt == "f" else "vec4<f16>"
    vty = "vec4<f32>" if c.vt == "f" else "vec4<f16>"
    scale = 1.0 / math.sqrt(H) * math.log2(math.e)
    L = [
        *header(c, seq, heads, kv_heads, tint,
                {"NS": ns, "RGW": max(1, sgw // ns), "SGW": sgw}),
        f"var<workgroup> k_s: array<{kty}, {c.bc * ks}u>;",
        f"var<workgroup> v_s: array<{vty}, {c.bc * vs}u>;",
        "",
        "@compute @workgroup_size(TH)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,",
        "        @builtin(subgroup_invocation_id) sgi: u32) {",
        "  let rt = NRT - 1u - wid.x;               // heavy first",
        "  let h = wid.y;",
        "  let kvh = h / G;",
        "  let i0 = rt * BR;",
        *(["  let rg = (lid / SGW) * RGW + lid % RGW;   // interleaved (flag pair)",
           "  let s = (lid % SGW) / RGW;",
           "  let base = sgi % RGW;                      // the row group's first lane"]
          if pair else
          ["  let rg = lid / NS;",
           "  let s = lid % NS;",
           "  let base = sgi - s;                       // the row group's first lane"]),
        "  let kbase = kvh * S * 16u;",
        "  let n_t = (i0 + BR + BC - 1u) / BC;",
    ]
    for a in range(tr):
        L.append(f"  let row{a} = h * S + i0 + rg * {tr}u + {a}u;")
        for u in range(du):
            L.append(f"  let qc{a}_{u} = s + {ns * u}u;")
            L.append(f"  let qg{a}_{u} = q[row{a} * 16u + qc{a}_{u} / 2u];")
            L.append(f"  let q{a}_{u} = vec4<f32>(qg{a}_{u}[qc{a}_{u} % 2u]) * {scale!r};")
            L.append(f"  var o{a}_{u} = vec4<f32>(0.0);")
        L.append(f"  var m{a} = MASKED;")
        L.append(f"  var l{a} = 0.0;")
    L += kv_pipeline(c, ks, vs)
    L.append("    let j0 = t * BC;")
    L.append("    let diag = j0 + BC - 1u > i0;")
    noqk = "noqk" in c.x
    for a in range(tr):
        for g in range(ng):
            L.append(f"    var sc{a}_{g}: f32;")
    for g in range(ng):
        # partial dots of the group's NS keys, then reduce-scatter: lane s keeps key s
        L.append("    {")
        for a in range(tr):
            for e in range(ns):
                L.append(f"    var x{a}_{e} = 0.0;")
        for e in range(ns if not noqk else 0):
            key = g * ns + e
            for u in range(du):
                kx = f"k_s[{key * ks}u + s + {ns * u}u]"
                L.append(f"    let k{e}_{u} = {kx if c.kt == 'f' else f'vec4<f32>({kx})'};")
            for a in range(tr):
                L.append(f"    x{a}_{e} += " + " + ".join(f"dot(q{a}_{u}, k{e}_{u})"
                                                         for u in range(du)) + ";")
        half = ns // 2
        while half >= 1:
            L.append(f"    {{ let hi = (s & {half}u) != 0u;")
            for a in range(tr):
                for i in range(half):
                    lo_, hi_ = f"x{a}_{i}", f"x{a}_{i + half}"
                    L.append(f"      {{ let snd = select({hi_}, {lo_}, hi); "
                             f"{lo_} = select({lo_}, {hi_}, hi) + subgroupShuffleXor(snd, {half * xs}u); }}")
            L.append("    }")
            half //= 2
        for a in range(tr):
            L.append(f"    sc{a}_{g} = x{a}_0;")
        L.append("    }")
    L += softmax(tr, ng, "sc", "s", ns, xs, du)
    for j in range(c.bc if "nopv" not in c.x else 0):
        g, e = divmod(j, ns)
        for a in range(tr):
            L.append(f"    let p{a}_{j} = subgroupShuffle(sc{a}_{g}, base + {e * xs}u);")
        for u in range(du):
            vx = f"v_s[{j * vs}u + s + {ns * u}u]"
            L.append(f"    let v{j}_{u} = {vx if c.vt == 'f' else f'vec4<f32>({vx})'};")
            for a in range(tr):
                L.append(f"    o{a}_{u} += p{a}_{j} * v{j}_{u};")
    L.append("  }")
    for a in range(tr):
        d = 1
        while d < ns:
            L.append(f"  l{a} += subgroupShuffleXor(l{a}, {d * xs}u);")
            d *= 2
        for u in range(du):
            L.append(f"  out[row{a} * {H // 4}u + s + {ns * u}u] = o{a}_{u} / l{a};")
    L.append("}")
    return "\n".join(L) + "\n"
