"""The WGSL text of the subgroup-matrix GEMM probe (gemm_probe.py runs it): C = A B with f16
operands and f32 result matrices, each subgroup's tm x tn accumulators separate variables
(unrolled here in Python: an array of them is indexed dynamically and spills), operands
loaded straight from storage or staged through workgroup memory, optionally prefetched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnreg.caps import DeviceCaps


@dataclass(frozen=True)
class Config:
    """One probe kernel: tm x tn result matrices per subgroup, sgm x sgn subgroups per
    workgroup, ``stage`` keys per workgroup-memory block (0: operands loaded straight from
    the storage buffers), ``pad`` f16 elements added to each staged row (bank conflicts),
    ``bt``: B stored N x K and loaded column-major; ``prefetch`` (staged only): the next
    block's granules go into registers while the current block is multiplied."""

    tm: int = 2
    tn: int = 4
    sgm: int = 2
    sgn: int = 2
    stage: int = 0
    pad: int = 8
    bt: bool = False
    prefetch: bool = False

    def text(self) -> str:
        how = (f"staged {self.stage} keys, pad {self.pad}" + (", prefetched" if self.prefetch else "")
               if self.stage else "straight from storage")
        return (f"{self.tm}x{self.tn} acc/subgroup, {self.sgm}x{self.sgn} subgroups, {how}"
                + (", B transposed" if self.bt else ""))


def _products(c: Config, a: str, b: str, left: Callable[[int], str], right: Callable[[int], str],
              astride: str, bstride: str, blayout: str) -> list[str]:
    """One k-step: tm left and tn right matrices loaded, tm x tn products accumulated."""
    out = [f"let a{i} = subgroupMatrixLoad<ML, row_major>(&{a}, {left(i)}, {astride});"
           for i in range(c.tm)]
    out += [f"let b{j} = subgroupMatrixLoad<MR, {blayout}>(&{b}, {right(j)}, {bstride});"
            for j in range(c.tn)]
    out += [f"c{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, c{i}_{j});"
            for i in range(c.tm) for j in range(c.tn)]
    return out


def _put8(dst: str, v: str, p: str) -> list[str]:
    """The 8 f16 of granule ``v`` (a vec4<u32>) into ``dst`` from element ``p``."""
    out = []
    for w, comp in enumerate("xyzw"):
        out += [f"let h{w} = bitcast<vec2<f16>>({v}.{comp});",
                f"{dst}[{p} + {2 * w}u] = h{w}.x;", f"{dst}[{p} + {2 * w + 1}u] = h{w}.y;"]
    return out


@dataclass(frozen=True)
class _Block:
    """A rows x cols f16 block staged into workgroup array ``dst`` (rows ``pitch`` apart)
    from ``src`` (vec4<u32> granules of 8 f16): element (r, q) of the block for keys from
    k is src element first.format(k=k) + r * gstride + q."""

    dst: str
    src: str
    rows: int
    cols: int
    pitch: int
    first: str
    gstride: str

    def _rq(self, g: str) -> tuple[str, str]:
        per = self.cols // 8
        return f"({g} / {per}u)", f"(({g} % {per}u) * 8u)"

    def copy(self, k: str) -> list[str]:
        """The whole workgroup copies the block (a loop over its granules)."""
        r, q = self._rq("g")
        return [f"for (var g = lid; g < {self.rows * self.cols // 8}u; g += WG) {{",
                f"  let v = {self.src}[({self.first.format(k=k)} + {r} * {self.gstride} + {q}) / 8u];",
                f"  let p = {r} * {self.pitch}u + {q};",
                *("  " + x for x in _put8(self.dst, "v", "p")), "}"]

    def granules(self, wg: int) -> int:
        return self.rows * self.cols // 8 // wg

    def load(self, reg: str, k: str, wg: int) -> list[str]:
        """Each invocation's granules into registers reg0.. (prefetch)."""
        out = []
        for u in range(self.granules(wg)):
            r, q = self._rq(f"(lid + {u * wg}u)")
            out.append(f"{reg}{u} = {self.src}[({self.first.format(k=k)} + {r} * {self.gstride} "
                       f"+ {q}) / 8u];")
        return out

    def store(self, reg: str, wg: int) -> list[str]:
        """Registers reg0.. into the block."""
        out = []
        for u in range(self.granules(wg)):
            r, q = self._rq(f"(lid + {u * wg}u)")
            out += ["{", f"  let p = {r} * {self.pitch}u + {q};",
                    *("  " + x for x in _put8(self.dst, f"{reg}{u}", "p")), "}"]
        return out


