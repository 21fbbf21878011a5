"""The block geometry each OpenCL kernel variant compiles and launches with.

Geometry is a pure function of (kernel, spec, params, device limits), so the declared
workgroup storage (kernels.py), the build options and the launch grid (program.py) can never
disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError
from attnreg.spec import AttentionSpec

from .mma import DECODE_DEFAULTS, MMA_DEFAULTS, MMA_IMPLS, mma_decode_storage, mma_storage

ROWS_MAX = 16                     # decode rows (heads x m_tile) per work-group
# Local memory every scalar geometry is shrunk to fit without V staging (tiles halved: see
# _shrink), whatever the device: 48 KiB is NVIDIA's (and most GPUs') per work-group limit,
# so head sizes up to 576 (q/k) and 512 (v) keep their tiles there; PoCL runs the same
# geometry.
STORAGE_BUDGET = 48 * 1024
# Above this head size (q/k or v) the unfused decode's row tiles hold 8 rows, not 16:
# decode_qk and decode_pv must tile rows alike, so theirs follow the spec alone.
WIDE_HEAD = 256
SG_EMULATED = 8                   # sub-group size of the local-memory emulation (tests)
SG_IMPLS = {"khr": 1, "intel": 2, "nv": 3, "emu": 9}
DECODES = ("decode_partial", "decode_fused", "decode_qk", "decode_pv")
NV_SHUFFLE = "nv_warp_shuffle"    # probe.py's feature for NVIDIA's OpenCL (inline PTX)
_F32 = 4


@dataclass(frozen=True)
class Geometry:
    """Everything a variant is compiled and launched with."""

    family: str
    wg: int = 64          # work-items per work-group
    gc: int = 1           # query heads per work-group
    mq: int = 1           # query rows per work-group
    tk: int = 32          # keys per staged tile
    kl: int = 32          # key lanes (score phase)
    dl: int = 32          # float4 dim lanes (P.V phase)
    sg: int = 0           # sub-group size (sg variant), 0 = none
    sg_impl: int = 0
    stage_v: bool = False
    fast_exp: bool = False
    sg_reqd: bool = False     # intel_reqd_sub_group_size(sg) on the kernel
    rp: int = 0               # sg decode: rows padded to a power of two (RP x KC = 32)
    pf: int = 1               # sg decode: chunks in flight ahead of the one computed
    pl2: int = 0              # mma decode: rounds ahead whose chunk is prefetched into L2
    cvt_ptx: bool = False     # f16 -> f32 through PTX cvt.f32.f16, mma P -> f16 / bf16 (NVIDIA)
    nv_fence: bool = False    # decode_fused: PTX membar.gl next to the OpenCL fences (NVIDIA)
    mma: int = 0              # matrix-unit kernels: MMA_IMPLS (0: scalar kernels)
    hv: int = 0               # v's head size (v_head_size; 0: the head size)

    @property
    def rows(self) -> int:
        return self.gc * self.mq

    def storage(self, head_size: int, stage_v: bool | None = None) -> int:
        """Bytes of local memory this geometry declares (V staging optional); V rows (and
        the partial states) are hv long."""
        hv = self.hv or head_size
        if self.family == "reduce":
            return 0
        if self.mma:
            emulate = self.mma == MMA_IMPLS["emulate"]
            if self.family == "prefill":
                return mma_storage(head_size, self.rows, self.tk, emulate, hv, self.pf)
            return mma_decode_storage(hv, self.rows, self.wg, emulate, self.family)
        flag = 1 if self.family == "decode_fused" else 0       # the "last work-group" word
        emu = self.wg if self.sg_impl == SG_IMPLS["emu"] else 0
        if self.family in DECODES and self.sg:
            return ((self.wg // self.sg) * self.rp * (2 + hv) + emu + flag) * _F32
        kp = head_size + 4
        if self.family == "decode_qk":
            return (self.rows * kp + self.tk * kp + 2 * self.rows * self.kl) * _F32
        if self.family == "decode_pv":
            return (self.rows * self.tk + (self.wg // self.dl) * hv + 3 * self.rows) * _F32
        sv = self.stage_v if stage_v is None else stage_v
        words = self.rows * kp + self.tk * kp + (self.tk * hv if sv else 0)
        if self.sg:
            words += emu
        else:
            words += 2 * self.rows * self.tk + 2 * self.rows
        return (words + flag) * _F32

    def n_groups(self, spec: AttentionSpec, n_splits: int = 1) -> int:
        row_tiles = -(-spec.seq_len // self.mq)
        head_chunks = -(-spec.group_size // self.gc)
        return spec.batch * spec.kv_num_heads * n_splits * head_chunks * row_tiles

    def defines(self) -> dict[str, int]:
        return {"WG": self.wg, "GC": self.gc, "MQ": self.mq, "TK": self.tk, "KL": self.kl,
                "DL": self.dl, "SG": self.sg, "SG_IMPL": self.sg_impl,
                "STAGE_V": int(self.stage_v), "FAST_EXP": int(self.fast_exp),
                "SG_REQD": int(self.sg_reqd), "RP": self.rp, "PF": self.pf,
                "CVT_PTX": int(self.cvt_ptx), "NV_FENCE": int(self.nv_fence),
                **({"MMA": self.mma} if self.mma else {}),
                **({"PL2": self.pl2} if self.pl2 else {})}


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _int_param(params: Mapping[str, Any], name: str, default: int, *, pow2: bool = True,
               lo: int = 1, hi: int = 1024) -> int:
    v = params.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or \
            (pow2 and v & (v - 1)):
        raise SpecError(f"params[{name!r}]", v,
                        f"an integer in {lo}..{hi}" + (", a power of two" if pow2 else ""))
    return v


def _sg_size(caps: DeviceCaps | None, impl: str) -> int:
    if impl == "emu":
        return SG_EMULATED
    if caps is not None and caps.subgroup_max_size:
        return caps.subgroup_max_size
    return 32


def sg_impl_for(caps: DeviceCaps | None, params: Mapping[str, Any]) -> str:
    """Which sub-group mechanism a device offers (params may force 'emu' for tests)."""
    forced = params.get("sg_impl")
    if forced is not None:
        if forced not in SG_IMPLS:
            raise SpecError("params['sg_impl']", forced, f"one of {sorted(SG_IMPLS)}")
        return str(forced)
    feats = caps.features if caps is not None else frozenset()
    if "cl_intel_subgroups" in feats:
        return "intel"
    if "cl_khr_subgroups" in feats:
        return "khr"
    return "nv"


def nv_platform(caps: DeviceCaps | None) -> bool:
    """NVIDIA's own OpenCL (inline PTX available), as the probe reports it."""
    return caps is not None and NV_SHUFFLE in caps.features


