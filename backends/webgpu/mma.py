"""The WebGPU matrix-unit kernel variants (flag matrix_units), as data: the flash prefill
(shaders/flash_prefill_mma.wgsl) and the split-KV decode partials (shaders/decode_mma.wgsl)
on subgroup matrices, their tiles, storage and checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from attnreg.backends import common
from attnreg.caps import DeviceCaps
from attnreg.kernel import ALL_FEATURES, KernelInfo, MatrixUnit
from attnreg.spec import AttentionSpec

from .kernels import (
    _DEQUANT,
    DTYPES,
    KV_DTYPES,
    KV_LAYOUTS,
    _features,
    _thread_check,
    _with_bindings,
)
from .probe import NAME
from .tiles import _p

# Dawn's subgroup matrices as the H100 has them: 16x16x16 f16 products in f32, 32-lane
# subgroups. q_tile: query rows per workgroup (16 per subgroup); kv_tile: keys per staged tile.
SUBGROUP_MATRIX = MatrixUnit("subgroup_matrix", 16, 16, 16, "f16", "f32")
MMA_DEFAULTS: Mapping[str, Any] = {"q_tile": 32, "kv_tile": 32, "mma": "hardware"}
MMA_CHOICES: Mapping[str, tuple[Any, ...]] = {"q_tile": (16, 32, 64), "kv_tile": (16, 32, 64)}
# The prefill's direct form (fixed param form="direct": shaders/flash_prefill_mma_direct.wgsl)
# loads Q straight from its stored f16 rows and stages K and V in 16-byte granules (plain f16
# rows: no pages, no quantized K/V), and keeps its Q operands and output tiles in up to 8
# variables each: heads up to 128. Its default q_tile is 64 (4 subgroups share each staged K
# and V tile; it fits 48 KiB with any head the form takes); q_tile 128 (8 subgroups, 47.6 KB
# at H=128 with the O scratch in s_s) is the NVIDIA rule's (rules.py matrix_prefill_rows).
# On the H100 (Dawn) S=2048 took 1401-1403 us at q_tile 64, 4801-4810 at 32
# (ci/results/h100_wgsl_mma_prefill_kstaged.txt).
DIRECT_DEFAULTS: Mapping[str, Any] = {**MMA_DEFAULTS, "q_tile": 64}
DIRECT_CHOICES: Mapping[str, tuple[Any, ...]] = {**MMA_CHOICES, "q_tile": (16, 32, 64, 128)}
DIRECT_HEADS = (32, 128, 16)
DIRECT_V_HEADS = (16, 128, 16)
# q_tile first: the hardware build needs kv_tile >= 32 (see _mma_checks).
MMA_SHRINK = (("q_tile", 16), ("kv_tile", 16))
MMA_SUBGROUP = 32
# Multiples of 16 (the matrix tiles) up to 512 for head_size and v_head_size: the
# accumulators are head_size_v / 16 result tiles per subgroup (prefill) or spread over the
# subgroups (decode); what the workgroup storage cannot hold at the smallest tiles is
# rejected with the bytes it needs. q/k rows past 512 (MLA's 576) are not declared: Q and K
# are staged in f16 whole rows, so at the smallest tiles (16 x 16, one subgroup) q/k 576
# with v 512 needs 56008 B in either family and any q/k past 512 over 36 KiB: more than
# WebGPU devices grant (32 KiB on lavapipe, Dawn and browsers, 48 KiB on NVIDIA), so no
# device could run or check them; the scalar variants run those heads.
HEAD_SIZES = (16, 512, 16)


def mma_prefill_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    d = DIRECT_DEFAULTS if params.get("form") == "direct" else MMA_DEFAULTS
    br, bc = _p(params, d, "q_tile"), _p(params, d, "kv_tile")
    h, hv = spec.head_size, spec.head_size_v
    noc = hv // 16                      # output column tiles (v's head); QK runs over NDC
    c = {"Q_TILE": br, "KV_TILE": bc, "SUBGROUPS": br // 16,
         "THREADS": MMA_SUBGROUP * (br // 16), "DEPTH_TILES": h // 16, "OUT_TILES": noc,
         "KEY_TILES": bc // 16, "Q_STRIDE": h, "K_STRIDE": h, "V_STRIDE": hv,
         "S_STRIDE": bc, "P_STRIDE": bc, "ROW_LANES": 2, "LANE_KEYS": bc // 2,
         # u32 words of a lane's column mask: it writes every other 16-column tile
         "MASK_WORDS": max(1, -(-(-(-noc // 2) * 16) // 32)), "PLAIN_LOGITS": 0}
    if params.get("form") == "direct":
        # rows padded by 16 bytes (the GEMM probe's staged blocks: no pad or 32 bytes were
        # ~40% slower, ci/results/h100_gemm_probe.txt); KV_UNITS: the 16-byte granules of a
        # K or V tile each invocation stages (the longer of the two rows)
        c.update(Q_DIRECT=1, K_STRIDE=h + 8, V_STRIDE=hv + 8, P_STRIDE=bc + 8, S_STRIDE=bc + 4,
                 KV_UNITS=-(-bc * max(h // 8, hv // 8, 1) // c["THREADS"]),
                 # logits without the per-score softcap / bias / ALiBi tests where the spec
                 # has none (mma_common.wgsl's plain_logit)
                 PLAIN_LOGITS=int(not (spec.softcap or spec.bias or spec.alibi_max_bias)))
    c["ROT_DIV"], c["ROT_HF"] = lane_rotation(c["S_STRIDE"], c["P_STRIDE"], c["LANE_KEYS"])
    return c


def _bank_ways(stride: int, lane_keys: int, div: int, hf_step: int, elem: int) -> int:
    """The most distinct 4-byte words one of 32 banks serves when the 32 lanes of a softmax
    subgroup (lane: row lane % 16 of rows `stride` elements of `elem` bytes apart, half lane
    // 16 of the row's 2 * lane_keys scores) touch their e-th score, rotated as
    mma_prefill_common.wgsl's lane_place does, worst over e."""
    worst = 1
    for e in range(lane_keys):
        banks: dict[int, set[int]] = {}
        for lane in range(32):
            rr, hf = lane % 16, lane // 16
            rot = (rr // div + hf * hf_step) % lane_keys
            word = (rr * stride + hf * lane_keys + (e + rot) % lane_keys) * elem // 4
            banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(v) for v in banks.values()))
    return worst