def _blocks(c: Config, bm: int, bn: int) -> tuple[_Block, _Block]:
    """A's block (bm rows x stage keys) and B's (stage rows x bn, or bt: bn x stage)."""
    bk = c.stage
    a = _Block("sa", "a", bm, bk, bk + c.pad, "(wid.y * BM) * K + ({k})", "K")
    if c.bt:
        return a, _Block("sb", "b", bn, bk, bk + c.pad, "(wid.x * BN) * K + ({k})", "K")
    return a, _Block("sb", "b", bk, bn, bn + c.pad, "({k}) * N + wid.x * BN", "N")


def _staged_loop(c: Config, t: int, bm: int, bn: int, wg: int) -> tuple[list[str], list[str]]:
    """(declarations, k loop) of the staged kernel; with ``prefetch`` each invocation loads
    its granules of the next block into registers before the current block's products."""
    ba, bb = _blocks(c, bm, bn)
    ap, bp, bk = ba.pitch, bb.pitch, c.stage
    decl = ["@group(0) @binding(0) var<storage, read> a: array<vec4<u32>>;",
            "@group(0) @binding(1) var<storage, read> b: array<vec4<u32>>;",
            f"var<workgroup> sa: array<f16, {ba.rows * ap}>;",
            f"var<workgroup> sb: array<f16, {bb.rows * bp}>;"]
    if c.bt:
        right, layout = (lambda j: f"(sc + {j * t}u) * {bp}u + kk"), "col_major"
    else:
        right, layout = (lambda j: f"kk * {bp}u + sc + {j * t}u"), "row_major"
    products = [f"  for (var kk = 0u; kk < {bk}u; kk += {t}u) {{",
                *("    " + x for x in _products(c, "sa", "sb", lambda i: f"(sr + {i * t}u) * {ap}u + kk",
                                              right, f"{ap}u", f"{bp}u", layout)), "  }"]
    if not c.prefetch:
        return decl, [f"for (var k0 = 0u; k0 < K; k0 += {bk}u) {{",
                      *("  " + x for x in ba.copy("k0") + bb.copy("k0")),
                      "  workgroupBarrier();", *products, "  workgroupBarrier();", "}"]
    regs = [f"var pa{u}: vec4<u32>;" for u in range(ba.granules(wg))]
    regs += [f"var pb{u}: vec4<u32>;" for u in range(bb.granules(wg))]
    return decl, [*regs, *ba.load("pa", "0u", wg), *bb.load("pb", "0u", wg),
                  f"for (var k0 = 0u; k0 < K; k0 += {bk}u) {{",
                  *("  " + x for x in ba.store("pa", wg) + bb.store("pb", wg)),
                  "  workgroupBarrier();", f"  if (k0 + {bk}u < K) {{",
                  *("    " + x for x in ba.load("pa", f"k0 + {bk}u", wg) + bb.load("pb", f"k0 + {bk}u", wg)),
                  "  }", *products, "  workgroupBarrier();", "}"]


