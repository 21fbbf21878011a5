"""The WebGPU kernel variants, as data: their dtypes, features, K/V layouts and storages, and
the checks that reject a spec or params (head sizes, powers of two, threads, bindings). Their
tunable params, compile-time constants and workgroup storage are in tiles.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attnreg import ports
from attnreg.backends import common
from attnreg.caps import DeviceCaps
from attnreg.kernel import ALL_FEATURES, KernelInfo
from attnreg.spec import AttentionSpec

from .probe import NAME
from .tiles import (
    DECODE_CHOICES,
    DECODE_DEFAULTS,
    DECODE_PARTIAL_CHOICES,
    DECODE_STAGING,
    DIRECT_MAX_REGS,
    KV_STAGE,
    KV_STAGING,
    OUT_TILE,
    PREFILL_CHOICES,
    PREFILL_DEFAULTS,
    PREFILL_OPTIONS,
    QK_LAYOUT,
    REGROW,
    SHRINK,
    _p,
    decode_consts,
    decode_regs,
    decode_storage,
    prefill_storage,
    prefill_threads,
    pv_consts,
    pv_storage,
    qk_storage,
    reduce_storage,
)

# bfloat16 computes in f32 (WGSL has no bf16): loaded and staged as bits in float16's 16-byte
# granules and tile bytes, widened exactly where used, rounded on store.
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# Quantized K/V storages every K/V reader dequantizes in its loads (backends/webgpu/wgsl_io.py).
KV_DTYPES = frozenset({"int8", "int4"})
# Multiples of 8: f16 and bf16 load 8 values per granule. q and k rows up to 576 (MLA's
# decode: q/k 576, v 512) are only staged and dotted, v rows up to 512 are also accumulated:
# O accumulators live in registers, split over a row's lanes (prefill: row_lanes of them,
# decode: up to 64 PV lanes), so 512 / 4 = 128 vec4 columns are 8 per prefill lane and row,
# 2 per decode lane and vector. Larger heads need smaller tiles: the tile-fitting rules
# halve them until the workgroup storage fits (tiles.py SHRINK).
HEAD_SIZES = (8, 576, 8)
V_HEAD_SIZES = (8, 512, 8)
M_TILES = (1, 2, 4)


def _features(dtype: str, *extra: str) -> frozenset[str]:
    return frozenset(({"shader-f16"} if dtype == "float16" else set()) | set(extra))


# Where a K/V reader's quantized K/V becomes values (its explain line says so).
_DEQUANT = ("; int8/int4 K/V (kv_dtype) are dequantized from their codes, in f32, on their "
            "way into the tiles (no dequantized copy)")


def variant_aux(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> frozenset[str]:
    """The optional inputs a variant of ``family`` binds for ``spec`` (attnreg/ports.py):
    the paged block table, the masked-block list, the scales of quantized K/V, the kv_start
    and seqlens_q tensors."""
    return ports.aux_inputs(family, spec, params)


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
    why = [f"{n}={params.get(n, d[n])!r} is not one of {allowed}" for n, allowed in
           (("kv_staging", KV_STAGING), ("out_tile", OUT_TILE), ("qk_layout", QK_LAYOUT),
            ("kv_stage", KV_STAGE)) if params.get(n, d[n]) not in allowed]
    if why:
        return why
    why = [f"{n}={params.get(n, d[n])} must be a power of two" for n in
           ("q_tile", "kv_tile", "rows_per_thread", "row_lanes", "max_k_step")
           if not _pow2(_p(params, d, n))]
    return why or _thread_check(prefill_threads)(spec, caps, params)


def _pv_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    c = pv_consts(spec, params)
    why = [f"{n}={c[k]} must be a power of two" for n, k in
           (("kv_tile", "KV_TILE"), ("threads", "THREADS")) if not _pow2(c[k])]
    return why or _thread_check(lambda s, p: pv_consts(s, p)["THREADS"])(spec, caps, params)


def _decode_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    c = decode_consts(spec, params)
    why = [f"{n}={c[k]} must be a power of two" for n, k in
           (("kv_tile", "KV_TILE"), ("threads", "THREADS")) if not _pow2(c[k])]
    if c["THREADS"] < c["M_TILE"] * c["GROUP_TILE"]:
        why.append(f"threads={c['THREADS']} < {c['M_TILE'] * c['GROUP_TILE']} query vectors "
                   "per workgroup")
    return why or _thread_check(lambda s, p: decode_consts(s, p)["THREADS"])(spec, caps, params)


def _partial_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    """decode_partial's: its kv_staging, then the decode checks."""
    staging = params.get("kv_staging", DECODE_STAGING)
    if staging not in KV_STAGING:
        return [f"kv_staging={staging!r} is not one of {KV_STAGING}"]
    regs = decode_regs(spec, params) if staging == "direct" else 0
    if regs > DIRECT_MAX_REGS:
        return [f"kv_staging='direct' holds {regs} 16-byte K/V units a lane per tile, over "
                f"{DIRECT_MAX_REGS} (the register tile spills): use kv_staging='workgroup' or "
                "a smaller kv_tile"]
    return _decode_checks(spec, caps, params)


