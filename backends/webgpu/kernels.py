"""The WebGPU kernel variants, as data, and the compile-time constants each one derives
from (spec, params): tile sizes, rows per workgroup, query heads per workgroup."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attnreg.backends import common, ports
from attnreg.caps import DeviceCaps
from attnreg.kernel import ALL_FEATURES, KernelInfo
from attnreg.spec import AttentionSpec

from . import wgsl_io
from .probe import NAME

# bfloat16 computes in f32 (WGSL has no bf16): loaded and staged as bits in float16's 16-byte
# granules and tile bytes, widened exactly where used, rounded on store.
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# Quantized K/V storages every K/V reader dequantizes in its loads (backends/webgpu/wgsl_io.py).
KV_DTYPES = frozenset({"int8", "int4"})
# Every multiple of 8 up to 512: f16 and bf16 load 8 values per granule; O accumulators live in
# registers, split over a row's lanes (prefill: row_lanes of them, decode: up to 64 PV lanes),
# so 512 / 4 = 128 vec4 columns are 8 per prefill lane and row, 2 per decode lane and vector.
# Larger heads need smaller tiles: the tile-fitting rules halve them until the workgroup
# storage fits. v_head_size (Hv != head_size) takes the same values.
HEAD_SIZES = (8, 512, 8)
M_TILES = (1, 2, 4)

# prefetch: load the next K/V tile into registers while the current one is computed.
# max_k_step: keys per inner step (their scores live in private memory); kv_staging:
# "workgroup" stages kv_tile-key K/V tiles in workgroup memory for the whole workgroup,
# "direct" lets each row group read K/V straight from memory (no staging, no K/V barriers);
# out_tile: "registers" keeps the output accumulator in registers, "half_workgroup" moves
# half of each lane's output columns to workgroup memory.
PREFILL_DEFAULTS: Mapping[str, Any] = {
    "q_tile": 32, "kv_tile": 32, "rows_per_thread": 2, "row_lanes": 16, "prefetch": 1,
    "max_k_step": 32, "kv_staging": "direct", "out_tile": "registers"}
KV_STAGING = ("direct", "workgroup")
OUT_TILE = ("registers", "half_workgroup")
# What `attnreg tune` sweeps (48 combinations, its cap).
PREFILL_CHOICES: Mapping[str, tuple[Any, ...]] = {
    "max_k_step": (8, 16, 32, 64), "kv_staging": KV_STAGING, "out_tile": OUT_TILE,
    "q_tile": (4, 16, 32)}
# group_tile: query heads of one GQA group per decode workgroup: the whole group reads its
# K/V once, up to MAX_VECTORS query vectors (heads x m_tile rows) whose accumulators stay in
# registers; lowered further only when workgroup storage demands it.
# From H100 sweeps (bench/webgpu_sweep.py): 16-key tiles over 64 lanes (4 lanes per key
# in QK, 2 PV streams) beat 32x128 by 15-20% in f16 and f32. Kept per dtype for tuning.
DECODE_DEFAULTS: Mapping[str, Mapping[str, int]] = {
    "float16": {"kv_tile": 16, "threads": 64, "group_tile": 16, "prefetch": 1},
    "float32": {"kv_tile": 16, "threads": 64, "group_tile": 16, "prefetch": 1},
    "bfloat16": {"kv_tile": 16, "threads": 64, "group_tile": 16, "prefetch": 1},
}
DECODE_CHOICES: Mapping[str, tuple[Any, ...]] = {"kv_tile": (16, 32), "threads": (64, 128)}
MAX_VECTORS = 16
REDUCE_THREADS = 256
# Halving order when a variant's workgroup storage exceeds the device: (param, floor). The
# last step (kv_tile 4) is for head sizes past 256 in f32 only (512: 4-key tiles of 2 KiB
# rows), which nothing smaller fits in 32 KiB; every spec that fitted before stops earlier.
SHRINK = {
    "prefill": (("kv_tile", 16), ("q_tile", 16), ("kv_tile", 8), ("q_tile", 4),
                ("max_k_step", 8), ("kv_tile", 4)),
    "decode_partial": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
    "decode_qk": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
    "decode_pv": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
}


def _p(params: Mapping[str, Any], defaults: Mapping[str, Any], name: str) -> int:
    return int(params.get(name, defaults[name]))


def _s(params: Mapping[str, Any], defaults: Mapping[str, Any], name: str) -> str:
    return str(params.get(name, defaults[name]))


def _features(dtype: str, *extra: str) -> frozenset[str]:
    return frozenset(({"shader-f16"} if dtype == "float16" else set()) | set(extra))


def _item(spec: AttentionSpec) -> int:
    """Bytes per staged K/V element (wgsl_io's TS): f16 for float16, the bits of bf16 for
    bfloat16 K/V as stored (widened where read), f32 for float32 and for bfloat16's
    dequantized int8/int4 K/V."""
    return wgsl_io.staged_itemsize(spec)


# Where a K/V reader's quantized K/V becomes values (its explain line says so).
_DEQUANT = ("; int8/int4 K/V (kv_dtype) are dequantized in the K/V loads, in f32, before "
            "staging (no dequantized copy)")


# -- prefill ----------------------------------------------------------------------------
def prefill_consts(spec: AttentionSpec, params: Mapping[str, Any],
                   subgroup_width: int = 1) -> dict[str, int]:
    """Tiles of the flash prefill (shaders/flash_prefill.wgsl names them)."""
    d = PREFILL_DEFAULTS
    br = _p(params, d, "q_tile")
    stage = _s(params, d, "kv_staging") == "workgroup"
    step = _p(params, d, "max_k_step")
    bc = _p(params, d, "kv_tile") if stage else step
    step = min(step, bc)
    tr = min(_p(params, d, "rows_per_thread"), br)
    ncg = min(_p(params, d, "row_lanes"), step)
    gs = wgsl_io.granule(spec) // 4                   # vec4s per load granule
    ow = 1 if stage else gs                           # vec4s per output unit
    nu = spec.head_size_v // 4 // ow                  # output units: v's head
    ocu = -(-nu // ncg)
    osl = ocu * ow                                    # output vec4 slots per lane and row
    half = _s(params, d, "out_tile") == "half_workgroup"
    osw = (osl + 1) // 2 if half else 0               # of which in workgroup memory
    return {"BR": br, "BC": bc, "STEP": step, "NSTEP": bc // step, "TR": tr, "NCG": ncg,
            "SGW": min(subgroup_width, ncg), "PREFETCH": int(bool(_p(params, d, "prefetch"))),
            "STAGE": int(stage), "KVS": bc if stage else 1, "OUTW": int(half), "OW": ow,
            "NU": nu, "OCU": ocu, "OSL": osl, "OSR": osl - osw, "OSW": osw,
            "OSZ": max(1, br * ncg * osw)}


def prefill_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    # The subgroup variant shuffles over >= 4 lanes (WebGPU's smallest subgroup), so its
    # cross-lane scratch holds at most NCG/4 values per row.
    sgw = 4 if params.get("reduction") == "subgroup" else 1
    c = prefill_consts(spec, params, sgw)
    hv, vv, e = spec.head_size // 4, spec.head_size_v // 4, _item(spec)
    return (c["BR"] * hv * 16 + c["KVS"] * (hv + 1) * 4 * e + c["KVS"] * vv * 4 * e
            + c["BR"] * c["STEP"] * 4 + c["BR"] * max(1, c["NCG"] // c["SGW"]) * 4
            + c["OSZ"] * 16)


def prefill_threads(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = prefill_consts(spec, params)
    return c["BR"] // c["TR"] * c["NCG"]


# -- decode_partial -----------------------------------------------------------------------
def decode_consts(spec: AttentionSpec, params: Mapping[str, Any],
                  bias_shape: tuple[int, ...] | None = None, op: str = "attention",
                  ) -> dict[str, int]:
    """Tiles of decode_partial and decode_qk. A block-skipping variant over a bias that
    differs per head takes one head per workgroup (GT 1: one block list per workgroup) and,
    for op attention, deals the listed blocks out evenly over the splits (BAL)."""
    d = DECODE_DEFAULTS[spec.dtype]
    blocks = bool(params.get("block_skip"))
    gt = min(spec.group_size, _p(params, d, "group_tile"),
             max(1, MAX_VECTORS // int(params.get("m_tile", 1))))
    if blocks and bias_shape is not None and bias_shape[1] > 1:
        gt = 1
    return {"M": int(params.get("m_tile", 1)), "GT": gt, "BC": _p(params, d, "kv_tile"),
            "WG": _p(params, d, "threads"), "PREFETCH": int(bool(_p(params, d, "prefetch"))),
            "BAL": int(blocks and op == "attention")}


def decode_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = decode_consts(spec, params)
    hv, vv, e, r = spec.head_size // 4, spec.head_size_v // 4, _item(spec), c["M"] * c["GT"]
    hs = max(1, c["WG"] // c["BC"])
    # q_s holds a query, then the merged output: the longer of the two rows
    return (r * max(hv, vv) * 16 + c["BC"] * (hv + 1) * 4 * e + c["BC"] * vv * 4 * e
            + c["BC"] * r * 4 * (1 + hs) + 4 * r * 4)


# -- reduce -------------------------------------------------------------------------------
def reduce_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    return {"WG": REDUCE_THREADS}


def reduce_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    vv = spec.head_size_v // 4              # a partial state's vec4s
    nsg = max(1, REDUCE_THREADS // vv)
    return REDUCE_THREADS * 4 + 1024 * 4 + nsg * vv * 16 + nsg * 4


def stage_consts(family: str, spec: AttentionSpec, params: Mapping[str, Any], *,
                 subgroup_width: int = 1, bias_shape: tuple[int, ...] | None = None,
                 op: str = "attention") -> dict[str, int]:
    """The compile-time constants of one stage (what its WGSL prefix defines)."""
    if family == "prefill":
        return prefill_consts(spec, params, subgroup_width)
    if family in ("decode_partial", "decode_qk"):
        return decode_consts(spec, params, bias_shape, op)
    if family == "decode_pv":
        return pv_consts(spec, params)
    return reduce_consts(spec, params)


def pv_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    """Tiles of decode_pv: its own rows per workgroup (it reads scores, not the query, so
    any row tiling works): up to 4 rows sharing each V tile, the GQA group's heads."""
    d = DECODE_DEFAULTS[spec.dtype]
    m = 4 if spec.seq_len >= 4 else 2 if spec.seq_len >= 2 else 1
    return {"M": m, "GT": min(spec.group_size, _p(params, d, "group_tile"), MAX_VECTORS // m),
            "BC": _p(params, d, "kv_tile"), "WG": _p(params, d, "threads"),
            "PREFETCH": int(bool(_p(params, d, "prefetch")))}


def qk_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = decode_consts(spec, params)
    hv, e, r = spec.head_size // 4, _item(spec), c["M"] * c["GT"]
    hs = max(1, c["WG"] // c["BC"])
    return r * hv * 16 + c["BC"] * (hv + 1) * 4 * e + c["BC"] * r * 4 * (1 + hs)


def pv_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = pv_consts(spec, params)
    vv, e, r = spec.head_size_v // 4, _item(spec), c["M"] * c["GT"]
    return c["BC"] * vv * 4 * e + c["BC"] * r * 4 + r * 8 + r * vv * 16


def variant_aux(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> frozenset[str]:
    """The optional inputs a variant of ``family`` binds for ``spec`` (backends/ports.py):
    the paged block table, the masked-block list, the scales of quantized K/V, the kv_start
    and seqlens_q tensors."""
    return ports.aux_inputs(family, paged=spec.kv_layout == "paged",
                            block_skip=bool(params.get("block_skip")),
                            quant=spec.kv_dtype is not None, kv_start=spec.kv_start,
                            seqlens_q=spec.seqlens_q)


def binding_reasons(family: str, spec: AttentionSpec, caps: DeviceCaps,
                    params: Mapping[str, Any]) -> list[str]:
    """Why the variant binds more storage buffers than the device allows a shader stage
    (WebGPU's default is 8; browsers commonly grant 10, lavapipe 32): every optional input
    is one more (a paged, quantized decode with kv_start and seqlens_q binds 13)."""
    limit = caps.limit("storage_buffers")
    if limit is None:
        return []
    n = sum(p.access != "uniform"
            for p in ports.ports(family, ports.WGSL, variant_aux(family, spec, params)))
    return [] if n <= limit else [
        f"binds {n} storage buffers, device limit is {limit} per shader stage "
        "(maxStorageBuffersPerShaderStage)"]


def _with_bindings(family: str,
                   inner: Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]
                   ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    return lambda spec, caps, params: (binding_reasons(family, spec, caps, params)
                                       or inner(spec, caps, params))


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def v_head_reasons(spec: AttentionSpec, sizes: tuple[int, int, int]) -> list[str]:
    """Why v's head size (v_head_size, Hv) does not fit a kernel whose rows take ``sizes``
    (min, max, multiple of): v is loaded in the granules, staged in the tiles and
    accumulated in the vec4 columns that k's head size needs, so Hv takes the same values
    (the registry checks only head_size)."""
    hv = spec.head_size_v
    lo, hi, step = sizes
    if lo <= hv <= hi and hv % step == 0:
        return []
    return [f"v_head_size {hv} outside {lo}..{hi} step {step}"]


def _thread_check(threads: Callable[[AttentionSpec, Mapping[str, Any]], int]
                  ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    def check(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
        n = threads(spec, params)
        limit = caps.limit("invocations")
        return [] if limit is None or n <= limit else \
            [f"needs {n} invocations per workgroup, device limit is {limit}"]
    return check


def _prefill_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    d = PREFILL_DEFAULTS
    why = v_head_reasons(spec, HEAD_SIZES)
    if why:
        return why
    why = [f"{n}={params.get(n, d[n])!r} is not one of {allowed}" for n, allowed in
           (("kv_staging", KV_STAGING), ("out_tile", OUT_TILE)) if params.get(n, d[n]) not in allowed]
    if why:
        return why
    why = [f"{n}={params.get(n, d[n])} must be a power of two" for n in
           ("q_tile", "kv_tile", "rows_per_thread", "row_lanes", "max_k_step")
           if not _pow2(_p(params, d, n))]
    return why or _thread_check(prefill_threads)(spec, caps, params)


def _pv_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    c = pv_consts(spec, params)
    why = v_head_reasons(spec, HEAD_SIZES) + [f"{n}={c[k]} must be a power of two" for n, k in
           (("kv_tile", "BC"), ("threads", "WG")) if not _pow2(c[k])]
    return why or _thread_check(lambda s, p: pv_consts(s, p)["WG"])(spec, caps, params)


def _decode_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    c = decode_consts(spec, params)
    why = v_head_reasons(spec, HEAD_SIZES) + [f"{n}={c[k]} must be a power of two" for n, k in
           (("kv_tile", "BC"), ("threads", "WG")) if not _pow2(c[k])]
    if c["WG"] < c["M"] * c["GT"]:
        why.append(f"threads={c['WG']} < {c['M'] * c['GT']} query vectors per workgroup")
    return why or _thread_check(lambda s, p: decode_consts(s, p)["WG"])(spec, caps, params)


KV_LAYOUTS = frozenset({"BSNH", "BNSH", "paged"})


def _prefill(dtype: str, variant: str, blocks: bool) -> KernelInfo:
    short = DTYPES[dtype]
    sg = variant == "sg"
    return KernelInfo(
        id=f"{NAME}.prefill.{short}.{variant}" + (".blocks" if blocks else ""), backend=NAME,
        family="prefill", dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES,
        features=_features(dtype, *(("subgroups",) if sg else ())), priority=10 if sg else 0,
        kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES, supports=ALL_FEATURES,
        params={"reduction": "subgroup" if sg else "workgroup", "block_skip": blocks},
        defaults=PREFILL_DEFAULTS, choices=PREFILL_CHOICES, workgroup_storage=prefill_storage,
        extra_checks=_with_bindings(
            "prefill", _block_checks(_prefill_checks) if blocks else _prefill_checks),
        doc="flash attention over q_tile query rows per workgroup, online softmax in steps "
            "of max_k_step keys, K/V staged per kv_tile in workgroup memory or read directly "
            "(kv_staging); row maxima via " + ("subgroup shuffles" if sg else "workgroup memory")
            + ("; visits only the KV blocks the bias's block list keeps" if blocks else "")
            + _DEQUANT)


def _decode(dtype: str, m: int, blocks: bool) -> KernelInfo:
    short = DTYPES[dtype]
    return KernelInfo(
        id=f"{NAME}.decode_partial.{short}.m{m}" + (".blocks" if blocks else ""), backend=NAME,
        family="decode_partial", dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES,
        features=_features(dtype), kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES,
        supports=ALL_FEATURES,
        params={"m_tile": m, "block_skip": blocks}, defaults=DECODE_DEFAULTS[dtype],
        choices=DECODE_CHOICES, workgroup_storage=decode_storage,
        extra_checks=_with_bindings(
            "decode_partial", _block_checks(_decode_checks) if blocks else _decode_checks),
        doc=f"fused QK^T + online softmax + PV per KV split, {m} query row(s) x the GQA "
            "group's heads per workgroup sharing each K/V tile"
            + ("; visits only the listed KV blocks, dealt out evenly over the splits"
               if blocks else "") + _DEQUANT)


REDUCE_HEAD_SIZES = (4, 1024, 4)


def _reduce_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    # the partial states' rows are Hv long: lanes take their vec4 columns
    return v_head_reasons(spec, REDUCE_HEAD_SIZES)


def _block_checks(inner: Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]
                  ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    def check(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
        if not spec.bias:
            return ["block skipping needs a bias to build its block list (spec.bias is False)"]
        return inner(spec, caps, params)
    return check


def declare() -> list[KernelInfo]:
    """The WebGPU kernel variants every WebGPU host can bind: prefill (subgroup /
    workgroup-memory), decode_partial (m_tile 1/2/4), the unfused pair decode_qk (m_tile
    1/2/4) + decode_pv, and reduce, each in f32, f16 and bf16 (computed in f32). The K/V
    readers take contiguous and paged caches (the paged ones bind a block table) and K/V
    stored in the dtype or quantized (int8, int4: they bind the scales too). Every variant
    implements the shapes real models need (supports: kv_start and seqlens_q, bound only
    where the spec has them, and v_head_size)."""
    out: list[KernelInfo] = []
    for dtype, short in DTYPES.items():
        out += [_prefill(dtype, v, False) for v in ("sg", "wgmem")]
        out += [_decode(dtype, m, False) for m in M_TILES]
        for m in M_TILES:
            out.append(KernelInfo(
                id=f"{NAME}.decode_qk.{short}.m{m}", backend=NAME, family="decode_qk",
                dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES, features=_features(dtype),
                kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES, params={"m_tile": m},
                supports=ALL_FEATURES,
                defaults=DECODE_DEFAULTS[dtype],
                choices=DECODE_CHOICES, workgroup_storage=qk_storage,
                extra_checks=_with_bindings("decode_qk", _decode_checks),
                doc=f"unfused decode, kernel 1: QK^T per KV split for {m} query row(s) x the "
                    "GQA group's heads, scores [B,Nq,S,C] f32 and per-split max/sum out"
                    + _DEQUANT))
        out.append(KernelInfo(
            id=f"{NAME}.decode_pv.{short}", backend=NAME, family="decode_pv",
            dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES, features=_features(dtype),
            kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES, defaults=DECODE_DEFAULTS[dtype],
            supports=ALL_FEATURES,
            choices=DECODE_CHOICES, workgroup_storage=pv_storage,
            extra_checks=_with_bindings("decode_pv", _pv_checks),
            doc="unfused decode, kernel 2: normalises decode_qk's scores with the split's "
                "statistics and multiplies by V into the contract's partial states"
                + _DEQUANT))
        out.append(KernelInfo(
            id=f"{NAME}.reduce.{short}", backend=NAME, family="reduce",
            # vec4 columns, one workgroup of 256 lanes per row: any multiple of 4 to 1024
            dtypes=frozenset({dtype}), head_sizes=REDUCE_HEAD_SIZES, features=_features(dtype),
            kv_layouts=KV_LAYOUTS, workgroup_storage=reduce_storage,       # reads no K/V
            supports=ALL_FEATURES, extra_checks=_with_bindings("reduce", _reduce_checks),
            doc="merges split-KV partial states and the head sink into out and lse (padding "
                "rows of seqlens_q take no sink)"))
    return out


def declare_block_skip() -> list[KernelInfo]:
    """The masked-block-skipping variants of prefill and decode_partial (params
    block_skip=True): they bind the bias's block list, which only backends.webgpu's runtime
    builds, so they are declared apart from declare()."""
    out: list[KernelInfo] = []
    for dtype in DTYPES:
        out += [_prefill(dtype, v, True) for v in ("sg", "wgmem")]
        out += [_decode(dtype, m, True) for m in M_TILES]
    return out


def rehome_id(backend: str, webgpu_id: str) -> str:
    """``webgpu.decode_partial.f32.m4`` -> ``<backend>.decode_partial.f32.m4``."""
    prefix = NAME + "."
    if not webgpu_id.startswith(prefix):
        raise ValueError(f"{webgpu_id!r} is not a WebGPU kernel id")
    return f"{backend}.{webgpu_id[len(prefix):]}"


def rehomed(backend: str, host: str, kernels: list[KernelInfo],
            families: tuple[str, ...] | None = None,
            kv_layouts: frozenset[str] = KV_LAYOUTS) -> list[KernelInfo]:
    """These declarations for another host of the same WGSL programs (dawn, browser): same
    variants, params and support checks; the id prefix and backend change, ``host`` is added
    to the doc, and only the families and K/V layouts that host's runtime binds are kept."""
    return [dataclasses.replace(k, id=rehome_id(backend, k.id), backend=backend,
                                kv_layouts=k.kv_layouts & kv_layouts, doc=f"{k.doc} ({host})")
            for k in kernels if families is None or k.family in families]


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None) -> dict[str, int]:
    """Halve the kernel's tiles in SHRINK order until its workgroup storage fits ``limit``;
    returns the params to set (empty when it already fits or nothing can shrink)."""
    return common.fit_tiles(kernel, spec, params, limit, SHRINK.get(kernel.family, ()))