def _direct_loop(c: Config, t: int) -> tuple[list[str], list[str]]:
    decl = ["@group(0) @binding(0) var<storage, read> a: array<f16>;",
            "@group(0) @binding(1) var<storage, read> b: array<f16>;"]
    if c.bt:
        right, stride, layout = (lambda j: f"(c0 + {j * t}u) * K + k0"), "K", "col_major"
    else:
        right, stride, layout = (lambda j: f"k0 * N + c0 + {j * t}u"), "N", "row_major"
    body = [f"for (var k0 = 0u; k0 < K; k0 += {t}u) {{",
            *("  " + x for x in _products(c, "a", "b", lambda i: f"(r0 + {i * t}u) * K + k0",
                                         right, "K", stride, layout)), "}"]
    return decl, body


def wgsl(c: Config, shape: tuple[int, int, int], t: int, subgroup: int) -> str:
    """The probe kernel for config ``c`` on t x t x t matrices and ``subgroup``-lane
    subgroups, for C[M, N] = A[M, K] B[K, N] with ``shape`` = (M, N, K)."""
    m, n, k = shape
    bm, bn = c.sgm * c.tm * t, c.sgn * c.tn * t
    wg = subgroup * c.sgm * c.sgn
    decl, loop = _staged_loop(c, t, bm, bn, wg) if c.stage else _direct_loop(c, t)
    head = ["enable f16;", "enable subgroups;", "enable chromium_experimental_subgroup_matrix;",
            f"const M: u32 = {m}u;", f"const N: u32 = {n}u;", f"const K: u32 = {k}u;",
            f"const BM: u32 = {bm}u;", f"const BN: u32 = {bn}u;",
            f"const WG: u32 = {wg}u;",
            f"alias ML = subgroup_matrix_left<f16, {t}, {t}>;",
            f"alias MR = subgroup_matrix_right<f16, {t}, {t}>;",
            f"alias MC = subgroup_matrix_result<f32, {t}, {t}>;", *decl,
            "@group(0) @binding(2) var<storage, read_write> c: array<f32>;"]
    # Matrix offsets must be subgroup-uniform: they derive from subgroup_id and the loop.
    main = ["@compute @workgroup_size(WG)",
            "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_id) sid: u32,",
            "        @builtin(local_invocation_index) lid: u32) {",
            f"  let sr = (sid / {c.sgn}u) * {c.tm * t}u;", f"  let sc = (sid % {c.sgn}u) * {c.tn * t}u;",
            "  let r0 = wid.y * BM + sr;", "  let c0 = wid.x * BN + sc;",
            *(f"  var c{i}_{j} = MC();" for i in range(c.tm) for j in range(c.tn)),
            *("  " + x for x in loop),
            *(f"  subgroupMatrixStore<row_major>(&c, (r0 + {i * t}u) * N + c0 + {j * t}u, "
              f"c{i}_{j}, N);" for i in range(c.tm) for j in range(c.tn)), "}"]
    return "\n".join(head + main) + "\n"


def fits(c: Config, shape: tuple[int, int, int], t: int, caps: DeviceCaps,
         subgroup: int = 32) -> str | None:
    """Why config ``c`` cannot run ``shape`` on ``caps`` (None: it can)."""
    m, n, k = shape
    bm, bn = c.sgm * c.tm * t, c.sgn * c.tn * t
    if m % bm or n % bn or k % max(t, c.stage, 8):
        return f"shape {shape} is not a multiple of the tile {bm}x{bn}x{max(t, c.stage)}"
    if not c.stage:
        return "prefetch needs staging" if c.prefetch else None
    if c.stage % t or c.stage % 8 or bn % 8 or c.pad % 8:
        return f"stage {c.stage} / pad {c.pad}: multiples of {t} and 8 needed"
    blocks = _blocks(c, bm, bn)
    wg = subgroup * c.sgm * c.sgn
    if c.prefetch and any(b.rows * b.cols // 8 % wg for b in blocks):
        return f"prefetch: the blocks' granules are not a multiple of the {wg} invocations"
    need = sum(2 * b.rows * b.pitch for b in blocks)
    have = int(caps.limit("workgroup_storage") or 16384)
    return f"needs {need} B of workgroup memory, the device grants {have}" if need > have else None


