"""The OpenCL kernel variants as data: ids, dtypes, head sizes, features, defaults and
choices, and the checks and workgroup storage each declares (from tiles.py's geometry)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError
from attnreg.kernel import CORE_FEATURES, MODEL_FEATURES, WINDOW_FEATURES, KernelInfo
from attnreg.spec import AttentionSpec

from . import mma_probe
from .mma import DECODE_CHOICES, DECODE_DEFAULTS, MMA_CHOICES, MMA_DEFAULTS, PTX_MMA_BY_DTYPE
from .probe import NAME
from .tiles import geometry

# q / out dtypes (common.cl: float, half bits, bfloat16 bits; arithmetic in f32 for all)
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# Quantized K/V storages every K/V reader dequantizes in its loads (common.cl KV_Q).
KV_DTYPES = frozenset({"int8", "int4"})
# float4 vectors over the head dimension, tiles shrunk to fit 48 KiB (tiles.py _shrink):
# q and k up to 576 (MLA's decode: q/k 576, v 512), v (v_head_size) up to 512, declared
# apart (v's rows are also accumulated, per lane, in the P.V phase)
HEAD_SIZES = (4, 576, 4)
V_HEAD_SIZES = (4, 512, 4)
# Every kernel implements the contract's features, the shapes real models need included
# (kv_start, seqlens_q, v_head_size: kernels_cl/flash_core.cl's Rows and VOFF), and the
# right window (flash_core.cl's key ranges and key tests).
SUPPORTS = CORE_FEATURES | MODEL_FEATURES | WINDOW_FEATURES
# Tensor cores: q/k up to 576 and v up to 512 too; whether the tiles fit local memory is
# checked apart: at 48 KiB (NVIDIA) the prefill's smallest Q, K and transposed V tiles hold
# head sizes to 496 (q/k 576 with v to 336), the decodes' merge of the warps' O rows takes
# wg 32 at v 512 (mma.py).
MMA_PREFILL_HEADS = (16, 576, 16)
MMA_PREFILL_V_HEADS = (16, 512, 16)
MMA_DECODE_HEADS = (64, 576, 64)     # k in 32-dim runs, v in 64-dim runs (decode_mma.cl)
MMA_DECODE_V_HEADS = (64, 512, 64)
M_TILES = (1, 2, 4)
# The sg variants' emulation (KernelInfo.emulation): the same kernel code with its shuffles
# emulated in local memory, so a device without sub-groups (PoCL) still runs it when forced.
SG_EMULATION = {"sg_impl": "emu"}
MMA_DECODES = ("decode_partial", "decode_fused")
REDUCE_HEADS = (4, 1024, 4)       # merge_states takes whatever head size a caller has


def _mma_checks(family: str, names: tuple[str, ...], defaults: Mapping[str, Any],
                choices: Mapping[str, tuple[Any, ...]]
                ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    """A tensor-core kernel's tiles must be among its declared choices, then fit the device."""
    def check(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
        why = [f"{n}={params.get(n, defaults[n])} must be one of {choices[n]}"
               for n in names if params.get(n, defaults[n]) not in choices[n]]
        if family == "prefill" and spec.kv_dtype is not None and params.get("prefetch") == 2:
            # the asynchronous copies land the bytes as stored: codes are dequantized by the
            # staging stores of prefetch 0 / 1 (kernels_cl/flash_prefill_mma.cl)
            why.append(f"prefetch=2 with kv_dtype {spec.kv_dtype!r}: the asynchronous tiles "
                       "copy float16 / bfloat16 K/V as stored (prefetch 0 or 1 dequantize)")
        if family != "prefill" and spec.kv_dtype == "int4" and \
                {spec.head_size, spec.head_size_v} - {64, 128, 256}:
            # a lane's q4_0 bytes of a key must lie in one block (kernels_cl/mma_kvq.cl)
            why.append(f"int4 K/V with head sizes {spec.head_size} / {spec.head_size_v} (k / "
                       "v): the tensor-core decode reads int4 at head sizes 64, 128 and 256")
        return why or _checks(family, "mma")(spec, caps, params)
    return check


_MMA_DOC = {
    "prefill": "flash prefill on tensor cores: S = QK^T and O += PV as m16n8k16 mma.sync "
               "products (inline PTX; {0} in, f32 accumulators) with S, P and O in registers, "
               "the online softmax (lazy max) between them; q_tile rows (16 per warp) x "
               "kv_tile keys per tile; {0} K/V, or int8 / int4 K/V dequantized to {0} as the "
               "tiles are staged in local memory; prefetch 2 (float16 / bfloat16 K/V): the "
               "tiles stream in by asynchronous copies (cp.async) into two buffers, K's and V's "
               "fragments by ldmatrix",
    "decode_partial": "partial states for the reduce",
    "decode_fused": "in one launch (the last work-group of a row tile merges the splits and "
                    "the sink)",
}
_MMA_DECODE_DOC = ("split-KV decode on tensor cores, {}: a KV head's query heads x m_tile rows "
                   "fill one 16-row M tile; every warp streams its own kv_tile-key chunks from "
                   "global memory straight into mma fragments (no local memory or barrier in "
                   "the key loop{}); {}, head sizes 64..576 step 64 (v: 64..512)")
# What each dtype's tensor-core kernels multiply, and the K/V storages their decodes read.
_MMA_DTYPE_DOC = {
    "float16": ("f16", "; int8 / int4 K/V dequantized into them", "f16"),
    "bfloat16": ("bf16", "; int8 / int4 K/V dequantized into them",
                 "bf16 (mma.sync .bf16, P rounded to bf16)"),
}


def _mma_kernel(family: str, dtype: str) -> KernelInfo:
    """The tensor-core prefill (flash_prefill_mma.cl) or decode (decode_mma.cl) of one dtype
    (float16, or its bfloat16 twin: the same source with -D IS_BF16=1)."""
    prefill = family == "prefill"
    defaults, choices = (MMA_DEFAULTS, MMA_CHOICES) if prefill else \
        (DECODE_DEFAULTS, DECODE_CHOICES)
    names = ("q_tile", "kv_tile") if prefill else ("kv_tile", "wg", "m_tile")
    only, kv_doc, what = _MMA_DTYPE_DOC[dtype]
    return KernelInfo(
        id=f"{NAME}.{family}.{DTYPES[dtype]}.mma", backend=NAME, family=family,
        dtypes=frozenset({dtype}), head_sizes=MMA_PREFILL_HEADS if prefill else MMA_DECODE_HEADS,
        v_head_sizes=MMA_PREFILL_V_HEADS if prefill else MMA_DECODE_V_HEADS,
        supports=SUPPORTS, kv_layouts=PAGED_OK, features=frozenset({mma_probe.FEATURE}),
        priority=20,
        # the prefills dequantize int8 / int4 granules as they stage the tiles (mma_tile.cl
        # kvq_h8), the decodes their runs into f16 / bf16 fragments (mma_kvq.cl)
        kv_dtypes=KV_DTYPES,
        defaults=defaults, choices=choices, emulation={"mma": "emulate"},
        matrix=PTX_MMA_BY_DTYPE[dtype], workgroup_storage=_storage(family, "mma"),
        extra_checks=_mma_checks(family, names, defaults, choices),
        doc=_MMA_DOC[family].format(only) if prefill else
        _MMA_DECODE_DOC.format(_MMA_DOC[family], kv_doc, what))


def _storage(family: str, variant: str) -> Callable[[AttentionSpec, Mapping[str, Any]], int]:
    def need(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
        try:
            return geometry(family, variant, spec, params).storage(spec.head_size)
        except SpecError:
            return 0      # bad params are reported when the launch builds the geometry
    return need


def _checks(family: str, variant: str, block_skip: bool = False
            ) -> Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]:
    def check(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any]) -> list[str]:
        if block_skip and not spec.bias:
            return ["block skipping reads the KV blocks a bias leaves visible: spec.bias is "
                    "False (use the ordinary variant)"]
        try:
            g = geometry(family, variant, spec, params, caps)
        except SpecError as exc:
            return [str(exc)]
        why = []
        inv = caps.limit("invocations")
        if inv is not None and g.wg > inv:
            why.append(f"needs {g.wg} work-items per work-group, device limit is {inv}")
        return why
    return check


