"""How a WGSL program touches its tensors in memory: the compute types of its dtype, the
element type of every binding, and the generated load/store helpers the family sources call
(``load_q``, ``load_k``, ``load_v``: one 16-byte granule as the granule type GV;
``store_out``: one vec4 of the output), and how staged K/V tiles hold their values (TS).

WGSL has no bfloat16 and no 8- or 4-bit types, so the stored formats are read as words and
converted in the helpers, never by a copy:

- float32 / float16: stored as computed (granules of vec4<f32> / mat2x4<f16>), staged as
  computed (TS = vec4<T>).
- bfloat16: computed in f32 (T = f32). A granule is 8 values, 16 bytes, a vec4<u32> of bits
  (GV), like float16's: loads, the register tile and the staged tiles (TS = vec2<u32>, the
  bits of 4 values) move bf16 bits, and g_part / ts_f32 widen them exactly (a bf16 is the
  top half of the f32 with the same bits: a shift or a mask per value) where they are used.
  The output is rounded to nearest-even (NaN stays NaN, inf stays inf). With quantized K/V
  (kv_dtype) the granule is 8 dequantized f32 values (mat2x4<f32>), staged as f32.
- kv_dtype int8 (k, v as array<u32>, 4 codes a word, little-endian; k_scale / v_scale
  array<f32>, one per vector): x = code * scale, in f32, then T.
- kv_dtype int4 (ggml q4_0: block j of a vector holds elements [32j, 32j+32) in bytes
  [16j, 16j+16), byte 16j+i holds element 32j+i in its low nibble and 32j+i+16 in its high
  one; scales float16 per block, read as array<u32> through unpack2x16float so no
  shader-f16 is needed): x = (nibble - 8) * scale, in f32, then T.

A granule g covers elements [g*GE, g*GE + GE) of the flat K/V array (kv_elem's offsets use
the arrays' natural strides, so element e belongs to vector e / HD of k's scale arrays and
e / VD of v's, VD being v's head size, for BSNH, BNSH and paged pools alike). GE is 4
(float32) or 8 (float16, bfloat16), so a granule's int8 codes are 1-2 whole words and its
int4 codes 1-2 whole words of one half of a q4_0 block.
"""

from __future__ import annotations

from attnreg.spec import AttentionSpec

# Compute types: T (what the kernels compute in), the load granule GV, its element count GE,
# g_part (vec4 s of a granule as vec4<T>) and gv_of (a granule of dequantized values); TS, the
# staged vec4 that K/V tiles hold in workgroup memory, with ts_part (vec4 s of a granule as
# staged) and ts_f32 (a staged vec4 read back as vec4<f32>).
_COMPUTE = {
    "f32": """alias T = f32;
alias GV = vec4<f32>;
const GE: u32 = 4u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g;
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return a;
}
alias TS = vec4<f32>;
fn ts_part(g: GV, s: u32) -> TS {
  return g;
}
fn ts_f32(x: TS) -> vec4<f32> {
  return x;
}
""",
    # f16 loads 16-byte granules of 8 halves as a mat2x4<f16> (two vec4 columns), so f32
    # and f16 move 16 bytes per load instruction.
    "f16": """enable f16;
alias T = f16;
alias GV = mat2x4<f16>;
const GE: u32 = 8u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g[s];
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return GV(vec4<f16>(a), vec4<f16>(b));
}
alias TS = vec4<f16>;
fn ts_part(g: GV, s: u32) -> TS {
  return g[s];
}
fn ts_f32(x: TS) -> vec4<f32> {
  return vec4<f32>(x);
}
""",
    # bf16 K/V as stored: a granule is 16 bytes of 8 bf16 bits (vec4<u32>), the f16
    # granule's size, held as bits in the register tile and staged as bits (a vec2<u32> per
    # vec4 of values, f16's 8 bytes): widened to f32 only where a value is used. So loads,
    # registers and workgroup memory are f16's, and the plans' tiles too.
    "bf16": """alias T = f32;
alias GV = vec4<u32>;
const GE: u32 = 8u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return bf16x4(ts_part(g, s));
}
alias TS = vec2<u32>;
fn ts_part(g: GV, s: u32) -> TS {
  return select(g.zw, g.xy, s == 0u);
}
fn ts_f32(x: TS) -> vec4<f32> {
  return bf16x4(x);
}
""",
    # bf16 with quantized K/V: the K/V loads dequantize into f32 (not representable as
    # bf16 bits without rounding), so granules of 8 are f32 pairs and tiles stage f32; q is
    # widened on load.
    "bf16q": """alias T = f32;
alias GV = mat2x4<f32>;
const GE: u32 = 8u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g[s];
}
fn gv_of(a: vec4<f32>, b: vec4<f32>) -> GV {
  return GV(a, b);
}
alias TS = vec4<f32>;
fn ts_part(g: GV, s: u32) -> TS {
  return g[s];
}
fn ts_f32(x: TS) -> vec4<f32> {
  return x;
}
""",
}

