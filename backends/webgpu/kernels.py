"""The WebGPU kernel variants, as data, and the compile-time constants each one derives
from (spec, params): tile sizes, rows per workgroup, query heads per workgroup."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attnreg.caps import DeviceCaps
from attnreg.kernel import KernelInfo
from attnreg.spec import AttentionSpec

from .probe import NAME

DTYPES = {"float32": "f32", "float16": "f16"}
# Every multiple of 8 up to 256: f16 loads 8 halves per granule, and O accumulators live
# in registers (256 / 4 = 64 vec4 columns at most).
HEAD_SIZES = (8, 256, 8)
M_TILES = (1, 2, 4)

# prefetch: load the next K/V tile into registers while the current one is computed.
PREFILL_DEFAULTS: Mapping[str, int] = {"q_tile": 32, "kv_tile": 32, "rows_per_thread": 2,
                                       "row_lanes": 16, "prefetch": 1}
# group_tile: query heads of one GQA group per decode workgroup: the whole group reads its
# K/V once, up to MAX_VECTORS query vectors (heads x m_tile rows) whose accumulators stay in
# registers; lowered further only when workgroup storage demands it.
# From H100 sweeps (backends/webgpu/bench.py): 16-key tiles over 64 lanes (4 lanes per key
# in QK, 2 PV streams) beat 32x128 by 15-20% in f16 and f32. Kept per dtype for tuning.
DECODE_DEFAULTS: Mapping[str, Mapping[str, int]] = {
    "float16": {"kv_tile": 16, "threads": 64, "group_tile": 16, "prefetch": 1},
    "float32": {"kv_tile": 16, "threads": 64, "group_tile": 16, "prefetch": 1},
}
MAX_VECTORS = 16
REDUCE_THREADS = 256
# Halving order when a variant's workgroup storage exceeds the device: (param, floor).
SHRINK = {
    "prefill": (("kv_tile", 16), ("q_tile", 16), ("kv_tile", 8), ("q_tile", 4)),
    "decode_partial": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8)),
}


def _p(params: Mapping[str, Any], defaults: Mapping[str, int], name: str) -> int:
    return int(params.get(name, defaults[name]))


def _features(dtype: str, *extra: str) -> frozenset[str]:
    return frozenset(({"shader-f16"} if dtype == "float16" else set()) | set(extra))


# -- prefill ----------------------------------------------------------------------------
def prefill_consts(spec: AttentionSpec, params: Mapping[str, Any],
                   subgroup_width: int = 1) -> dict[str, int]:
    br = _p(params, PREFILL_DEFAULTS, "q_tile")
    bc = _p(params, PREFILL_DEFAULTS, "kv_tile")
    tr = min(_p(params, PREFILL_DEFAULTS, "rows_per_thread"), br)
    ncg = min(_p(params, PREFILL_DEFAULTS, "row_lanes"), bc)
    return {"BR": br, "BC": bc, "TR": tr, "NCG": ncg, "SGW": min(subgroup_width, ncg),
            "PREFETCH": int(bool(_p(params, PREFILL_DEFAULTS, "prefetch")))}


def prefill_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    # The subgroup variant shuffles over >= 4 lanes (WebGPU's smallest subgroup), so its
    # cross-lane scratch holds at most NCG/4 values per row.
    sgw = 4 if params.get("reduction") == "subgroup" else 1
    c = prefill_consts(spec, params, sgw)
    hv, e = spec.head_size // 4, spec.itemsize
    return (c["BR"] * hv * 16 + c["BC"] * (hv + 1) * 4 * e + c["BC"] * hv * 4 * e
            + c["BR"] * c["BC"] * 4 + c["BR"] * max(1, c["NCG"] // c["SGW"]) * 4)


def prefill_threads(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = prefill_consts(spec, params)
    return c["BR"] // c["TR"] * c["NCG"]


# -- decode_partial -----------------------------------------------------------------------
def decode_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    d = DECODE_DEFAULTS[spec.dtype]
    return {"M": int(params.get("m_tile", 1)),
            "GT": min(spec.group_size, _p(params, d, "group_tile"),
                      max(1, MAX_VECTORS // int(params.get("m_tile", 1)))),
            "BC": _p(params, d, "kv_tile"),
            "WG": _p(params, d, "threads"),
            "PREFETCH": int(bool(_p(params, d, "prefetch")))}


def decode_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = decode_consts(spec, params)
    hv, e, r = spec.head_size // 4, spec.itemsize, c["M"] * c["GT"]
    hs = max(1, c["WG"] // c["BC"])
    return (r * hv * 16 + c["BC"] * (hv + 1) * 4 * e + c["BC"] * hv * 4 * e
            + c["BC"] * r * 4 * (1 + hs) + 4 * r * 4)


# -- reduce -------------------------------------------------------------------------------
def reduce_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    return {"WG": REDUCE_THREADS}


def reduce_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    nsg = max(1, REDUCE_THREADS // (spec.head_size // 4))
    return REDUCE_THREADS * 4 + 1024 * 4 + nsg * (spec.head_size // 4) * 16 + nsg * 4


def stage_consts(family: str, spec: AttentionSpec, params: Mapping[str, Any], *,
                 subgroup_width: int = 1, bias_shape: tuple[int, ...] | None = None,
                 op: str = "attention") -> dict[str, int]:
    """The compile-time constants of one stage (what its WGSL prefix defines)."""
    if family == "prefill":
        return prefill_consts(spec, params, subgroup_width)
    if family == "decode_partial":
        return decode_consts(spec, params)
    return reduce_consts(spec, params)


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
    c = prefill_consts(spec, params)
    why = [f"{n}={c[k]} must be a power of two" for n, k in
           (("q_tile", "BR"), ("kv_tile", "BC"), ("rows_per_thread", "TR"), ("row_lanes", "NCG"))
           if not _pow2(c[k])]
    return why or _thread_check(prefill_threads)(spec, caps, params)


def _decode_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    c = decode_consts(spec, params)
    why = [f"{n}={c[k]} must be a power of two" for n, k in
           (("kv_tile", "BC"), ("threads", "WG")) if not _pow2(c[k])]
    if c["WG"] < c["M"] * c["GT"]:
        why.append(f"threads={c['WG']} < {c['M'] * c['GT']} query vectors per workgroup")
    return why or _thread_check(lambda s, p: decode_consts(s, p)["WG"])(spec, caps, params)


def declare() -> list[KernelInfo]:
    """Every WebGPU kernel variant: prefill (subgroup / workgroup-memory), decode_partial
    (m_tile 1/2/4) and reduce, each in f32 and f16."""
    out: list[KernelInfo] = []
    for dtype, short in DTYPES.items():
        for variant, feats, prio in (("sg", ("subgroups",), 10), ("wgmem", (), 0)):
            out.append(KernelInfo(
                id=f"{NAME}.prefill.{short}.{variant}", backend=NAME, family="prefill",
                dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES,
                features=_features(dtype, *feats), priority=prio,
                params={"reduction": "subgroup" if variant == "sg" else "workgroup"},
                defaults=PREFILL_DEFAULTS, workgroup_storage=prefill_storage,
                extra_checks=_prefill_checks,
                doc="flash attention over q_tile query rows per workgroup, online softmax over "
                    "kv_tile keys; row maxima via " + ("subgroup shuffles" if variant == "sg"
                                                       else "workgroup memory")))
        for m in M_TILES:
            out.append(KernelInfo(
                id=f"{NAME}.decode_partial.{short}.m{m}", backend=NAME, family="decode_partial",
                dtypes=frozenset({dtype}), head_sizes=HEAD_SIZES, features=_features(dtype),
                params={"m_tile": m}, defaults=DECODE_DEFAULTS[dtype],
                workgroup_storage=decode_storage, extra_checks=_decode_checks,
                doc=f"fused QK^T + online softmax + PV per KV split, {m} query row(s) x the "
                    "GQA group's heads per workgroup sharing each K/V tile"))
        out.append(KernelInfo(
            id=f"{NAME}.reduce.{short}", backend=NAME, family="reduce",
            # vec4 columns, one workgroup of 256 lanes per row: any multiple of 4 to 1024
            dtypes=frozenset({dtype}), head_sizes=(4, 1024, 4), features=_features(dtype),
            workgroup_storage=reduce_storage,
            doc="merges split-KV partial states and the head sink into out and lse"))
    return out


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None) -> dict[str, int]:
    """Halve the kernel's tiles in SHRINK order until its workgroup storage fits ``limit``;
    returns the params to set (empty when it already fits or nothing can shrink)."""
    p = {**kernel.defaults, **params, **kernel.params}
    if limit is None or kernel.storage_need(spec, p) <= limit:
        return {}
    changed: dict[str, int] = {}
    for name, floor in SHRINK.get(kernel.family, ()):
        while kernel.storage_need(spec, p) > limit and int(p.get(name, 0)) > floor:
            p[name] = changed[name] = int(p[name]) // 2
    return changed