PAGED_OK = frozenset({"BSNH", "BNSH", "paged"})
SKIP_DOC = ("; iterates only over the KV blocks the bias leaves visible (CSR block lists, "
            "bias of all-zero blocks not loaded)")


def _info(family: str, variant: str, kid: str, dtype: str, *, block_skip: bool | None = None,
          **kw: Any) -> KernelInfo:
    params = dict(kw.pop("params", {}))
    if block_skip is not None:
        params["block_skip"] = block_skip
    return KernelInfo(id=kid, backend=NAME, family=family, dtypes=frozenset({dtype}),
                      head_sizes=HEAD_SIZES, v_head_sizes=V_HEAD_SIZES, kv_layouts=PAGED_OK,
                      kv_dtypes=KV_DTYPES, supports=SUPPORTS,
                      params=params, workgroup_storage=_storage(family, variant),
                      extra_checks=_checks(family, variant, bool(block_skip)),
                      emulation=SG_EMULATION if variant == "sg" else {}, **kw)


def declare() -> list[KernelInfo]:
    """Every OpenCL variant: prefill (wgmem, sg; each also block-skipping), decode_partial
    (m1/m2/m4, sg; block-skipping m1/m2/m4), decode_fused (m1/m2/m4, sg), the unfused pair
    decode_qk (m1/m2/m4) + decode_pv, reduce, each in f32, f16 and bf16 (the K/V readers
    also over int8 / int4 K/V); and prefill, decode_partial and decode_fused on tensor
    cores (mma) in f16 and bf16 (also over int8 / int4 K/V). Every one
    implements the shapes real models need (kv_start, seqlens_q, v_head_size) and head sizes
    up to 576 for q/k and 512 for v (the tiles shrink to fit; the sub-group prefill's K tile
    of 32 keys needs more than 48 KiB above head size 336 at wg 128, which a device's
    storage limit then rejects, and the tiled prefill runs those heads)."""
    out: list[KernelInfo] = []
    for dtype, tag in DTYPES.items():
        for variant, feats, prio, doc in (
            ("wgmem", frozenset(), 0, "flash prefill, work-group memory only (any device)"),
            ("sg", frozenset({"subgroups"}), 10, "flash prefill, row max/sum/probabilities "
             "through sub-group operations (khr, intel, or NVIDIA warp shuffles)"),
        ):
            for skip in (False, True):
                out.append(_info(
                    "prefill", variant, f"{NAME}.prefill.{tag}.{variant}" + ".bs" * skip,
                    dtype, block_skip=skip, features=feats, priority=prio,
                    defaults={"block_m": 32, "kv_tile": 32, "wg": 128},
                    choices={"block_m": (16, 32), "kv_tile": (32, 64), "wg": (64, 128, 256)},
                    doc=doc + (SKIP_DOC + "; heaviest row tiles first" if skip else "")))
        for m in M_TILES:
            for skip in (False, True):
                out.append(_info(
                    "decode_partial", "", f"{NAME}.decode_partial.{tag}.m{m}" + ".bs" * skip,
                    dtype, block_skip=skip, params={"m_tile": m},
                    defaults={"kv_tile": 32, "wg": 128},
                    choices={"kv_tile": (16, 32, 64), "wg": (64, 128, 256)},
                    doc=f"fused QK^T + online softmax + P.V per KV split, {m} query row(s) x "
                        "the GQA group's heads per work-group, barriers per staged tile"
                        + (SKIP_DOC + "; listed blocks spread evenly over the splits"
                           if skip else "")))
            out.append(_info(
                "decode_partial", "sg", f"{NAME}.decode_partial.{tag}.sg.m{m}", dtype,
                block_skip=False, features=frozenset({"subgroups"}), priority=10,
                params={"m_tile": m}, defaults={"kv_tile": 32, "wg": 128},
                choices={"wg": (64, 128, 256)},
                doc=f"fused split-KV decode, {m} query row(s) x the group's heads; every "
                    "sub-group streams its own key chunks (no barrier in the key loop)"))
            for variant, feats, prio in (("", frozenset(), 0),
                                         ("sg", frozenset({"subgroups"}), 10)):
                sg = ".sg" if variant else ""
                out.append(_info(
                    "decode_fused", variant, f"{NAME}.decode_fused.{tag}{sg}.m{m}", dtype,
                    block_skip=False, features=feats, priority=prio, params={"m_tile": m},
                    defaults={"kv_tile": 32, "wg": 128},
                    choices={"wg": (64, 128, 256)} if variant else
                    {"kv_tile": (16, 32, 64), "wg": (64, 128, 256)},
                    doc=f"split-KV decode in one launch ({'sub-group' if variant else 'tiled'}"
                        f" splits, m_tile {m}): each work-group writes its split's partial "
                        "state; the last to finish a row tile (atomic ticket) merges all "
                        "splits and the sink into out/lse"))
            out.append(_info(
                "decode_qk", "", f"{NAME}.decode_qk.{tag}.m{m}", dtype, block_skip=False,
                params={"m_tile": m}, defaults={"kv_tile": 32, "wg": 128},
                choices={"kv_tile": (16, 32, 64), "wg": (64, 128, 256)},
                doc=f"unfused decode, kernel 1: QK^T scores [B,Nq,S,C] and per-split max/sum "
                    f"({m} query row(s) x the group's heads per work-group)"))
        out.append(_info(
            "decode_pv", "", f"{NAME}.decode_pv.{tag}", dtype,
            defaults={"kv_tile": 32, "wg": 128}, choices={"wg": (64, 128, 256)},
            doc="unfused decode, kernel 2: normalise the scores of a split and multiply by "
                "V into the contract partial states (row tiling follows decode_qk)"))
        # The reduce also serves merge_states, whose head size is anything a caller has.
        out.append(KernelInfo(
            id=f"{NAME}.reduce.{tag}", backend=NAME, family="reduce",
            dtypes=frozenset({dtype}), head_sizes=REDUCE_HEADS, v_head_sizes=REDUCE_HEADS,
            kv_layouts=PAGED_OK,
            supports=SUPPORTS, extra_checks=_checks("reduce", ""),
            doc="merge split-KV partial states and the sink"))
    out.extend(_mma_kernel(f, dtype) for dtype in PTX_MMA_BY_DTYPE
               for f in ("prefill", *MMA_DECODES))
    return out


def variant_of(k: KernelInfo) -> str:
    """'mma' (tensor cores), 'sg', 'wgmem' (prefill) or '' (tiled decode families, reduce)."""
    if k.matrix is not None:
        return "mma"
    if ".sg" in k.id:
        return "sg"
    return "wgmem" if k.family == "prefill" else ""


# kernel id -> (family, variant): what the runtime needs to compile and launch an id.
VARIANTS: dict[str, tuple[str, str]] = {k.id: (k.family, variant_of(k)) for k in declare()}