# Stored element type of q / out (and of k / v when not quantized), per spec dtype.
_STORED = {"float32": "array<vec4<f32>>", "float16": "array<mat2x4<f16>>",
           "bfloat16": "array<vec4<u32>>"}
_OUT = {"float32": "array<vec4<f32>>", "float16": "array<vec4<f16>>",
        "bfloat16": "array<vec2<u32>>"}
_FIXED = {"bias": "array<f32>", "f32": "array<f32>", "f32x2": "array<vec2<f32>>",
          "f32x4": "array<vec4<f32>>", "i32": "array<i32>", "u32": "array<u32>"}

_BF16_IN = """fn bf16x4(w: vec2<u32>) -> vec4<f32> {
  return vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u),
                   bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u));
}
fn bf16x8(w: vec4<u32>) -> mat2x4<f32> {
  return mat2x4<f32>(bf16x4(w.xy), bf16x4(w.zw));
}
"""
# Round to nearest even on the bits; NaN as the canonical quiet NaN (its bits + 0x7fff
# could carry into the exponent and make it inf).
_BF16_OUT = """fn bf16_bits(x: f32) -> u32 {
  let u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0u;
  }
  return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
fn bf16_pack(x: vec4<f32>) -> vec2<u32> {
  return vec2<u32>(bf16_bits(x.x) | (bf16_bits(x.y) << 16u),
                   bf16_bits(x.z) | (bf16_bits(x.w) << 16u));
}
"""
# Four int8 codes of a word (little-endian), sign-extended by shifts (unpack4xI8 is not in
# every compiler's WGSL).
_I8 = """fn i8x4(w: u32) -> vec4<f32> {
  return vec4<f32>(f32(bitcast<i32>(w << 24u) >> 24u), f32(bitcast<i32>(w << 16u) >> 24u),
                   f32(bitcast<i32>(w << 8u) >> 24u), f32(bitcast<i32>(w) >> 24u));
}
"""
# Four int4 codes: the low (sh 0) or high (sh 4) nibbles of a word's 4 bytes, minus 8.
_I4 = """fn i4x4(w: u32, sh: u32) -> vec4<f32> {
  let n = (vec4<u32>(w) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(0xfu);
  return vec4<f32>(n) - vec4<f32>(8.0);
}
"""


def compute(spec: AttentionSpec) -> str:
    """The prelude of _COMPUTE a program uses: "f32", "f16", "bf16" (bfloat16 K/V as
    stored) or "bf16q" (bfloat16 with quantized K/V)."""
    if spec.dtype == "float16":
        return "f16"
    if spec.dtype == "bfloat16":
        return "bf16q" if spec.kv_dtype else "bf16"
    return "f32"


def compute_itemsize(spec: AttentionSpec) -> int:
    """Bytes per element of the compute type T (bfloat16 computes in f32)."""
    return 2 if spec.dtype == "float16" else 4