def _ptx_knob(params: Mapping[str, Any], name: str, caps: DeviceCaps | None) -> bool:
    """Whether the PTX form of a knob (params "cvt", "fence") is built: "ptx" on NVIDIA's
    OpenCL, where the rules choose it (rules.py: opencl_nvidia_ptx_*); "auto" and "cl" build
    the portable OpenCL C, and no other platform has PTX."""
    v = params.get(name, "auto")
    if v not in ("auto", "ptx", "cl"):
        raise SpecError(f"params[{name!r}]", v, "'auto', 'ptx' or 'cl'")
    return nv_platform(caps) and v == "ptx"


def geometry(family: str, variant: str, spec: AttentionSpec, params: Mapping[str, Any],
             caps: DeviceCaps | None = None) -> Geometry:
    """Block sizes for one launch. ``caps`` None gives the device-independent minimum
    (no V staging), which is what the kernel declares as its workgroup storage."""
    hv4 = spec.head_size_v // 4
    if variant == "mma":
        return (mma_geometry(spec, params, caps) if family == "prefill" else
                mma_decode_geometry(spec, params, caps, family))
    if family == "reduce":
        return Geometry("reduce", wg=hv4 * max(1, 256 // hv4),
                        fast_exp=bool(params.get("fast_exp", False)), hv=spec.head_size_v)
    wg = _int_param(params, "wg", 128, lo=32, hi=1024)
    tile = _int_param(params, "kv_tile", 32, lo=4, hi=256)
    big = spec.head_size > 128          # halve tiles so K/Q tiles stay within 48 KiB
    dl = min(_pow2_ceil(hv4), wg)       # the P.V phase's lanes over v's float4 groups
    # Per-head block lists (a bias with Nq > 1 heads) need one head per work-group.
    per_head = int(params.get("bias_heads", 1)) > 1 and bool(params.get("block_skip"))
    if family in DECODES:
        m = int(params.get("m_tile", 1))
        wide = max(spec.head_size, spec.head_size_v) > WIDE_HEAD
        gc = 1 if per_head else min(spec.group_size, max(1, (ROWS_MAX // 2 if wide
                                                              else ROWS_MAX) // m))
        tk = max(4, tile // 2) if big else tile
        kl = min(tk, wg)
        g = Geometry(family, wg=wg, gc=gc, mq=m, tk=tk, kl=kl, dl=dl)
        if variant == "sg":
            impl = sg_impl_for(caps, params)
            sg = 32 if impl in ("emu", "nv") else _sg_size(caps, impl)
            if sg != 32 or wg % 32:
                raise SpecError("sub-group size", sg, "32 lanes and wg a multiple of 32 "
                                "(the sg decode maps 32 dot products onto 32 lanes)")
            if impl == "khr" and caps is not None and \
                    "cl_khr_subgroup_shuffle" not in caps.features:
                raise SpecError("sub-groups", "cl_khr_subgroups",
                                "cl_khr_subgroup_shuffle too (the sg decode shuffles by xor)")
            pf = _int_param(params, "prefetch", 1, lo=1, hi=2)
            g = Geometry(family, wg=wg, gc=gc, mq=m, tk=tk, kl=kl, dl=dl, sg=32,
                         sg_impl=SG_IMPLS[impl], rp=_pow2_ceil(gc * m), pf=pf)
    elif variant == "sg":
        impl = sg_impl_for(caps, params)
        sg = _sg_size(caps, impl)
        if wg % sg:
            raise SpecError("params['wg']", wg, f"a multiple of the sub-group size {sg}")
        block = _int_param(params, "block_m", 32, lo=1, hi=256)
        rows = max(wg // sg, block // 4 if big else block)
        gc = 1 if per_head else min(_pow2_floor(spec.group_size), max(1, rows // 8))
        reqd = impl == "intel" and caps is not None and \
            "cl_intel_required_subgroup_size" in caps.features
        g = Geometry(family, wg=wg, gc=gc, mq=rows // gc, tk=max(tile, sg), kl=min(tile, wg),
                     dl=dl, sg=sg, sg_impl=SG_IMPLS[impl], sg_reqd=reqd)
    else:
        block = _int_param(params, "block_m", 32, lo=1, hi=256)
        rows = max(1, block // 2) if big else block
        gc = 1 if per_head else min(_pow2_floor(spec.group_size), max(1, rows // 8))
        tk = max(8, tile // 2) if big else tile
        kl = min(8, tk)
        g = Geometry(family, wg=wg, gc=gc, mq=max(1, rows // gc), tk=tk, kl=kl, dl=dl)
    g = _shrink(replace(g, hv=spec.head_size_v), spec, variant)
    changes: dict[str, Any] = {}
    if params.get("fast_exp"):
        changes["fast_exp"] = True
    if spec.dtype == "float16":
        changes["cvt_ptx"] = _ptx_knob(params, "cvt", caps)
    if family == "decode_fused":
        changes["nv_fence"] = _ptx_knob(params, "fence", caps)
    if changes:
        g = Geometry(**{**g.__dict__, **changes})
    if g.rows > g.wg:
        raise SpecError("params", dict(params), f"at most wg={g.wg} rows per work-group")
    if caps is not None and family in ("prefill", "decode_partial", "decode_fused"):
        # Stage V through local memory when the device has the room (forceable off/on).
        limit = caps.limit("workgroup_storage") or 0
        want = params.get("stage_v")
        fits = g.storage(spec.head_size, True) <= min(limit, 48 * 1024)
        stage = bool(want) if want is not None else fits
        g = Geometry(**{**g.__dict__, "stage_v": stage})
    return g


def _halve_rows(g: Geometry, floor: int, heads_only: bool = False) -> Geometry | None:
    """Halve the rows (query rows first, then heads; a decode keeps its m_tile), or None at
    ``floor`` rows."""
    if g.rows <= floor or (heads_only and g.gc == 1):
        return None
    return replace(g, mq=g.mq // 2) if g.mq > 1 and not heads_only else replace(g, gc=g.gc // 2)


def _shrink(g: Geometry, spec: AttentionSpec, variant: str) -> Geometry:
    """Halve a scalar geometry's tiles until its local memory (without V staging) fits
    STORAGE_BUDGET: wide heads (q/k up to 576, v up to 512) then run everywhere the smaller
    tiles do. Keys per tile first (down to 8), then rows, then keys down to 4; the sub-group
    variants keep a sub-group's worth of keys and rows, decode_qk / decode_pv their rows
    (they must agree) and the sub-group decode only has rows to halve. Geometries that
    already fit are unchanged; what cannot shrink enough is reported by the storage check."""
    fam, h = g.family, spec.head_size
    while g.storage(h, False) > STORAGE_BUDGET:
        nxt: Geometry | None = None
        if fam in DECODES and g.sg:
            if g.gc > 1:
                gc = g.gc // 2
                nxt = replace(g, gc=gc, rp=_pow2_ceil(gc * g.mq))
        elif fam in ("decode_qk", "decode_pv"):
            if g.tk > 4:
                nxt = replace(g, tk=g.tk // 2, kl=min(g.kl, g.tk // 2))
        elif variant == "sg":                       # the sub-group prefill
            if g.tk > g.sg:
                nxt = replace(g, tk=g.tk // 2, kl=min(g.kl, g.tk // 2))
            else:
                nxt = _halve_rows(g, g.wg // g.sg)
        else:                                       # the tiled prefill and decodes
            if g.tk > 8:
                nxt = replace(g, tk=g.tk // 2, kl=min(g.kl, g.tk // 2))
            else:
                nxt = _halve_rows(g, 1, heads_only=fam != "prefill")
                if nxt is None and g.tk > 4:
                    nxt = replace(g, tk=g.tk // 2, kl=min(g.kl, g.tk // 2))
        if nxt is None:
            break
        g = nxt
    return g


# -- tensor cores: prefill (kernels_cl/flash_prefill_mma.cl), decode (decode_mma.cl) ----------
def _mma_build(params: Mapping[str, Any], spec: AttentionSpec, caps: DeviceCaps | None,
               default: str) -> dict[str, Any]:
    """The Geometry fields of the build the param "mma" names: the primitive (MMA_IMPLS), the
    sub-group mechanism (NVIDIA warps, or the emulation's) and the PTX conversions (f16 -> f32
    and P's f32 -> f16 / bf16 rounding, mma_sync.cl's mma_pack_h2)."""
    build = params.get("mma", default)
    if build not in MMA_IMPLS:
        raise SpecError("params['mma']", build, f"one of {sorted(MMA_IMPLS)}")
    emulate = build == "emulate"
    return {"mma": MMA_IMPLS[build], "sg": 32, "sg_impl": SG_IMPLS["emu" if emulate else "nv"],
            "cvt_ptx": not emulate and spec.dtype in ("float16", "bfloat16")
            and _ptx_knob(params, "cvt", caps)}


def mma_geometry(spec: AttentionSpec, params: Mapping[str, Any],
                 caps: DeviceCaps | None = None) -> Geometry:
    """The tensor-core prefill's geometry: q_tile rows (GC heads of the GQA group x MQ rows,
    whole warps per head), kv_tile keys, the build the param "mma" names."""
    d = MMA_DEFAULTS
    br = _int_param(params, "q_tile", d["q_tile"], lo=16, hi=128)
    bc = _int_param(params, "kv_tile", d["kv_tile"], lo=16, hi=64)
    nw = br // 16
    gc = min(_pow2_floor(spec.group_size), nw)
    return Geometry("prefill", wg=32 * nw, gc=gc, mq=br // gc, tk=bc, kl=min(8, bc),
                    dl=min(_pow2_ceil(spec.head_size_v // 4), 32 * nw), hv=spec.head_size_v,
                    pf=_int_param(params, "prefetch", d["prefetch"], pow2=False, lo=0, hi=2),
                    **_mma_build(params, spec, caps, d["mma"]))


def mma_decode_geometry(spec: AttentionSpec, params: Mapping[str, Any],
                        caps: DeviceCaps | None = None, family: str = "decode_partial"
                        ) -> Geometry:
    """The tensor-core decode's geometry (kernels_cl/decode_mma.cl): m_tile query rows x as
    many of the group's heads as fill 16 rows, wg / 32 warps streaming kv_tile-key chunks."""
    d = DECODE_DEFAULTS
    wg = _int_param(params, "wg", d["wg"], lo=32, hi=256)
    tk = _int_param(params, "kv_tile", d["kv_tile"], lo=16, hi=64)
    mq = _int_param(params, "m_tile", d["m_tile"], lo=1, hi=16)
    gc = min(spec.group_size, 16 // mq)
    return Geometry(family, wg=wg, gc=gc, mq=mq, tk=tk, kl=min(8, tk), dl=32, hv=spec.head_size_v,
                    pf=_int_param(params, "prefetch", d["prefetch"], lo=0, hi=1),
                    pl2=_int_param(params, "l2_prefetch", d["l2_prefetch"], pow2=False, lo=0,
                                   hi=4),
                    nv_fence=family == "decode_fused" and _ptx_knob(params, "fence", caps),
                    **_mma_build(params, spec, caps, d["mma"]))
