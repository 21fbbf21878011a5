"""The one WGSL program builder: from a plan stage, the spec and the device's caps, the
specialised WGSL module, its bindings (buffer names, in binding order) and its dispatch grid.

Pure: nothing here touches a GPU API. wgpu-native (runtime.py), headless Chromium
(backends.browser) and any later WebGPU host compile and dispatch exactly these programs;
what one compiler needs and another refuses (Tint wants ``enable subgroups;``, naga rejects
it) is decided here, by ``dialect``, once for every host.

A module is a generated prefix (compute type, load granule, the stage's constants, the row
reductions, the parameter block of backends/common.py, the binding declarations of
attnreg/ports.py typed by the stored dtypes, the load/store helpers of wgsl_io.py, the
paged/block-list memory helpers) followed by the family's files from shaders/. Variants
differ only in that prefix, whose WGSL comes from the pieces of shaders/prefix.wgsl,
shaders/storage.wgsl and shaders/kv_units.wgsl: no WGSL is written here, only chosen and
declared.

The runtimes' own kernels (patch16, copy_rows, copy_bw, quantize_kv) are built here too
(``utility``): constants and binding declarations generated the same way, then their files.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from attnreg import ports, shaders
from attnreg.backends import common
from attnreg.caps import DeviceCaps
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec

from . import kernels, mma, tiles, unroll, wgsl_io

ENTRY = "main"
NAGA, TINT = "naga", "tint"           # wgpu-native's compiler; Dawn's (Chromium, wgpudawn)

# Which files make up each family's module, in order.
FILES = {
    "prefill": ("attn_common", "attn_keys", "flash_prefill_steps", "flash_prefill"),
    "decode_partial": ("attn_common", "attn_keys", "decode_common", "decode_qk_common", "decode_pv_common",
                       "decode_partial"),
    "reduce": ("reduce",),
    "decode_qk": ("attn_common", "attn_keys", "decode_common", "decode_qk_common", "decode_qk"),
    "decode_pv": ("attn_common", "attn_keys", "decode_common", "decode_pv_common", "decode_pv"),
}

_ACCESS = {"read": "read", "rw": "read_write"}

# Tint refuses subgroup builtins unless the module says `enable subgroups;`; naga (wgpu-py
# 0.32) refuses that directive ("not yet supported").
SUBGROUP_DIRECTIVE = "enable subgroups;\n"
_SUBGROUP_CALL = re.compile(r"\bsubgroup[A-Z]\w*\s*\(")


@dataclass(frozen=True)
class Binding:
    """Binding ``index`` of group 0 takes buffer ``name`` with ``access`` uniform|read|rw."""

    index: int
    access: str
    name: str


@dataclass(frozen=True)
class Program:
    """One dispatch of a plan, as any WebGPU host needs it."""

    kernel: str
    family: str
    wgsl: str
    bindings: tuple[Binding, ...]
    grid: tuple[int, int, int]
    workgroups: int
    consts: Mapping[str, int]
    dtype: str                  # what the stage computes in (the spec's dtype it was built for)
    entry: str = ENTRY

    @property
    def layout(self) -> tuple[str, ...]:
        """The binding accesses in order: programs with equal layouts share a bind group
        layout."""
        return tuple(b.access for b in self.bindings)

    @property
    def key(self) -> str:
        """Pipeline-cache key: the source and the binding layout."""
        return f"{digest(self.wgsl)}-{','.join(self.layout)}"

    @property
    def uses_subgroups(self) -> bool:
        return bool(_SUBGROUP_CALL.search(self.wgsl))


def load(name: str) -> str:
    """One WGSL file's text (a seam for tests that need a source to fail to compile)."""
    return shaders.load(name)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- pieces of a module ----------------------------------------------------------------------
def stage_aux(stage: Stage, spec: AttentionSpec) -> frozenset[str]:
    """The optional inputs a stage binds: the paged block table, the masked-block list,
    the scales of quantized K/V, the kv_start and seqlens_q tensors."""
    return kernels.variant_aux(stage.family, spec, stage.params)


def subgroup_width(stage: Stage, caps: DeviceCaps) -> int:
    """Lanes a subgroup variant reduces over: the device's smallest subgroup (a power of
    two, at least WebGPU's 4); 1 for variants without subgroups."""
    if stage.params.get("reduction") != "subgroup":
        return 1
    return 1 << max(0, (caps.subgroup_min_size or 4).bit_length() - 1)


def consts(stage: Stage, spec: AttentionSpec, caps: DeviceCaps, *, op: str = "attention",
           bias_shape: tuple[int, ...] | None = None) -> dict[str, int]:
    """The stage's compile-time constants (what its prefix defines)."""
    if "mma" in stage.params:
        return mma.consts(stage.family, spec, stage.params)
    return tiles.stage_consts(stage.family, spec, stage.params,
                                subgroup_width=subgroup_width(stage, caps),
                                bias_shape=bias_shape, op=op)


