"""Each kernel family's inputs and outputs, declared once, in the order the kernels take them.

One table per family serves both kernel languages: it generates the WGSL binding
declarations (backends/webgpu/program.py) and the OpenCL kernel signature (backends/opencl
/program.py), and runtimes bind buffers to it by name. A port that only one language has (the
packed masked-block list of WGSL, the separate CSR arrays of OpenCL) says so in ``langs``;
a port with ``when`` is bound in WGSL only by the variants that use it (a paged cache's
block table, a block-skipping variant's list), while OpenCL passes NULL for an absent one.

Buffer names are the tensor names of the contract (q, k, v, bias, seqlens_k, head_sink,
block_table), the partial states (o_parts, lse_parts), the outputs (out, lse), the
parameter block (params) and the scratch one route passes between its kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

WGSL, OPENCL = "wgsl", "opencl"
ACCESS = ("uniform", "read", "rw")
# Element kinds, as each language spells them (see program.py of each backend):
#   params  the parameter block (backends/common.py FIELDS)
#   kv      q in the spec's dtype (16-byte granules in WGSL)
#   kvc     k, v as stored: the spec's dtype, or the codes of a quantized kv_dtype (int8
#           bytes, int4 q4_0 nibble pairs); each language types them per program
#   scale   k_scale / v_scale of a quantized kv_dtype (float32 per vector for int8, float16
#           per 32 elements for int4)
#   bias    float32 in WGSL (a float16 / bfloat16 bias is widened, exactly, on the host or
#           into a buffer derived from the DeviceTensor), bias_t in OpenCL (the bias's own
#           dtype: the program is built per bias dtype)
#   out     the attention output in the spec's dtype (vec4 in WGSL)
#   f32, f32x2, f32x4, i32, u32, ticket   plain arrays (ticket: OpenCL atomics)
KINDS = ("params", "kv", "kvc", "scale", "bias", "out", "f32", "f32x2", "f32x4", "i32", "u32",
         "ticket")


@dataclass(frozen=True)
class Port:
    """One buffer a family's kernels take: ``name`` is the buffer a runtime binds, ``var`` the
    identifier the kernel source uses (the name unless given)."""

    name: str
    access: str
    kind: str
    var: str = ""
    # "", "paged", "block_skip", "quant", "kv_start" or "seqlens_q"
    when: str = ""
    langs: frozenset[str] = frozenset({WGSL, OPENCL})

    def __post_init__(self) -> None:
        if self.access not in ACCESS or self.kind not in KINDS:
            raise ValueError(f"port {self.name}: access {self.access!r} / kind {self.kind!r}")

    @property
    def ident(self) -> str:
        return self.var or self.name


_CL = frozenset({OPENCL})
_WG = frozenset({WGSL})
PARAMS = Port("params", "uniform", "params", var="P")
# The inputs every K/V-reading family takes (WGSL's attn_common.wgsl refers to all of them).
ATTN_IN = (
    PARAMS,
    Port("q", "read", "kv"),
    Port("k", "read", "kvc"),
    Port("v", "read", "kvc"),
    Port("bias", "read", "bias"),
    Port("seqlens_k", "read", "i32", var="seqlens"),
    Port("head_sink", "read", "f32", var="sink"),
    Port("block_table", "read", "i32", when="paged"),
    # quantized K/V (spec.kv_dtype): the dequantization scales, read beside the codes
    Port("k_scale", "read", "scale", when="quant"),
    Port("v_scale", "read", "scale", when="quant"),
    # the shapes real models need: left padding (first existing key per batch entry) and
    # per-batch query row counts (docs/contract.md "Shapes real models need")
    Port("kv_start", "read", "i32", when="kv_start"),
    Port("seqlens_q", "read", "i32", when="seqlens_q"),
)
# Masked-block lists: one packed buffer in WGSL, CSR arrays (and a launch order) in OpenCL.
BLOCK_LIST = Port("block_list", "read", "u32", when="block_skip", langs=_WG)
BLOCK_CSR = (Port("blk_off", "read", "i32", langs=_CL), Port("blk_ids", "read", "i32", langs=_CL),
             Port("blk_zero", "read", "i32", langs=_CL))
PARTS_OUT = (Port("o_parts", "rw", "f32x4"), Port("lse_parts", "rw", "f32"))
OUT = (Port("out", "rw", "out"), Port("lse", "rw", "f32"))

TABLE: Mapping[str, tuple[Port, ...]] = MappingProxyType({
    "prefill": (*ATTN_IN, BLOCK_LIST, *BLOCK_CSR, Port("wg_order", "read", "i32", langs=_CL),
                *OUT),
    "decode_partial": (*ATTN_IN, BLOCK_LIST, *BLOCK_CSR, *PARTS_OUT),
    # split-KV in one launch: the last work-group of a row tile (its ticket) merges the splits
    "decode_fused": (*ATTN_IN, *BLOCK_CSR, *PARTS_OUT, Port("tickets", "rw", "ticket", langs=_CL),
                     *OUT),
    # unfused decode: scores [B,Nq,S,C] and per-split (max, sum), then normalise x V
    "decode_qk": (*ATTN_IN, Port("scores", "rw", "f32"), Port("stats", "rw", "f32x2")),
    "decode_pv": (*ATTN_IN, Port("scores", "read", "f32"), Port("stats", "read", "f32x2"),
                  *PARTS_OUT),
    # seqlens_q: padding rows (past S_b) take no sink (out 0, lse -inf)
    "reduce": (PARAMS, Port("o_parts", "read", "f32x4"), Port("lse_parts", "read", "f32"),
               Port("head_sink", "read", "f32", var="sink"),
               Port("seqlens_q", "read", "i32", when="seqlens_q"), *OUT),
})


def ports(family: str, lang: str, aux: frozenset[str] | None = None) -> tuple[Port, ...]:
    """The ports of ``family`` in ``lang``, in argument/binding order. ``aux`` (WGSL) names
    the optional inputs this variant binds; None keeps every port (OpenCL passes NULL for
    the absent ones)."""
    out = tuple(p for p in TABLE[family] if lang in p.langs)
    if aux is None:
        return out
    return tuple(p for p in out if not p.when or p.name in aux)


def aux_inputs(family: str, *, paged: bool, block_skip: bool, quant: bool = False,
               kv_start: bool = False, seqlens_q: bool = False) -> frozenset[str]:
    """The optional inputs a WGSL variant of ``family`` binds."""
    want = {"paged": paged, "block_skip": block_skip, "quant": quant, "kv_start": kv_start,
            "seqlens_q": seqlens_q}
    return frozenset(p.name for p in TABLE[family]
                     if p.when and want[p.when] and WGSL in p.langs)
