"""WGSL assembly: a small generated prefix (dtype alias, load granule, constants, the shared
Params struct) + the family's source. Variants differ only in that prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import shaders
from backends import common

# Which files make up each family's module, in order.
FILES = {
    "prefill": ("attn_common", "flash_prefill"),
    "decode_partial": ("attn_common", "decode_partial"),
    "reduce": ("reduce",),
}

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


def build(family: str, dtype: str, head_size: int, consts: Mapping[str, int],
          subgroups: bool = False) -> str:
    """The full WGSL module of one compiled variant."""
    body = "\n".join(load(name) for name in FILES[family])
    return prefix(dtype, head_size, consts, subgroups) + body


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