@cache
def lane_rotation(s_stride: int, p_stride: int, lane_keys: int) -> tuple[int, int]:
    """(ROT_DIV, ROT_HF): the softmax lanes' rotation with the fewest bank conflicts on the
    reads of s_s (f32) and then the writes of p_s (f16), the unrotated walk (16, 0) on a tie.
    The direct form's kv_tile 32 (S_STRIDE 36, P_STRIDE 40): 4-way conflicts on both without,
    none on s_s and 2-way on p_s with (1, 0)."""
    options = [(16, 0)] + [(d, h) for d in (1, 2, 4, 8) for h in range(lane_keys)]
    return min(options, key=lambda o: (_bank_ways(s_stride, lane_keys, o[0], o[1], 4),
                                       _bank_ways(p_stride, lane_keys, o[0], o[1], 2)))


def mma_prefill_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = mma_prefill_consts(spec, params)
    br, bc = c["Q_TILE"], c["KV_TILE"]
    # s_s (each subgroup's O scratch in its own rows), p_s, red_s and alpha_s, the flags
    rest = br * c["S_STRIDE"] * 4 + br * c["P_STRIDE"] * 2 + br * 12 + 8
    if c.get("Q_DIRECT"):       # k_s, v_s; the emulation's pair_s; no q_s
        return bc * (c["K_STRIDE"] + c["V_STRIDE"]) * 2 + c["THREADS"] * 4 + rest
    return br * c["Q_STRIDE"] * 2 + bc * (c["K_STRIDE"] + c["V_STRIDE"]) * 2 + rest


# The decode partials: m_tile query rows x the group's heads fill the 16 rows of one M tile;
# subgroups share each staged tile of kv_tile keys (QK deals out key tiles, PV output column
# tiles): wg is the most lanes a workgroup takes, the kernel the most 32-lane subgroups
# within it that divide both counts (head_size 32 and kv_tile 64: 2 subgroups).
# H100 (Dawn, GQA 32/8 H=128 f16, GPU time): 4 subgroups beat 2 everywhere (L=8192 with
# 256-key splits 104 vs 184 us); kv_tile 32 gave wrong products there (HW_MIN_KV_TILE).
DECODE_DEFAULTS: Mapping[str, Any] = {"m_tile": 1, "kv_tile": 64, "wg": 128, "mma": "hardware"}
DECODE_CHOICES: Mapping[str, tuple[Any, ...]] = {
    "m_tile": (1, 2, 4, 8, 16), "kv_tile": (16, 32, 64), "wg": (32, 64, 128)}
DECODE_SHRINK = (("kv_tile", 16), ("wg", 32))
# Hardware builds: the smallest key tile that gave right products on the H100 (below).
HW_MIN_KV_TILE = {"prefill": 32, "decode_partial": 64}