def declarations(family: str, aux: frozenset[str], spec: AttentionSpec, wide: bool = False,
                 halves: frozenset[str] = frozenset()) -> str:
    """The binding declarations of a family's variant, from attnreg/ports.py; element
    types per the spec's stored dtypes (backends/webgpu/wgsl_io.py; wide: quantized K/V as
    16-byte words; halves: the f16 inputs bound as arrays of halves)."""
    return "".join(
        _declaration(i, p.access, p.ident, "Params" if p.access == "uniform"
                     else "array<f16>" if p.name in halves
                     else wgsl_io.binding_type(p.kind, spec, wide, p.name))
        for i, p in enumerate(ports.ports(family, ports.WGSL, aux)))


def _declaration(index: int, access: str, ident: str, ty: str) -> str:
    space = "uniform" if access == "uniform" else f"storage, {_ACCESS[access]}"
    return f"@group(0) @binding({index}) var<{space}> {ident}: {ty};\n"


def bindings(family: str, aux: frozenset[str]) -> tuple[Binding, ...]:
    return tuple(Binding(i, p.access, p.name)
                 for i, p in enumerate(ports.ports(family, ports.WGSL, aux)))


def _variant(flag: str, bound: bool, on: str, off: str) -> str:
    """``flag`` (1 where the input is bound) and the piece of shaders/prefix.wgsl that reads
    the input, or its stub."""
    return f"const {flag}: u32 = {int(bound)}u;\n" + shaders.pieces("prefix")[on if bound else off]


def memory_helpers(aux: frozenset[str]) -> str:
    """kv_elem / blk_range / blk_entry (and PAGED / BLOCKS), reading the aux inputs the
    variant binds."""
    return (_variant("PAGED", "block_table" in aux, "kv_paged", "kv_flat")
            + _variant("BLOCKS", "block_list" in aux, "blocks", "no_blocks"))


def shape_helpers(aux: frozenset[str]) -> str:
    """kv_first / q_rows (and KV_START / Q_ROWS), reading kv_start / seqlens_q where bound."""
    return (_variant("KV_START", "kv_start" in aux, "kv_start", "no_kv_start")
            + _variant("Q_ROWS", "seqlens_q" in aux, "q_rows", "no_q_rows"))


def lane_helpers(subgroups: bool) -> str:
    """lane_max / lane_sum over SGW lanes: subgroup shuffles, or the identity."""
    return shaders.pieces("prefix")["lanes_subgroup" if subgroups else "lanes_plain"]


# The matrix-unit variants (params "mma"): the primitive on subgroup matrices or in software.
MMA_PRIMITIVE = {"hardware": "mma_hw", "emulate": "mma_emu"}
MMA_KERNEL = {"prefill": "flash_prefill_mma", "decode_partial": "decode_mma"}
SUBGROUP_MATRIX_DIRECTIVE = "enable chromium_experimental_subgroup_matrix;\n"


def files(stage: Stage) -> tuple[str, ...]:
    mma = stage.params.get("mma")
    if mma is None:
        return FILES[stage.family]
    prim = MMA_PRIMITIVE[str(mma)]
    if stage.family != "prefill":
        return ("attn_common", "attn_keys", "mma_common", "mma_staging", prim, prim + "_staged",
                MMA_KERNEL[stage.family])
    # the prefill's forms: operands staged in workgroup memory, or Q and K straight from
    # storage (form "direct", mma.py)
    if stage.params.get("form") == "direct":
        return ("attn_common", "attn_keys", "mma_common", prim, prim + "_direct", "mma_prefill_common",
                MMA_KERNEL["prefill"] + "_direct")
    return ("attn_common", "attn_keys", "mma_common", "mma_staging", prim, prim + "_staged",
            "mma_prefill_common", MMA_KERNEL["prefill"])