def staged_itemsize(spec: AttentionSpec) -> int:
    """Bytes per element of staged K/V tiles (TS): f16 for float16, bf16 bits for bfloat16
    K/V as stored, f32 for float32 and for bfloat16's dequantized K/V."""
    return 2 if compute(spec) in ("f16", "bf16") else 4


def granule(spec: AttentionSpec) -> int:
    """GE: elements per load granule (16 bytes of float32/float16/bfloat16)."""
    return 4 if spec.dtype == "float32" else 8


def prelude(spec: AttentionSpec) -> str:
    return _COMPUTE[compute(spec)]


def binding_type(kind: str, spec: AttentionSpec) -> str:
    """The WGSL type of a binding of port kind ``kind`` (attnreg/ports.py) in this program."""
    if kind == "kv":
        return _STORED[spec.dtype]
    if kind == "kvc":
        return "array<u32>" if spec.kv_dtype else _STORED[spec.dtype]
    if kind == "scale":
        return "array<f32>" if spec.kv_dtype == "int8" else "array<u32>"
    if kind == "out":
        return _OUT[spec.dtype]
    return _FIXED[kind]


def _load_plain(name: str, spec: AttentionSpec) -> str:
    # bf16: the granule as stored (widened in g_part / ts_f32), unless the prelude's
    # granule is f32 values (bf16q: q beside dequantized K/V)
    val = f"bf16x8({name}[g])" if compute(spec) == "bf16q" else f"{name}[g]"
    return f"fn load_{name}(g: u32) -> GV {{\n  return {val};\n}}\n"


def _load_int8(name: str, spec: AttentionSpec) -> str:
    second = f"i8x4({name}[w + 1u]) * s" if granule(spec) == 8 else "vec4<f32>(0.0)"
    # one scale per vector: k's are HD elements long, v's VD (v_head_size)
    row = "VD" if name == "v" else "HD"
    return f"""fn load_{name}(g: u32) -> GV {{
  let e0 = g * GE;
  let s = {name}_scale[e0 / {row}];
  let w = e0 / 4u;
  return gv_of(i8x4({name}[w]) * s, {second});
}}
"""


def _load_int4(name: str, spec: AttentionSpec) -> str:
    second = f"i4x4({name}[w + 1u], sh) * s" if granule(spec) == 8 else "vec4<f32>(0.0)"
    return f"""fn load_{name}(g: u32) -> GV {{
  let e0 = g * GE;
  let blk = e0 / 32u;
  let r = e0 % 32u;
  let w = blk * 4u + (r % 16u) / 4u;
  let sh = select(0u, 4u, r >= 16u);
  let s = unpack2x16float({name}_scale[blk / 2u])[blk % 2u];
  return gv_of(i4x4({name}[w], sh) * s, {second});
}}
"""


def _store_out(spec: AttentionSpec) -> str:
    val = {"float32": "x", "float16": "vec4<f16>(x)", "bfloat16": "bf16_pack(x)"}[spec.dtype]
    return f"fn store_out(i: u32, x: vec4<f32>) {{\n  out[i] = {val};\n}}\n"


def helpers(spec: AttentionSpec, bound: frozenset[str]) -> str:
    """The load/store helpers of a program whose bindings are ``bound`` (buffer names):
    load_q/load_k/load_v where q, k, v are bound, store_out where out is the output."""
    parts = []
    if spec.dtype == "bfloat16":
        parts.append(_BF16_IN)          # the prelude's g_part / ts_f32 call bf16x4
        parts.append(_BF16_OUT if "out" in bound else "")
    if "q" in bound:
        parts.append(_load_plain("q", spec))
    if "k" in bound:
        quant = spec.kv_dtype
        if quant is not None:
            parts.append(_I8 if quant == "int8" else _I4)
        load = {None: _load_plain, "int8": _load_int8, "int4": _load_int4}[quant]
        parts += [load("k", spec), load("v", spec)]
    if "out" in bound:
        parts.append(_store_out(spec))
    return "".join(parts)