def mma_decode_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    d = DECODE_DEFAULTS
    m, bc, wg = _p(params, d, "m_tile"), _p(params, d, "kv_tile"), _p(params, d, "wg")
    noc, nkc = spec.head_size_v // 16, bc // 16     # output column tiles, key tiles
    nsg = max(1, wg // MMA_SUBGROUP)
    while nsg > 1 and (noc % nsg or nkc % nsg):
        nsg //= 2
    tps = max(1, noc // nsg)
    return {"M_TILE": m, "GROUP_TILE": max(1, min(spec.group_size, 16 // max(1, m))),
            "KV_TILE": bc, "SUBGROUPS": nsg, "THREADS": nsg * MMA_SUBGROUP,
            "DEPTH_TILES": spec.head_size // 16, "OUT_TILES": noc, "KEY_TILES": nkc,
            "SG_TILES": tps, "ROW_LANES": 2 * nsg, "LANE_KEYS": max(1, bc // (2 * nsg)),
            "Q_STRIDE": spec.head_size, "K_STRIDE": spec.head_size,
            "V_STRIDE": spec.head_size_v, "S_STRIDE": bc, "P_STRIDE": bc,
            "MASK_WORDS": max(1, -(-tps * 8 // 32)), "PLAIN_LOGITS": 0}


def mma_decode_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = mma_decode_consts(spec, params)
    h, hv = spec.head_size, spec.head_size_v
    bc = c["KV_TILE"]
    return (16 * h * 2 + bc * (h + hv) * 2 + 16 * bc * (4 + 2) + c["SUBGROUPS"] * 256 * 4
            + 16 * c["ROW_LANES"] * 4 + 16 * 4 + 8)


def consts(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    """The compile-time constants of a matrix variant's module."""
    if family == "prefill":
        return mma_prefill_consts(spec, params)
    return mma_decode_consts(spec, params)


def _decode_tiles(spec: AttentionSpec, params: Mapping[str, Any]) -> list[str]:
    d = DECODE_DEFAULTS
    return [f"{n}={_p(params, d, n)} must be one of {DECODE_CHOICES[n]}"
            for n in ("m_tile", "kv_tile", "wg") if _p(params, d, n) not in DECODE_CHOICES[n]]


def _prefill_tiles(spec: AttentionSpec, params: Mapping[str, Any]) -> list[str]:
    direct = params.get("form") == "direct"
    d, choices = (DIRECT_DEFAULTS, DIRECT_CHOICES) if direct else (MMA_DEFAULTS, MMA_CHOICES)
    return [f"{n}={_p(params, d, n)} must be one of {choices[n]}" for n in ("q_tile", "kv_tile")
            if _p(params, d, n) not in choices[n]]


def _mma_checks(family: str
                ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    return lambda spec, caps, params: _checks(family, spec, caps, params)


def _checks(family: str, spec: AttentionSpec, caps: DeviceCaps,
            params: Mapping[str, Any]) -> list[str]:
    prefill = family == "prefill"
    d = MMA_DEFAULTS if prefill else DECODE_DEFAULTS
    why = _prefill_tiles(spec, params) if prefill else _decode_tiles(spec, params)
    if params.get("mma", d["mma"]) == "hardware" and "subgroup-matrix" in caps.features:
        # The config's own subgroup sizes count (the adapter's range, 4..128 on the H100, is
        # wider): the tiles take lanes 32g..32g+31 of the workgroup as subgroup g.
        m = SUBGROUP_MATRIX
        fits = [c for c in caps.extra.get("subgroup_matrix_configs") or []
                if (c.get("m"), c.get("n"), c.get("k")) == (m.m, m.n, m.k)
                and c.get("component_type") == m.a and c.get("result_component_type") == m.acc]
        if not fits:
            why.append(f"the device's subgroup-matrix configs lack {m.text()}")
        elif not any(c.get("min_subgroup_size") == c.get("max_subgroup_size") == MMA_SUBGROUP
                     for c in fits):
            why.append(f"{m.text()} runs on subgroups of other than exactly {MMA_SUBGROUP} "
                       "lanes, which the kernel's tiles assume")
        # Measured on the H100 (Dawn 0.32 / Tint, NVIDIA's Vulkan driver): a chain of one
        # product per tile (head_size 16: one column tile; kv_tile 16: one key tile) gave
        # wrong results in every case tried, and so did the decode at kv_tile 32 (2 key
        # tiles, 1 or 2 subgroups), while the emulated builds of the same kernels are right;
        # every shape at or above these sizes passed the conformance cells there.
        need = HW_MIN_KV_TILE[family]
        if spec.head_size < 32 or _p(params, d, "kv_tile") < need:
            why.append(f"head_size {spec.head_size} / kv_tile {_p(params, d, 'kv_tile')}: the "
                       f"hardware build needs head_size >= 32 and kv_tile >= {need} (shorter "
                       "product chains gave wrong results on the H100's driver; "
                       "matrix_units=emulate runs this kernel's logic at any size)")
    return why or _thread_check(lambda s, p: consts(family, s, p)["THREADS"])(spec, caps, params)


# family -> (defaults, choices, storage, doc) of its matrix variant
_FAMILIES: Mapping[str, tuple[Mapping[str, Any], Mapping[str, tuple[Any, ...]],
                              Callable[[AttentionSpec, Mapping[str, Any]], int], str]] = {
    "prefill": (
        MMA_DEFAULTS, MMA_CHOICES, mma_prefill_storage,
        "flash prefill on matrix units: S = QK^T and O += PV as 16x16x16 subgroup-matrix "
        "products (f16 in, f32 accumulators), the online softmax (lazy max) in scalar code "
        "between them; q_tile rows (16 per subgroup) x kv_tile keys per tile"),
    "decode_partial": (
        DECODE_DEFAULTS, DECODE_CHOICES, mma_decode_storage,
        "split-KV decode partials on matrix units: a KV head's query heads x m_tile rows "
        "fill the 16 rows of one M tile; S = QK^T and O += PV as 16x16x16 subgroup-matrix "
        "products over kv_tile-key tiles staged in workgroup memory (up to wg / 32 subgroups "
        "share a tile: QK by key tiles, PV by output column tiles), the lazy-max online "
        "softmax between them"),
}


_DIRECT_DOC = (
    "flash prefill on matrix units, Q loaded straight from its stored f16 rows (the row pitch "
    "as the stride), K and V staged by the whole workgroup in 16-byte granules loaded a tile "
    "ahead: per subgroup 16 query rows, its Q operands and output tiles held in registers "
    "across key tiles, S = QK^T and O += PV as 16x16x16 subgroup-matrix products (f16 in, f32 "
    "accumulators), the online softmax (lazy max) on both halves of the subgroup between them, "
    "two workgroup barriers a key tile")


def _direct_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    return mma_prefill_storage(spec, {**params, "form": "direct"})


def _mma_kernel(family: str, dtype: str, direct: bool = False) -> KernelInfo:
    defaults, choices, storage, doc = _FAMILIES[family]
    return KernelInfo(
        id=f"{NAME}.{family}.{DTYPES[dtype]}.mma" + "_direct" * direct, backend=NAME,
        family=family, dtypes=frozenset({dtype}),
        head_sizes=DIRECT_HEADS if direct else HEAD_SIZES,
        v_head_sizes=DIRECT_V_HEADS if direct else HEAD_SIZES, supports=ALL_FEATURES,
        # The direct form first where it applies (flag matrix_units=on / emulate): on the
        # H100 (Dawn) it took 2565 vs 7592 us at S=2048, 258 vs 617 at S=512 with K read from
        # storage (ci/results/h100_wgsl_mma_prefill.txt), 1401 / 155 with K staged
        # (h100_wgsl_mma_prefill_kstaged.txt).
        features=_features(dtype, "subgroup-matrix"), priority=21 if direct else 20,
        kv_layouts=frozenset({"BSNH", "BNSH"}) if direct else KV_LAYOUTS,
        kv_dtypes=frozenset() if direct else KV_DTYPES,
        params={"form": "direct"} if direct else {},
        defaults=DIRECT_DEFAULTS if direct else defaults,
        choices=DIRECT_CHOICES if direct else choices,
        emulation={"mma": "emulate"}, emulates=frozenset({"subgroup-matrix"}),
        matrix=SUBGROUP_MATRIX,
        workgroup_storage=_direct_storage if direct else storage,
        extra_checks=_with_bindings(family, _mma_checks(family)),
        doc=_DIRECT_DOC if direct else doc + _DEQUANT)


def declare_matrix() -> list[KernelInfo]:
    """The matrix-unit variants (flag matrix_units): f16 only, since the matrix units
    multiply f16 (an f32 spec would lose its tolerance)."""
    return [_mma_kernel(f, "float16") for f in _FAMILIES] + [
        _mma_kernel("prefill", "float16", direct=True)]


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None) -> dict[str, int]:
    """A matrix variant's tiles halved in its shrink order until its storage fits."""
    order = MMA_SHRINK if kernel.family == "prefill" else DECODE_SHRINK
    return common.fit_tiles(kernel, spec, params, limit, order)