def source(family: str, spec: AttentionSpec, stage_consts: Mapping[str, int], *,
           subgroups: bool = False, aux: frozenset[str] = frozenset(),
           dialect: str = NAGA, names: tuple[str, ...] | None = None) -> str:
    """The full WGSL module of one compiled variant."""
    ge = wgsl_io.granule(spec)
    h, hv = spec.head_size, spec.head_size_v
    # q and k rows in elements, vec4s, granules; the same of v and out rows (Hv)
    head = [wgsl_io.prelude(spec), f"const QK_DIM: u32 = {h}u;",
            f"const QK_VEC4S: u32 = {h // 4}u;", f"const QK_GRANULES: u32 = {h // ge}u;",
            f"const GRANULE_VEC4S: u32 = {ge // 4}u;", f"const V_DIM: u32 = {hv}u;",
            f"const V_VEC4S: u32 = {hv // 4}u;", f"const V_GRANULES: u32 = {max(1, hv // ge)}u;"]
    head += [f"const {k}: u32 = {int(v)}u;" for k, v in sorted(stage_consts.items())]
    head += [lane_helpers(subgroups), common.wgsl_struct("Params")]
    # KV_WIDE (the direct decode_partial, tiles.py): quantized K/V loaded in 16-byte units
    wide = bool(stage_consts.get("KV_WIDE", 0))
    # Q_DIRECT (the matrix prefill's direct form, mma.py): q as an array of halves, which
    # subgroup matrices load straight from storage
    halves = frozenset({"q"}) if stage_consts.get("Q_DIRECT", 0) else frozenset()
    text = "\n".join(head) + "\n" + declarations(family, aux, spec, wide, halves)
    text += wgsl_io.helpers(spec, frozenset(b.name for b in bindings(family, aux)), wide, halves)
    text += shape_helpers(aux)
    if family != "reduce":
        text += memory_helpers(aux)
    names = names or FILES[family]
    text += "\n".join(load(name) for name in names)
    text = unroll.unroll(text)
    if "mma_hw" in names:
        text = SUBGROUP_MATRIX_DIRECTIVE + text
    return for_dialect(text, dialect)


def for_dialect(wgsl: str, dialect: str) -> str:
    """The module as ``dialect``'s compiler accepts it."""
    if dialect == TINT and _SUBGROUP_CALL.search(wgsl) and \
            not re.search(r"^\s*enable\s+[^;]*\bsubgroups\b", wgsl, re.M):
        return SUBGROUP_DIRECTIVE + wgsl
    return wgsl


