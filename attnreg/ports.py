"""Each kernel family's inputs and outputs, declared once, in the order the kernels take them,
each buffer with its dtype and its shape as a function of the spec.

One table per family serves every layer: it generates the WGSL binding declarations
(backends/webgpu/program.py) and the OpenCL kernel signature (backends/opencl/program.py);
runtimes bind buffers to it by name and size the outputs and scratch they allocate from it;
the core checks every buffer a kernel binds against the device's storage-binding limit with
it (kernel.py binding_bytes). A port that only one language has (the packed masked-block list
of WGSL, the separate CSR arrays of OpenCL) says so in ``langs``.

A port exists for a spec where its condition ``when`` holds (CONDITIONS). The SPECIALISED
conditions are built into a WGSL variant: its layout binds such a port only where the
condition holds (a paged cache's block table, a block-skipping variant's list). Under the
others a variant keeps the binding, bound to a stand-in where the spec has no such buffer (the
parameter block tells the kernel); OpenCL passes NULL for an absent port.

Buffer names are the tensor names of the contract (q, k, v, bias, seqlens_k, head_sink,
block_table), the partial states (o_parts, lse_parts), the outputs (out, lse), the
parameter block (params) and the scratch one route passes between its kernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import AttentionSpec

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
# Each kind's element dtype as stored (numpy names). A bias counts as float32, the widest a
# kernel binds (WGSL's); OpenCL binds the caller's bias as it is.
_FIXED_DTYPES = {"bias": "float32", "f32": "float32", "f32x2": "float32", "f32x4": "float32",
                 "i32": "int32", "u32": "uint32", "ticket": "uint32"}
ITEMSIZE = MappingProxyType({"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4,
                             "uint32": 4, "int8": 1, "uint8": 1})

Shape = Callable[["AttentionSpec", int], tuple[int, ...]]
Condition = Callable[["AttentionSpec", Mapping[str, Any]], bool]
_EMPTY: Mapping[str, Any] = MappingProxyType({})
# When a port's buffer exists, from the spec and the kernel's parameters.
CONDITIONS: Mapping[str, Condition] = MappingProxyType({
    "": lambda s, p: True,
    "bias": lambda s, p: s.bias,
    "seqlens_k": lambda s, p: s.seqlens_k,
    "head_sink": lambda s, p: s.head_sink,
    "return_lse": lambda s, p: s.return_lse,
    "paged": lambda s, p: s.kv_layout == "paged",
    "quant": lambda s, p: s.kv_dtype is not None,
    # the shapes real models need: left padding (first existing key per batch entry) and
    # per-batch query row counts (docs/contract.md "Shapes real models need")
    "kv_start": lambda s, p: s.kv_start,
    "seqlens_q": lambda s, p: s.seqlens_q,
    "block_skip": lambda s, p: bool(p.get("block_skip")),
})
# The conditions a WGSL variant is built for (its prefix compiles them in: kernels.variant_aux).
SPECIALISED = frozenset({"paged", "quant", "kv_start", "seqlens_q", "block_skip"})


@dataclass(frozen=True)
class Port:
    """One buffer a family's kernels take: ``name`` is the buffer a runtime binds, ``var`` the
    identifier the kernel source uses (the name unless given). ``shape(spec, n_splits)`` is
    the buffer's shape in elements of its dtype; None where something else sizes it (the
    parameter block: backends/common.py; a bias's masked-block lists; decode_fused's tickets,
    one per row tile of the OpenCL launch geometry)."""

    name: str
    access: str
    kind: str
    shape: Shape | None = None
    var: str = ""
    when: str = ""
    langs: frozenset[str] = frozenset({WGSL, OPENCL})

    def __post_init__(self) -> None:
        if self.access not in ACCESS or self.kind not in KINDS or self.when not in CONDITIONS:
            raise ValueError(f"port {self.name}: access {self.access!r} / kind {self.kind!r} "
                             f"/ when {self.when!r}")

    @property
    def ident(self) -> str:
        return self.var or self.name

    def dtype(self, spec: AttentionSpec) -> str:
        """The element dtype of this buffer for ``spec`` (numpy's name)."""
        if self.kind in ("kv", "out"):
            return spec.dtype
        if self.kind == "kvc":
            return spec.kv_code_dtype
        if self.kind == "scale":
            return spec.kv_scale_dtype
        return _FIXED_DTYPES[self.kind]

    def shape_for(self, spec: AttentionSpec, n_splits: int = 1) -> tuple[int, ...]:
        """The buffer's shape for ``spec`` and a split count."""
        if self.shape is None:
            raise ValueError(f"port {self.name} is not sized by the spec")
        return self.shape(spec, n_splits)

    def nbytes(self, spec: AttentionSpec, n_splits: int = 1) -> int:
        return math.prod(self.shape_for(spec, n_splits)) * ITEMSIZE[self.dtype(spec)]

    def exists(self, spec: AttentionSpec, params: Mapping[str, Any] = _EMPTY) -> bool:
        """Whether a kernel with these parameters has this buffer for ``spec``."""
        return bool(CONDITIONS[self.when](spec, params))

    def read_only(self) -> Port:
        """The same buffer, as a later stage reads it."""
        return dataclasses.replace(self, access="read")


def _rows(s: AttentionSpec) -> tuple[int, int, int]:
    return s.batch, s.num_heads, s.seq_len


def _scores(s: AttentionSpec, n: int) -> tuple[int, ...]:
    return (*_rows(s), s.capacity)


_CL = frozenset({OPENCL})
_WG = frozenset({WGSL})
PARAMS = Port("params", "uniform", "params", var="P")
HEAD_SINK = Port("head_sink", "read", "f32", lambda s, n: (s.num_heads,), var="sink",
                 when="head_sink")
SEQLENS_Q = Port("seqlens_q", "read", "i32", lambda s, n: (s.batch,), when="seqlens_q")
# The inputs every K/V-reading family takes (WGSL's attn_common.wgsl refers to all of them).
ATTN_IN = (
    PARAMS,
    Port("q", "read", "kv", lambda s, n: s.q_shape),
    Port("k", "read", "kvc", lambda s, n: s.kv_code_shape),
    Port("v", "read", "kvc", lambda s, n: s.v_code_shape),
    # [B, N, S, C], the most a bias holds (any of its first three dimensions may be 1)
    Port("bias", "read", "bias", _scores, when="bias"),
    Port("seqlens_k", "read", "i32", lambda s, n: (s.batch,), var="seqlens", when="seqlens_k"),
    HEAD_SINK,
    Port("block_table", "read", "i32", lambda s, n: s.block_table_shape, when="paged"),
    # quantized K/V (spec.kv_dtype): the dequantization scales, read beside the codes
    Port("k_scale", "read", "scale", lambda s, n: s.kv_scale_shape, when="quant"),
    Port("v_scale", "read", "scale", lambda s, n: s.v_scale_shape, when="quant"),
    Port("kv_start", "read", "i32", lambda s, n: (s.batch,), when="kv_start"),
    SEQLENS_Q,
)
# Masked-block lists (built by the runtime from the bias): one packed buffer in WGSL, CSR
# arrays (and a launch order) in OpenCL.
BLOCK_LIST = Port("block_list", "read", "u32", when="block_skip", langs=_WG)
BLOCK_CSR = tuple(Port(name, "read", "i32", when="block_skip", langs=_CL)
                  for name in ("blk_off", "blk_ids", "blk_zero"))
# partial states [B, N, S, n_splits, Hv] and their lse [B, N, S, n_splits]
PARTS_OUT = (Port("o_parts", "rw", "f32x4", lambda s, n: (*_rows(s), n, s.head_size_v)),
             Port("lse_parts", "rw", "f32", lambda s, n: (*_rows(s), n)))
OUT = (Port("out", "rw", "out", lambda s, n: s.out_shape),
       Port("lse", "rw", "f32", lambda s, n: s.lse_shape, when="return_lse"))
# unfused decode: scores [B, N, S, C] and per-split (max, sum), then normalise x V
SCORES = (Port("scores", "rw", "f32", _scores),
          Port("stats", "rw", "f32x2", lambda s, n: (*_rows(s), n, 2)))

TABLE: Mapping[str, tuple[Port, ...]] = MappingProxyType({
    "prefill": (*ATTN_IN, BLOCK_LIST, *BLOCK_CSR,
                Port("wg_order", "read", "i32", when="block_skip", langs=_CL), *OUT),
    "decode_partial": (*ATTN_IN, BLOCK_LIST, *BLOCK_CSR, *PARTS_OUT),
    # split-KV in one launch: the last work-group of a row tile (its ticket) merges the splits
    "decode_fused": (*ATTN_IN, *BLOCK_CSR, *PARTS_OUT, Port("tickets", "rw", "ticket", langs=_CL),
                     *OUT),
    "decode_qk": (*ATTN_IN, *SCORES),
    "decode_pv": (*ATTN_IN, *(p.read_only() for p in SCORES), *PARTS_OUT),
    # seqlens_q: padding rows (past S_b) take no sink (out 0, lse -inf)
    "reduce": (PARAMS, *(p.read_only() for p in PARTS_OUT), HEAD_SINK, SEQLENS_Q, *OUT),
})
# What a launch of each op returns; whatever else its stages write stays on the device.
RESULTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "attention": ("out", "lse"), "partial": ("o_parts", "lse_parts"), "reduce": ("out", "lse")})


