"""WGSL assembly: a small generated prefix (dtype alias, load granule, constants, the shared
Params struct) + the family's source. Variants differ only in that prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import shaders
from backends import common

# Which files make up each family's module, in order.
FILES = {
    "prefill": ("attn_common", "flash_prefill"),
    "decode_partial": ("attn_common", "decode_partial"),
    "reduce": ("reduce",),
    "decode_qk": ("attn_common", "decode_qk"),
    "decode_pv": ("attn_common", "decode_pv"),
}
# Optional inputs of a variant, declared by the prefix after its family's bindings (at these
# binding numbers, per family); backends.webgpu.device builds the matching layouts.
AUX_BINDINGS: dict[str, dict[str, int]] = {
    "block_table": {"prefill": 9, "decode_partial": 9, "decode_qk": 9, "decode_pv": 11},
    "block_list": {"prefill": 10, "decode_partial": 10},
}
# Memory helpers every K/V-reading family calls. kv_elem: element offset of key j of
# (batch b, kv head n), contiguous or through the paged block table (strides within a page);
# blk_range / blk_entry: a masked-block list packed as [entries base, CSR offsets, entries],
# entry = block id | all-zero flag << 31. Absent inputs get stubs, so one family source
# serves every variant and a variant never declares a binding its layout lacks.
_KV_PAGED = """@group(0) @binding({b}) var<storage, read> block_table: array<i32>;
const PAGED: u32 = 1u;
fn kv_elem(b: u32, n: u32, j: u32) -> u32 {{
  let page = u32(block_table[b * P.pages_per_seq + j / P.page_size]);
  return page * P.kv_sb + n * P.kv_sh + (j % P.page_size) * P.kv_ss;
}}
"""
_KV_FLAT = """const PAGED: u32 = 0u;
fn kv_elem(b: u32, n: u32, j: u32) -> u32 {
  return b * P.kv_sb + n * P.kv_sh + j * P.kv_ss;
}
"""
_BLOCKS = """@group(0) @binding({b}) var<storage, read> block_list: array<u32>;
const BLOCKS: u32 = 1u;
fn blk_range(r: u32) -> vec2<u32> {{
  return vec2<u32>(block_list[1u + r], block_list[2u + r]);
}}
fn blk_entry(i: u32) -> u32 {{
  return block_list[block_list[0] + i];
}}
"""
_NO_BLOCKS = """const BLOCKS: u32 = 0u;
fn blk_range(r: u32) -> vec2<u32> {
  return vec2<u32>(0u, 0u);
}
fn blk_entry(i: u32) -> u32 {
  return 0u;
}
"""

# f32 loads 16-byte granules of 4 floats; f16 loads 16-byte granules of 8 halves as a
# mat2x4<f16> (two vec4 columns), so both dtypes move 16 bytes per load instruction.
_DTYPE_PRELUDE = {
    "float32": """alias T = f32;
alias GV = vec4<f32>;
const GE: u32 = 4u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g;
}
""",
    "float16": """enable f16;
alias T = f16;
alias GV = mat2x4<f16>;
const GE: u32 = 8u;
fn g_part(g: GV, s: u32) -> vec4<T> {
  return g[s];
}
""",
}

# Row reductions over SGW lanes: subgroup shuffles in subgroup variants; absent otherwise,
# so a non-subgroup variant never mentions a subgroup builtin (its device may lack them).
_LANE_SG = """fn lane_max(x: f32) -> f32 {
  var v = x;
  for (var s = 1u; s < SGW; s = s << 1u) {
    v = max(v, subgroupShuffleXor(v, s));
  }
  return v;
}
fn lane_sum(x: f32) -> f32 {
  var v = x;
  for (var s = 1u; s < SGW; s = s << 1u) {
    v = v + subgroupShuffleXor(v, s);
  }
  return v;
}
"""
_LANE_PLAIN = """fn lane_max(x: f32) -> f32 {
  return x;
}
fn lane_sum(x: f32) -> f32 {
  return x;
}
"""


def load(name: str) -> str:
    """One WGSL file's text (a seam for tests that need a source to fail to compile)."""
    return shaders.load(name)


def prefix(dtype: str, head_size: int, consts: Mapping[str, int], subgroups: bool) -> str:
    ge = 8 if dtype == "float16" else 4
    lines = [_DTYPE_PRELUDE[dtype],
             f"const HD: u32 = {head_size}u;",
             f"const HV: u32 = {head_size // 4}u;",
             f"const HG: u32 = {head_size // ge}u;",
             f"const GS: u32 = {ge // 4}u;"]
    lines += [f"const {k}: u32 = {int(v)}u;" for k, v in sorted(consts.items())]
    lines.append(_LANE_SG if subgroups else _LANE_PLAIN)
    lines.append(common.wgsl_struct("Params"))
    return "\n".join(lines) + "\n"


def memory_helpers(family: str, aux: Iterable[str] = ()) -> str:
    """kv_elem / blk_range / blk_entry for a family, reading the aux inputs it binds."""
    aux = set(aux)
    text = _KV_PAGED.format(b=AUX_BINDINGS["block_table"][family]) if "block_table" in aux \
        else _KV_FLAT
    if "block_list" in aux:
        text += _BLOCKS.format(b=AUX_BINDINGS["block_list"][family])
    else:
        text += _NO_BLOCKS
    return text


def build(family: str, dtype: str, head_size: int, consts: Mapping[str, int],
          subgroups: bool = False, aux: Iterable[str] = ()) -> str:
    """The full WGSL module of one compiled variant; ``aux`` names its optional inputs
    ("block_table" for a paged KV cache, "block_list" for masked-block skipping)."""
    body = "\n".join(load(name) for name in FILES[family])
    helpers = "" if family == "reduce" else memory_helpers(family, aux)
    return prefix(dtype, head_size, consts, subgroups) + helpers + body


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