def workgroups(stage: Stage, spec: AttentionSpec, stage_consts: Mapping[str, int],
               n_splits: int = 1) -> int:
    """How many workgroups the stage dispatches (before folding into a grid)."""
    c = stage_consts
    if stage.family == "prefill":
        return -(-spec.seq_len // c["Q_TILE"]) * spec.num_heads * spec.batch
    if stage.family in ("decode_partial", "decode_qk", "decode_pv"):
        return (n_splits * -(-spec.seq_len // c["M_TILE"]) * -(-spec.group_size // c["GROUP_TILE"])
                * spec.kv_num_heads * spec.batch)
    return spec.batch * spec.num_heads * spec.seq_len


def fold_grid(n: int, limit: int) -> tuple[int, int, int]:
    """n workgroups as (x, y, z) with each <= limit; kernels unfold x + nx*(y + ny*z) and
    skip ids >= n."""
    x = max(1, min(n, limit))
    rest = -(-n // x)
    y = max(1, min(rest, limit))
    z = -(-rest // y)
    if z > limit:
        raise ValueError(f"{n} workgroups exceed {limit}^3")
    return x, y, z


# -- programs ------------------------------------------------------------------------------
# Programs by value: a runtime asks for its plan's programs at every launch (they key its
# prepared launches), and building the WGSL text costs 0.1-0.6 ms; a decode loop asks for
# the same few again and again.
_BUILT: OrderedDict[tuple[Any, ...], Program] = OrderedDict()
_BUILT_LOCK = threading.Lock()
_BUILT_MAX = 512


def build(stage: Stage, spec: AttentionSpec, caps: DeviceCaps, *, n_splits: int = 1,
          op: str = "attention", bias_shape: tuple[int, ...] | None = None,
          dialect: str = NAGA) -> Program:
    """Everything a host needs to compile and dispatch one stage (built once per value)."""
    # ``load`` is in the key: a test that swaps it for a broken source gets its own entries
    key = (stage.kernel, stage.family, tuple(sorted(stage.params.items())), spec, caps,
           n_splits, op, bias_shape, dialect, load)
    with _BUILT_LOCK:
        got = _BUILT.get(key)
        if got is not None:
            _BUILT.move_to_end(key)
            return got
    got = _build(stage, spec, caps, n_splits=n_splits, op=op, bias_shape=bias_shape,
                 dialect=dialect)
    with _BUILT_LOCK:
        _BUILT[key] = got
        while len(_BUILT) > _BUILT_MAX:
            _BUILT.popitem(last=False)
    return got


def _build(stage: Stage, spec: AttentionSpec, caps: DeviceCaps, *, n_splits: int,
           op: str, bias_shape: tuple[int, ...] | None, dialect: str) -> Program:
    c = consts(stage, spec, caps, op=op, bias_shape=bias_shape)
    aux = stage_aux(stage, spec)
    wgsl = source(stage.family, spec, c, subgroups=stage.params.get("reduction") == "subgroup",
                  aux=aux, dialect=dialect, names=files(stage))
    n = workgroups(stage, spec, c, n_splits)
    limit = caps.limit("workgroups_per_dim") or 65535
    return Program(stage.kernel, stage.family, wgsl, bindings(stage.family, aux),
                   fold_grid(n, limit), n, c, spec.dtype)


def launch_stages(plan: Plan) -> list[Stage]:
    """The stages a launch dispatches (a reduce-only op runs just the reduce)."""
    return [plan.stage("reduce")] if plan.op == "reduce" else list(plan.stages)


def n_splits(plan: Plan) -> int:
    return plan.split.n_splits if plan.split is not None else 1


def programs(plan: Plan, caps: DeviceCaps | None = None, *, spec: AttentionSpec | None = None,
             bias_shape: tuple[int, ...] | None = None, dialect: str = NAGA) -> list[Program]:
    """The plan's dispatches in launch order. ``spec`` is what the device computes where a
    host widens the plan's (the browser's float16-via-float32 variants)."""
    return [build(st, spec or plan.spec, caps or plan.caps, n_splits=n_splits(plan), op=plan.op,
                  bias_shape=bias_shape, dialect=dialect) for st in launch_stages(plan)]


def param_block(plan: Plan, bias_shape: tuple[int, ...] | None = None,
                spec: AttentionSpec | None = None) -> bytes:
    """The parameter block every stage of the plan reads, with the plan's split geometry."""
    geometry: dict[str, Any] = {}
    if plan.split is not None:
        geometry = {"n_splits": plan.split.n_splits}
        if plan.split.split_size is not None:
            geometry["split_size"] = plan.split.split_size
    return common.pack(spec or plan.spec, geometry, bias_shape)


# -- the runtimes' own kernels ---------------------------------------------------------------
# Kernels that are not attention (memory.py's, quantize.py's): a uniform block ``job`` (the
# file's struct Job), then storage buffers (access, name, WGSL type), THREADS invocations a
# workgroup. Those with one invocation per item of the job enter through
# shaders/utility_common.wgsl, which calls the file's job_item(t) for t < job.count.
_WORDS = (("read", "src", "array<u32>"), ("rw", "dst", "array<u32>"))
UTILITIES: Mapping[str, tuple[tuple[str, str, str], ...]] = {
    "patch16": _WORDS,
    "copy_rows": _WORDS,
    "copy_bw": (("read", "src", "array<vec4<u32>>"), ("rw", "dst", "array<vec4<u32>>")),
    "quantize_kv": (_WORDS[0], ("rw", "codes", "array<u32>"), ("rw", "scales", "array<u32>")),
}
_PER_ITEM = frozenset({"patch16", "copy_rows", "quantize_kv"})
_UTILITY_THREADS = {"copy_bw": 256}         # the others: 64


@dataclass(frozen=True)
class Utility:
    """One of the runtimes' own kernels, as any WebGPU host needs it."""

    name: str
    wgsl: str
    bindings: tuple[Binding, ...]
    threads: int

    @property
    def layout(self) -> tuple[str, ...]:
        return tuple(b.access for b in self.bindings)


def utility(name: str, *, consts: Mapping[str, int] | None = None,
            types: Mapping[str, str] | None = None, pieces: tuple[str, ...] = (),
            dialect: str = NAGA) -> Utility:
    """The module of utility kernel ``name``: its constants (THREADS and ``consts``), its
    binding declarations (``types`` replacing a buffer's WGSL type), ``pieces`` of
    shaders/storage.wgsl, the per-item entry point where it has one, and its file."""
    return _utility(name, tuple(sorted((consts or {}).items())),
                    tuple(sorted((types or {}).items())), pieces, dialect)


@lru_cache(maxsize=64)
def _utility(name: str, consts: tuple[tuple[str, int], ...], types: tuple[tuple[str, str], ...],
             pieces: tuple[str, ...], dialect: str) -> Utility:
    threads = _UTILITY_THREADS.get(name, 64)
    retyped = dict(types)
    buffers = (("uniform", "job", "Job"),) + tuple(
        (access, ident, retyped.get(ident, ty)) for access, ident, ty in UTILITIES[name])
    text = "".join(f"const {k}: u32 = {int(v)}u;\n" for k, v in (("THREADS", threads), *consts))
    text += "".join(_declaration(i, *b) for i, b in enumerate(buffers))
    text += "".join(shaders.pieces("storage")[p] for p in pieces)
    if name in _PER_ITEM:
        text += load("utility_common")
    text += load(name)
    return Utility(name, for_dialect(text, dialect),
                   tuple(Binding(i, a, ident) for i, (a, ident, _) in enumerate(buffers)), threads)
