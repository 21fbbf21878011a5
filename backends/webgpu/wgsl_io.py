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

import string

from attnreg import shaders
from attnreg.spec import AttentionSpec

# Stored element type of q / out (and of k / v when not quantized), per spec dtype.
_STORED = {"float32": "array<vec4<f32>>", "float16": "array<mat2x4<f16>>",
           "bfloat16": "array<vec4<u32>>"}
_OUT = {"float32": "array<vec4<f32>>", "float16": "array<vec4<f16>>",
        "bfloat16": "array<vec2<u32>>"}
_FIXED = {"bias": "array<f32>", "f32": "array<f32>", "f32x2": "array<vec2<f32>>",
          "f32x4": "array<vec4<f32>>", "i32": "array<i32>", "u32": "array<u32>"}


def _piece(name: str, **subst: str) -> str:
    """A piece of shaders/storage.wgsl or shaders/kv_units.wgsl (K/V as register tiles hold
    them), its $names filled in."""
    store = shaders.pieces("storage")
    text = store[name] if name in store else shaders.pieces("kv_units")[name]
    return string.Template(text).substitute(subst) if subst else text


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
    """The compute types of the program (a compute_* piece of shaders/storage.wgsl) and
    GRANULE."""
    return _piece(f"compute_{compute(spec)}") + f"const GRANULE: u32 = {granule(spec)}u;\n"


def kv_unit(spec: AttentionSpec) -> int:
    """vec4s of values in a wide load unit of K/V (16 raw bytes: 4 f32, 8 f16 or bf16, 16
    int8 codes, 32 int4 codes = one q4_0 block), where k's and v's rows are whole units (all
    but int8 rows of 8 codes); 0 otherwise (the units are granules)."""
    if spec.kv_dtype == "int8":
        return 4 if spec.head_size % 16 == 0 and spec.head_size_v % 16 == 0 else 0
    if spec.kv_dtype == "int4":
        return 8
    return 1 if spec.dtype == "float32" else 2


# V's words in a wide program: quantized V is read in units of 8 values (kv_units.wgsl vunit_*).
_WIDE_V = {"int8": "array<vec2<u32>>", "int4": "array<u32>"}


def binding_type(kind: str, spec: AttentionSpec, wide: bool = False, name: str = "") -> str:
    """The WGSL type of a binding of port kind ``kind`` (attnreg/ports.py) in this program;
    wide: K/V as raw words (16 bytes; quantized v in words of 8 values, kv_unit)."""
    if kind == "kv":
        return _STORED[spec.dtype]
    if kind == "kvc":
        if wide:
            return _WIDE_V.get(str(spec.kv_dtype), "array<vec4<u32>>") if name == "v" \
                else "array<vec4<u32>>"
        return "array<u32>" if spec.kv_dtype else _STORED[spec.dtype]
    if kind == "scale":
        return "array<f32>" if spec.kv_dtype == "int8" else "array<u32>"
    if kind == "out":
        return _OUT[spec.dtype]
    return _FIXED[kind]


def _load_plain(name: str, spec: AttentionSpec) -> str:
    # bf16: the granule as stored (widened in g_part / ts_f32), unless the prelude's
    # granule is f32 values (bf16q: q beside dequantized K/V)
    return _piece("load_widened" if compute(spec) == "bf16q" else "load_plain", x=name)


def _load_quant(name: str, spec: AttentionSpec, wide: bool) -> str:
    quant = str(spec.kv_dtype)
    # one scale per vector: k's are QK_DIM elements long, v's V_DIM (v_head_size)
    row = "V_DIM" if name == "v" else "QK_DIM"
    word = "word_wide" if wide else "word_narrow"
    if wide and name == "v":
        word = "word_v8" if quant == "int8" else "word_narrow"
    return (_piece(word, x=name)
            + _piece(f"raw_load_{quant}", x=name, row=row) + _piece("load_quant", x=name)
            + ("" if wide and name == "v"       # v's wide units: vunit_{quant}
               else _piece(f"ku_{quant}" if wide else "ku_granule", x=name, row=row)))


def helpers(spec: AttentionSpec, bound: frozenset[str], wide: bool = False,
            halves: frozenset[str] = frozenset()) -> str:
    """The load/store helpers of a program whose bindings are ``bound`` (buffer names):
    load_q/load_k/load_v where q, k, v are bound (raw_k/raw_v: a granule as loaded, RG, which
    the staged tiles hold and granule_of dequantizes; the load units ku_k/ku_v; wide: of
    quantized K/V bound as 16-byte words, kv_unit; halves: f16 inputs bound as arrays of
    halves, whose granules are read half by half), store_out where out is the output."""
    parts = []
    if spec.dtype == "bfloat16":
        parts.append(_piece("bf16_in"))   # the prelude's g_part / ts_f32 call bf16x4
        parts.append(_piece("bf16_out") if "out" in bound else "")
    if "q" in bound:
        parts.append(_piece("load_halves", x="q") if "q" in halves else _load_plain("q", spec))
    if "k" in bound:
        quant = spec.kv_dtype
        if quant is not None:
            parts.append(_piece("i8" if quant == "int8" else "i4"))
        parts.append(_piece(f"unit_{quant or spec.dtype}" if wide else "unit_granule"))
        # the staged tiles' granules as loaded (RG, granule_of), then each tensor's raw_$x
        parts.append(_piece("raw_plain") if quant is None
                     else _piece("raw_quant") + _piece(f"raw_{quant}"))
        for x in ("k", "v"):
            if quant is not None:
                parts.append(_load_quant(x, spec, wide))
                continue
            parts.append(_piece("raw_load_plain", x=x))
            if wide:
                parts.append(_piece(f"load_wide_{spec.dtype}", x=x) + _piece("ku_float", x=x))
            elif x in halves:
                parts.append(_piece("load_halves", x=x) + _piece("ku_granule", x=x))
            else:
                parts.append(_load_plain(x, spec) + _piece("ku_granule", x=x))
        parts.append(_piece(f"vunit_{quant}" if wide and quant else "vunit_k"))
    if "out" in bound:
        parts.append(_piece(f"store_{spec.dtype}"))
    return "".join(parts)
