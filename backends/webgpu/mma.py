"""The WebGPU matrix-unit kernel variants (flag matrix_units), as data: the flash prefill on
subgroup matrices (shaders/flash_prefill_mma.wgsl), its tiles, storage and checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnreg.backends import common
from attnreg.caps import DeviceCaps
from attnreg.kernel import KernelInfo, MatrixUnit
from attnreg.spec import AttentionSpec

from .kernels import DTYPES, KV_LAYOUTS, _features, _p, _thread_check
from .probe import NAME

# Dawn's subgroup matrices as the H100 has them: 16x16x16 f16 products in f32, 32-lane
# subgroups. q_tile: query rows per workgroup (16 per subgroup); kv_tile: keys per staged tile.
SUBGROUP_MATRIX = MatrixUnit("subgroup_matrix", 16, 16, 16, "f16", "f32")
MMA_DEFAULTS: Mapping[str, Any] = {"q_tile": 32, "kv_tile": 32, "mma": "hardware"}
MMA_CHOICES: Mapping[str, tuple[Any, ...]] = {"q_tile": (16, 32, 64), "kv_tile": (16, 32, 64)}
# q_tile first: the hardware build needs kv_tile >= 32 (see _mma_checks).
MMA_SHRINK = (("q_tile", 16), ("kv_tile", 16))
MMA_SUBGROUP = 32


def mma_prefill_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    d = MMA_DEFAULTS
    br, bc = _p(params, d, "q_tile"), _p(params, d, "kv_tile")
    noc = spec.head_size // 16
    return {"BR": br, "BC": bc, "NSG": br // 16, "WG": MMA_SUBGROUP * (br // 16),
            "NOC": noc, "NKC": bc // 16,
            "QST": spec.head_size, "KST": spec.head_size, "VST": spec.head_size, "SST": bc,
            "PST": bc, "HALF": bc // 2,
            # u32 words of a lane's column mask: it writes every other 16-column tile
            "VW": max(1, -(-(-(-noc // 2) * 16) // 32))}


def mma_prefill_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = mma_prefill_consts(spec, params)
    return (c["BR"] * c["QST"] * 2 + c["BC"] * (c["KST"] + c["VST"]) * 2
            + c["BR"] * c["SST"] * 4 + c["BR"] * c["PST"] * 2 + c["NSG"] * 256 * 4
            + c["BR"] * 12 + 8)


def _mma_checks(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
    d = MMA_DEFAULTS
    why = [f"{n}={_p(params, d, n)} must be 16, 32 or 64" for n in ("q_tile", "kv_tile")
           if _p(params, d, n) not in (16, 32, 64)]
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
        # wrong results in every case tried, while the emulated build of the same kernel
        # is right; every shape with at least two of each passed the conformance cells.
        if spec.head_size < 32 or _p(params, d, "kv_tile") < 32:
            why.append(f"head_size {spec.head_size} / kv_tile {_p(params, d, 'kv_tile')}: the "
                       "hardware build needs head_size >= 32 and kv_tile >= 32 (one product "
                       "per tile gave wrong results on the H100's driver; matrix_units=emulate "
                       "runs this kernel's logic at any size)")
    return why or _thread_check(lambda s, p: mma_prefill_consts(s, p)["WG"])(spec, caps, params)


def _mma_prefill(dtype: str) -> KernelInfo:
    return KernelInfo(
        id=f"{NAME}.prefill.{DTYPES[dtype]}.mma", backend=NAME, family="prefill",
        dtypes=frozenset({dtype}), head_sizes=(16, 256, 16),
        features=_features(dtype, "subgroup-matrix"), priority=20, kv_layouts=KV_LAYOUTS,
        defaults=MMA_DEFAULTS, choices=MMA_CHOICES, emulation={"mma": "emulate"},
        emulates=frozenset({"subgroup-matrix"}),
        matrix=SUBGROUP_MATRIX, workgroup_storage=mma_prefill_storage, extra_checks=_mma_checks,
        doc="flash prefill on matrix units: S = QK^T and O += PV as 16x16x16 subgroup-matrix "
            "products (f16 in, f32 accumulators), the online softmax (lazy max) in scalar code "
            "between them; q_tile rows (16 per subgroup) x kv_tile keys per tile")


def declare_matrix() -> list[KernelInfo]:
    """The matrix-unit variants (flag matrix_units): f16 only, since the matrix units
    multiply f16 (an f32 spec would lose its tolerance)."""
    return [_mma_prefill("float16")]


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None) -> dict[str, int]:
    """The matrix prefill's tiles halved in MMA_SHRINK order until its storage fits."""
    return common.fit_tiles(kernel, spec, params, limit, MMA_SHRINK)