KV_LAYOUTS = frozenset({"BSNH", "BNSH", "paged"})


def _prefill(dtype: str, variant: str, blocks: bool) -> KernelInfo:
    short = DTYPES[dtype]
    sg = variant == "sg"
    return KernelInfo(
        id=f"{NAME}.prefill.{short}.{variant}" + (".blocks" if blocks else ""), backend=NAME,
        family="prefill", dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES,
        v_head_sizes=V_HEAD_SIZES,
        features=_features(dtype, *(("subgroups",) if sg else ())), priority=10 if sg else 0,
        kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES, supports=ALL_FEATURES,
        params={"reduction": "subgroup" if sg else "workgroup", "block_skip": blocks},
        defaults=PREFILL_DEFAULTS, choices=PREFILL_CHOICES, options=PREFILL_OPTIONS,
        workgroup_storage=prefill_storage,
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
        v_head_sizes=V_HEAD_SIZES,
        features=_features(dtype), kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES,
        supports=ALL_FEATURES,
        params={"m_tile": m, "block_skip": blocks},
        defaults={**DECODE_DEFAULTS[dtype], "kv_staging": DECODE_STAGING},
        choices=DECODE_PARTIAL_CHOICES, workgroup_storage=decode_storage,
        extra_checks=_with_bindings(
            "decode_partial", _block_checks(_partial_checks) if blocks else _partial_checks),
        doc=f"fused QK^T + online softmax + PV per KV split, {m} query row(s) x the GQA "
            "group's heads per workgroup sharing each K/V tile, read straight into the lanes' "
            "registers or staged in workgroup memory (kv_staging)"
            + ("; visits only the listed KV blocks, dealt out evenly over the splits"
               if blocks else "") + _DEQUANT)


# The partial states' rows are Hv long: lanes take their vec4 columns (the reduce reads no q
# or k, so their head size is only bounded alike).
REDUCE_HEAD_SIZES = (4, 1024, 4)


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
                dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES, v_head_sizes=V_HEAD_SIZES,
                features=_features(dtype), kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES,
                params={"m_tile": m}, supports=ALL_FEATURES,
                defaults=DECODE_DEFAULTS[dtype],
                choices=DECODE_CHOICES, workgroup_storage=qk_storage,
                extra_checks=_with_bindings("decode_qk", _decode_checks),
                doc=f"unfused decode, kernel 1: QK^T per KV split for {m} query row(s) x the "
                    "GQA group's heads, scores [B,Nq,S,C] f32 and per-split max/sum out"
                    + _DEQUANT))
        out.append(KernelInfo(
            id=f"{NAME}.decode_pv.{short}", backend=NAME, family="decode_pv",
            dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES, v_head_sizes=V_HEAD_SIZES,
            features=_features(dtype), kv_layouts=KV_LAYOUTS, kv_dtypes=KV_DTYPES,
            defaults=DECODE_DEFAULTS[dtype],
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
            v_head_sizes=REDUCE_HEAD_SIZES, supports=ALL_FEATURES,
            extra_checks=lambda spec, caps, params: binding_reasons("reduce", spec, caps, params),
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
    """Halve the kernel's tiles in SHRINK order until its workgroup storage fits ``limit``,
    then regrow those REGROW names where room is left; returns the params to set (empty
    when it already fits or nothing can shrink)."""
    return common.fit_tiles(kernel, spec, params, limit, SHRINK.get(kernel.family, ()),
                            regrow=REGROW.get(kernel.family, ()))