def ports(family: str, lang: str, aux: frozenset[str] | None = None) -> tuple[Port, ...]:
    """The ports of ``family`` in ``lang``, in argument/binding order. ``aux`` (WGSL) names
    the SPECIALISED inputs this variant binds; None keeps every port (OpenCL passes NULL for
    the absent ones)."""
    out = tuple(p for p in TABLE[family] if lang in p.langs)
    if aux is None:
        return out
    return tuple(p for p in out if p.when not in SPECIALISED or p.name in aux)


def named(name: str) -> Port:
    """The port of buffer ``name`` (as the first family declaring it has it: one name is one
    buffer, of one kind, shape and condition, in every family)."""
    return next(p for ps in TABLE.values() for p in ps if p.name == name)


def aux_inputs(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> frozenset[str]:
    """The SPECIALISED inputs a WGSL variant of ``family`` binds for ``spec``."""
    return frozenset(p.name for p in TABLE[family]
                     if p.when in SPECIALISED and WGSL in p.langs and p.exists(spec, params))


def bound(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> tuple[Port, ...]:
    """The buffers a kernel of ``family`` with ``params`` binds for ``spec``."""
    return tuple(p for p in TABLE[family] if p.exists(spec, params))


@cache
def reads(families: tuple[str, ...], lang: str) -> tuple[str, ...]:
    """The names of the buffers a launch of these families reads, each once, in order."""
    return tuple(dict.fromkeys(p.name for f in families for p in ports(f, lang)
                               if p.access == "read"))


def written(families: Iterable[str], spec: AttentionSpec, lang: str) -> tuple[Port, ...]:
    """The buffers a launch of these families writes for ``spec``, each once, in launch order:
    the scratch one stage hands the next and the outputs (what the runtime allocates)."""
    out: dict[str, Port] = {}
    for f in families:
        for p in ports(f, lang):
            if p.access == "rw" and p.name not in out and p.exists(spec):
                out[p.name] = p
    return tuple(out.values())


def results(op: str, launch_writes: Iterable[Port]) -> tuple[Port, ...]:
    """Of what a launch writes, the buffers an ``op`` returns (RESULTS), in launch order."""
    return tuple(p for p in launch_writes if p.name in RESULTS[op])
