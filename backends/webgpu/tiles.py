"""The WebGPU kernels' tiles: each variant's tunable params (defaults, what `attnreg tune`
sweeps, the halving order that fits workgroup storage) and the compile-time constants and
workgroup storage each WGSL program derives from (spec, params). kernels.py declares the
variants that use them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnreg.spec import AttentionSpec

from . import wgsl_io

# prefetch: load the next K/V tile into registers while the current one is computed.
# max_k_step: keys per inner step (their scores live in private memory); kv_staging:
# "workgroup" stages kv_tile-key K/V tiles in workgroup memory for the whole workgroup,
# "direct" lets each row group read K/V straight from memory (no staging, no K/V barriers);
# out_tile: "registers" keeps the output accumulator in registers, "half_workgroup" moves
# half of each lane's output columns to workgroup memory.
# qk_layout (kv_staging "workgroup" only): "keys" has each lane of a row group dot whole rows
# of q (from workgroup memory) with its own keys; "sliced" has the lanes split the head
# dimension, q in registers, scores reduce-scattered by shuffles (flash_prefill_steps.wgsl
# says how; row_lanes a power of two). kv_stage: staged K/V tiles as loaded ("native": f16,
# bf16 bits) or converted once to "f32".
QK_LAYOUT = ("keys", "sliced")
KV_STAGE = ("native", "f32")
PREFILL_DEFAULTS: Mapping[str, Any] = {
    "q_tile": 32, "kv_tile": 32, "rows_per_thread": 2, "row_lanes": 16, "prefetch": 1,
    "max_k_step": 32, "kv_staging": "direct", "out_tile": "registers", "qk_layout": "keys",
    "kv_stage": "native"}
KV_STAGING = ("direct", "workgroup")
OUT_TILE = ("registers", "half_workgroup")
# What `attnreg tune` sweeps (48 combinations, its cap).
PREFILL_CHOICES: Mapping[str, tuple[Any, ...]] = {
    "max_k_step": (8, 16, 32, 64), "kv_staging": KV_STAGING, "out_tile": OUT_TILE,
    "q_tile": (4, 16, 32)}
# What rules (rules.py's sliced prefill on NVIDIA) or users set, not swept.
PREFILL_OPTIONS: Mapping[str, tuple[Any, ...]] = {"qk_layout": QK_LAYOUT, "kv_stage": KV_STAGE}
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
# decode_partial's kv_staging (the prefill's values): "direct" has every lane load the K and V
# granules it computes with straight from memory into registers (next tile's loads in flight
# during this tile's compute), "workgroup" stages K/V tiles in workgroup memory first (the
# register tile per lane is then one kv_tile's share, whatever the head size). The rule
# webgpu_decode_kv_staging picks per spec (rules.py says why).
DECODE_STAGING = "direct"
# 16-byte load units a lane of the direct decode_partial may hold per tile (decode_regs; twice
# that with the next tile's loads in flight). Past it the register tile spills: on the H100,
# 24 units (int8 K/V, kv_tile 64) took 2.2-2.6 ms where 12 took 78 us, and Dawn's build of it
# computed values 2.4e-3 off (ci/results/h100_wgsl_decode.txt). The staged tiles hold any head.
DIRECT_MAX_REGS = 16
# A QK lane of the direct decode_partial holds its q in registers (decode_q_regs) where its q
# takes at most Q_REG_VEC4S vec4s and its q and both register tiles (this tile's load units
# and the next's: 2 x decode_regs x 4 words) at most LANE_REGS registers; otherwise it reads q
# from workgroup memory every tile. Held in registers q took the H200's f16 GQA 32/8 H=128
# decode at L=32768 from 70.6-71.1 to 66.4-67.5 us per launch on Dawn (b2b 58.0-58.3 ->
# 54.4-55.2), wgpu-native 67.1-67.9 -> 63.6-64.5: read from workgroup memory, a 16-byte load fed 4 FMAs,
# and shared memory's 128 bytes a clock an SM, not the arithmetic nor DRAM, had set the pace.
# Past the budgets it spilled: 64 vec4s (int8 32-key tiles) 116.9 us against 76.8; f32 L=8192
# (32 vec4s of q, 16 units a tile: 256 registers) 57.2 against 41.6
# (ci/results/h200_wgsl_decode_q_regs.txt). f16's 32 vec4s and 8 units make 192.
Q_REG_VEC4S = 32
LANE_REGS = 192
DECODE_PARTIAL_CHOICES: Mapping[str, tuple[Any, ...]] = {**DECODE_CHOICES,
                                                          "kv_staging": KV_STAGING}
MAX_VECTORS = 16
REDUCE_THREADS = 256
# Halving order when a variant's workgroup storage exceeds the device: (param, floor). The
# last step (kv_tile 4) is for head sizes past 256 in f32 only (512, and MLA's q/k 576 with
# v 512: 4-key tiles of 2 KiB rows), which nothing smaller fits in 32 KiB; every spec that
# fitted before stops earlier.
SHRINK = {
    "prefill": (("kv_tile", 16), ("q_tile", 16), ("kv_tile", 8), ("q_tile", 4),
                ("max_k_step", 8), ("kv_tile", 4)),
    "decode_partial": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
    "decode_qk": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
    "decode_pv": (("kv_tile", 16), ("group_tile", 1), ("kv_tile", 8), ("kv_tile", 4)),
}
# Tiles that take back, doubling, what the later halvings made room for: group_tile is how
# many of a GQA group's heads share each K/V tile, which MLA's groups of 16-128 heads on
# one KV head depend on (lavapipe, f16 q/k 576 v 512, 64 heads, L=2048, kv_tile 8:
# group_tile 1 1237 ms, 2 719 ms, 4 372 ms).
REGROW = {"decode_partial": ("group_tile",), "decode_qk": ("group_tile",),
          "decode_pv": ("group_tile",)}


def _p(params: Mapping[str, Any], defaults: Mapping[str, Any], name: str) -> int:
    return int(params.get(name, defaults[name]))


def _s(params: Mapping[str, Any], defaults: Mapping[str, Any], name: str) -> str:
    return str(params.get(name, defaults[name]))


def _item(spec: AttentionSpec) -> int:
    """Bytes per staged K/V element (wgsl_io's TS): f16 for float16, the bits of bf16 for
    bfloat16 K/V as stored (widened where read), f32 for float32 and for bfloat16's
    dequantized int8/int4 K/V."""
    return wgsl_io.staged_itemsize(spec)


# -- prefill ----------------------------------------------------------------------------
def prefill_consts(spec: AttentionSpec, params: Mapping[str, Any],
                   subgroup_width: int = 1) -> dict[str, int]:
    """Tiles of the flash prefill (shaders/flash_prefill_steps.wgsl names them)."""
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
    sliced = stage and _s(params, d, "qk_layout") == "sliced"
    f32 = stage and _s(params, d, "kv_stage") == "f32"
    return {"SLICED": int(sliced),
            "SLICE_LEVELS": ncg.bit_length() - 1 if sliced else 0,   # log2(row_lanes)
            "KV_F32": int(f32), "Q_TILE": br, "KV_TILE": bc, "K_STEP": step, "STEPS": bc // step,
            "ROWS_PER_LANE": tr, "ROW_LANES": ncg, "SHUFFLE_LANES": min(subgroup_width, ncg),
            "PREFETCH": int(bool(_p(params, d, "prefetch"))), "STAGED": int(stage),
            "STAGED_KEYS": bc if stage else 1, "O_SPLIT": int(half), "OUT_UNIT": ow,
            "OUT_UNITS": nu, "LANE_UNITS": ocu, "LANE_SLOTS": osl, "REG_SLOTS": osl - osw,
            "WG_SLOTS": osw, "O_S_SIZE": max(1, br * ncg * osw),
            # logits without logit_b's per-score softcap / bias / ALiBi tests where the spec
            # has none (attn_keys.wgsl's plain_logit; Dawn on the H200, S=2048: 2108-2111 us
            # against 2205-2208, ci/results/h200_wgsl_scalar_prefill.txt)
            "PLAIN_LOGITS": int(not (spec.softcap or spec.bias or spec.alibi_max_bias))}


def prefill_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    # The subgroup variant shuffles over >= 4 lanes (WebGPU's smallest subgroup), so its
    # cross-lane scratch holds at most NCG/4 values per row.
    sgw = 4 if params.get("reduction") == "subgroup" else 1
    c = prefill_consts(spec, params, sgw)
    hv, vv = spec.head_size // 4, spec.head_size_v // 4
    f32 = bool(c["KV_F32"])
    e = 4 if f32 else _item(spec)
    # SLICED holds q in registers; the K/V tiles a build does not use hold one entry each
    q_s = 16 if c["SLICED"] else c["Q_TILE"] * hv * 16
    unused = 2 * 4 * _item(spec) if f32 else 2 * 16
    return (q_s + unused + c["STAGED_KEYS"] * (hv + 1) * 4 * e
            + c["STAGED_KEYS"] * vv * 4 * e + c["Q_TILE"] * c["K_STEP"] * 4
            + c["Q_TILE"] * max(1, c["ROW_LANES"] // c["SHUFFLE_LANES"]) * 4
            + c["O_S_SIZE"] * 16)


def prefill_threads(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = prefill_consts(spec, params)
    return c["Q_TILE"] // c["ROWS_PER_LANE"] * c["ROW_LANES"]


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
    return {"M_TILE": int(params.get("m_tile", 1)), "GROUP_TILE": gt,
            "KV_TILE": _p(params, d, "kv_tile"), "THREADS": _p(params, d, "threads"),
            "PREFETCH": int(bool(_p(params, d, "prefetch"))),
            "BALANCE": int(blocks and op == "attention"),
            # decode_qk_common.wgsl's tile_plain: logits without vec_logit's tests
            "PLAIN_LOGITS": int(not (spec.softcap or spec.bias or spec.alibi_max_bias))}


def decode_direct(params: Mapping[str, Any]) -> int:
    """1 where decode_partial reads K/V straight into registers (kv_staging "direct")."""
    return int(str(params.get("kv_staging", DECODE_STAGING)) == "direct")


def _slice_units(spec: AttentionSpec, c: Mapping[str, int]) -> tuple[int, int, int]:
    """The direct QK layout of decode_qk_common.wgsl: (elements a K load unit, SLICES lanes
    a key, SLICE_UNITS units a lane's slice)."""
    ue = 4 * wgsl_io.kv_unit(spec) or wgsl_io.granule(spec)
    slices = max(1, c["THREADS"] // c["KV_TILE"])
    return ue, slices, -(-(spec.head_size // ue) // slices)


def decode_regs(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    """16-byte load units a lane of the direct decode_partial holds per K/V tile: its QK
    share of K (passes x slice) and its PV share of V (keys of its stream x columns), as
    shaders/decode_qk_common.wgsl and decode_pv_common.wgsl lay them out (a unit: a granule,
    or 16 bytes of quantized codes, wgsl_io.kv_unit)."""
    c = decode_consts(spec, params)
    ue, slices, slice_units = _slice_units(spec, c)
    ve = 8 if spec.kv_dtype and wgsl_io.kv_unit(spec) else ue  # a V unit (kv_units.wgsl)
    bc, th = c["KV_TILE"], c["THREADS"]
    k = bc // min(bc, th // slices) * slice_units
    vu = max(1, spec.head_size_v // ve)
    pv_lanes = min(th, vu)
    return k + -(-bc // (th // pv_lanes)) * -(-vu // pv_lanes)


def decode_q_regs(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    """1 where a QK lane of the direct decode_partial holds its q in registers: its slice's
    load units (SLICE_UNITS in decode_qk_common.wgsl) of every query vector, within
    Q_REG_VEC4S and, with the lane's two register tiles, LANE_REGS. The staged tiles read q_s
    (whisper's took the same time either way: ci/results/h200_wgsl_decode_q_regs.txt)."""
    if not decode_direct(params):
        return 0
    c = decode_consts(spec, params)
    ue, _, slice_units = _slice_units(spec, c)
    q_vec4s = slice_units * (ue // 4) * c["M_TILE"] * c["GROUP_TILE"]
    # this tile's load units and the next's, 4 words each
    return int(q_vec4s <= Q_REG_VEC4S and 4 * q_vec4s + 8 * decode_regs(spec, params) <= LANE_REGS)


def decode_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = decode_consts(spec, params)
    hv, vv, e = spec.head_size // 4, spec.head_size_v // 4, _item(spec)
    r, bc = c["M_TILE"] * c["GROUP_TILE"], c["KV_TILE"]
    hs = max(1, c["THREADS"] // bc)
    staged = 1 - decode_direct(params)     # the direct path's k_s / v_s are one element
    # q_s holds a query, then the merged output: the longer of the two rows
    return (r * max(hv, vv) * 16 + staged * (bc * (hv + 1) * 4 * e + bc * vv * 4 * e)
            + bc * r * 4 * (1 + hs) + 4 * r * 4)


# -- reduce -------------------------------------------------------------------------------
def reduce_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    return {"THREADS": REDUCE_THREADS}


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
        direct = decode_direct(params) if family == "decode_partial" else 0
        # the direct loads take quantized K/V in 16-byte units where rows are whole units
        wide = int(bool(direct and wgsl_io.kv_unit(spec)))
        return {**decode_consts(spec, params, bias_shape, op), "DIRECT": direct, "KV_WIDE": wide,
                "Q_IN_REGS": decode_q_regs(spec, params) if family == "decode_partial" else 0}
    if family == "decode_pv":
        return {**pv_consts(spec, params), "DIRECT": 0}
    return reduce_consts(spec, params)


def pv_consts(spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    """Tiles of decode_pv: its own rows per workgroup (it reads scores, not the query, so
    any row tiling works): up to 4 rows sharing each V tile, the GQA group's heads."""
    d = DECODE_DEFAULTS[spec.dtype]
    m = 4 if spec.seq_len >= 4 else 2 if spec.seq_len >= 2 else 1
    return {"M_TILE": m,
            "GROUP_TILE": min(spec.group_size, _p(params, d, "group_tile"), MAX_VECTORS // m),
            "KV_TILE": _p(params, d, "kv_tile"), "THREADS": _p(params, d, "threads"),
            "PREFETCH": int(bool(_p(params, d, "prefetch")))}


def qk_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = decode_consts(spec, params)
    hv, e, r, bc = spec.head_size // 4, _item(spec), c["M_TILE"] * c["GROUP_TILE"], c["KV_TILE"]
    hs = max(1, c["THREADS"] // bc)
    return r * hv * 16 + bc * (hv + 1) * 4 * e + bc * r * 4 * (1 + hs)


def pv_storage(spec: AttentionSpec, params: Mapping[str, Any]) -> int:
    c = pv_consts(spec, params)
    vv, e, r, bc = spec.head_size_v // 4, _item(spec), c["M_TILE"] * c["GROUP_TILE"], c["KV_TILE"]
    return bc * vv * 4 * e + bc * r * 4 + r * 8 + r * vv * 16
