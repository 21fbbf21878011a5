"""The OpenCL plugin's rules, as data: each says why in one sentence and names the
ci/results/ files that measured it (PoCL in CI, NVIDIA's OpenCL on the H100). They run after
the built-in rules, so they see the route and split geometry those chose."""

from __future__ import annotations

from attnreg.plan import SplitGeometry
from attnreg.rules import RULE_NUMBERS, Ctx, Rule

from . import kernels, mma, probe, tiles

# The ci/results/ files the rules cite (RULE_NUMBERS: measurements kept only as numbers).
SPLIT_SWEEP = "ci/results/h100_split_sweep.txt"
PREFILL_ASYNC = "ci/results/h100_prefill_async.txt"
MMA_BENCH = "ci/results/h100_mma_bench.txt"
MMA_DECODE_BENCH = "ci/results/h100_bench_mma_decode.txt"
PEERS = "ci/results/h100_peers.txt"
DECODE_ROWS_L2 = "ci/results/h100_decode_rows_l2.txt"
DECODE_LOADS = "ci/results/h100_decode_loads.txt"
DECODE_EPILOGUE = "ci/results/h100_decode_epilogue.txt"

# Query rows from which block skipping pays in "auto" mode.
SKIP_MIN_ROWS = 16


def _ours(ctx: Ctx) -> bool:
    return ctx.caps.backend == probe.NAME


def _skip_pays(ctx: Ctx) -> bool:
    """auto: a bias whose whole query tiles x KV blocks are -inf (packed sequences, document
    masks) makes the dense loop mostly wasted; with few query rows a per-head bias costs the
    GQA sharing (one head per work-group) and a single row tile has little to skip."""
    return ctx.op == "attention" and ctx.spec.seq_len >= SKIP_MIN_ROWS


def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    on = ctx.spec.bias and ctx.op == "attention" and (
        mode == "on" or (mode == "auto" and _skip_pays(ctx)))
    return {"block_skip": bool(on)}


BLOCK_SKIP = Rule(
    "opencl_block_skip",
    "flag block_skip with a bias: 'on' visits only the KV blocks the bias's block list keeps, "
    "'auto' does so from 16 query rows (where it measured faster), and 'off', no bias or "
    "partial states run dense", "params",
    lambda c: c.kernel is not None and c.kernel.backend == probe.NAME
    and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip,
    measured=(RULE_NUMBERS,))


def _decode_row(c: Ctx) -> bool:
    return (_ours(c) and c.op == "attention" and c.spec.seq_len == 1
            and c.flags.get("route", "auto") == "auto")


UNFUSED_ON_CPU = Rule(
    "opencl_unfused_decode_on_cpu",
    "on OpenCL CPU devices a one-row decode with GQA group >= 8 or L >= 4096 measured faster "
    "unfused (decode_qk -> decode_pv -> reduce) than fused, which the H100 never did",
    "route_refine",
    lambda c: _decode_row(c) and c.caps.device_type == "cpu"
    and c.params.get("route") in ("split_kv", "split_kv_fused")
    and (c.spec.group_size >= 8 or c.spec.total_len >= 4096),
    lambda c: {"route": "split_kv_unfused"}, measured=(RULE_NUMBERS,))

NVIDIA_TWO_LAUNCH = Rule(
    "opencl_nvidia_two_launch_long_context",
    "NVIDIA OpenCL, one query row, L >= 8192 with GQA group >= 8 or head size <= 64: the "
    "two-launch decode beats decode_fused, whose last work-group's merge of many splits is "
    "latency-bound there", "route_refine",
    lambda c: _decode_row(c) and tiles.nv_platform(c.caps)
    and c.params.get("route") == "split_kv_fused" and c.spec.total_len >= 8192
    and (c.spec.group_size >= 8 or c.spec.head_size <= 64),
    lambda c: {"route": "split_kv"}, measured=(RULE_NUMBERS,))


def _nv_fused(c: Ctx) -> bool:
    return (c.kernel is not None and c.kernel.backend == probe.NAME
            and c.kernel.family == "decode_fused" and c.kernel.matrix is None
            and tiles.nv_platform(c.caps))


NVIDIA_FAST_EXP = Rule(
    "opencl_nvidia_fused_fast_exp",
    "NVIDIA OpenCL decode_fused: native_exp (ex2.approx) measured faster and passed the "
    "conformance cases there in f16 and f32", "params",
    lambda c: _nv_fused(c) and "fast_exp" not in c.user, lambda c: {"fast_exp": True},
    measured=(RULE_NUMBERS,))


def _converts_halves(c: Ctx) -> bool:
    """An OpenCL kernel on NVIDIA's OpenCL that converts 16-bit values: float16 loads, or a
    tensor-core build's float16 / bfloat16 fragments (tiles.py: CVT_PTX)."""
    k = c.kernel
    return (k is not None and k.backend == probe.NAME and k.family != "reduce"
            and tiles.nv_platform(c.caps) and "cvt" not in c.user
            and (c.spec.dtype == "float16" if k.matrix is None else
                 c.spec.dtype in ("float16", "bfloat16") and c.params.get("mma") != "emulate"))


# The vendor settings of params "cvt" and "fence" ("auto" elsewhere: the portable OpenCL C).
NVIDIA_PTX_CVT = Rule(
    "opencl_nvidia_ptx_cvt",
    "NVIDIA OpenCL: 16-bit conversions (f16 -> f32 loads, the tensor cores' P rounding) through "
    "PTX cvt instead of bit manipulation, faster there and passing every f16 conformance case",
    "params", _converts_halves, lambda c: {"cvt": "ptx"}, measured=(RULE_NUMBERS,))

NVIDIA_PTX_FENCE = Rule(
    "opencl_nvidia_ptx_fence",
    "NVIDIA OpenCL one-launch decode: one work-item's PTX membar.gl, cumulative, orders its "
    "work-group's partial states before the ticket, where OpenCL 1.2 fences every item",
    "params", lambda c: c.kernel is not None and c.kernel.backend == probe.NAME
    and c.kernel.family == "decode_fused" and tiles.nv_platform(c.caps)
    and "fence" not in c.user,
    lambda c: {"fence": "ptx"}, measured=(DECODE_EPILOGUE,))


def _f32_wider(c: Ctx) -> bool:
    if not (_nv_fused(c) and c.spec.dtype == "float32" and "split_size" not in c.user
            and not c.flags.get("split_size") and "split_size" in c.params):
        return False
    size = 2 * int(c.params["split_size"])
    rows = -(-c.spec.seq_len // int(c.params.get("m_tile", 1)))
    groups = SplitGeometry.over(c.spec.capacity, size).n_splits * c.spec.batch \
        * c.spec.kv_num_heads * rows
    return size < c.spec.capacity and groups >= (c.caps.compute_units or 1)


NVIDIA_F32_SPLITS = Rule(
    "opencl_nvidia_f32_fused_splits",
    "NVIDIA OpenCL decode_fused in float32: splits twice as long while every compute unit still "
    "gets a work-group, as its 208-register kernel runs the default grid in two waves",
    "params", _f32_wider, lambda c: {"split_size": 2 * int(c.params["split_size"])},
    measured=(SPLIT_SWEEP,))


def _mma_fit(c: Ctx) -> dict[str, int]:
    assert c.kernel is not None
    return mma.fit_tiles(c.kernel, c.spec, c.params, c.caps.limit("workgroup_storage"), c.user)


def _async_tiles(c: Ctx) -> bool:
    """A tensor-core prefill reading float16 / bfloat16 K/V whose Q fragments stay in
    registers (head size <= 128; at 256 neither would Q's fragments fit registers nor Q, two K
    and two V tiles 48 KiB), its prefetch not the caller's."""
    if not (c.kernel is not None and c.kernel.backend == probe.NAME
            and c.kernel.matrix is not None and c.kernel.family == "prefill"
            and c.spec.kv_dtype is None and mma.async_q_in_registers(c.spec.head_size)
            and "prefetch" not in c.user):
        return False
    # the two buffers must fit local memory with the tiles the caller fixed (the fit rule
    # halves the others)
    limit = c.caps.limit("workgroup_storage")
    p = {**c.kernel.defaults, **c.params, "prefetch": 2}
    p.update(mma.fit_tiles(c.kernel, c.spec, p, limit, c.user))
    return limit is None or c.kernel.storage_need(c.spec, p) <= limit


MMA_PREFILL_ASYNC = Rule(
    "opencl_mma_prefill_async_tiles",
    "OpenCL tensor-core prefill with float16 / bfloat16 K/V and head size <= 128: K and V tiles "
    "stream into two local buffers by asynchronous copies while the other is computed "
    "(prefetch 2)",
    "params", _async_tiles, lambda c: {"prefetch": 2}, measured=(PREFILL_ASYNC,))


def _wide_rows(c: Ctx) -> bool:
    """prefetch 2 on NVIDIA whose 64-row grid gives fewer than two work-groups per compute
    unit, q_tile not the caller's."""
    if not (c.caps.vendor == "nvidia" and c.params.get("prefetch") == 2
            and c.kernel is not None and "q_tile" not in c.user):
        return False
    g = tiles.mma_geometry(c.spec, {**c.kernel.defaults, **c.params, "q_tile": 64}, c.caps)
    return g.n_groups(c.spec) < 2 * (c.caps.compute_units or 1)


MMA_PREFILL_WIDE_ROWS = Rule(
    "opencl_mma_prefill_wide_rows_short_grids",
    "OpenCL tensor-core prefill with asynchronous tiles on NVIDIA: 128-row work-groups where "
    "64-row ones would give fewer than two per compute unit",
    "params", _wide_rows, lambda c: {"q_tile": 128}, measured=(PREFILL_ASYNC,))

# NVIDIA's 48 KiB of local memory: head size 256 runs q_tile 32 x kv_tile 16.
MMA_TILES_FIT = Rule(
    "opencl_mma_tiles_fit_storage",
    "OpenCL tensor-core prefill: kv_tile, then q_tile, halved until the Q, K and transposed V "
    "tiles fit the device's local memory", "params",
    lambda c: c.kernel is not None and c.kernel.backend == probe.NAME
    and c.kernel.matrix is not None and bool(_mma_fit(c)), _mma_fit)

def _mma_decode(c: Ctx) -> bool:
    return (c.kernel is not None and c.kernel.backend == probe.NAME
            and c.kernel.matrix is not None and c.kernel.family in kernels.MMA_DECODES)


def _mma_decode_geometry(c: Ctx) -> tiles.Geometry:
    """The tensor-core decode's geometry with the params chosen so far."""
    assert c.kernel is not None
    return tiles.mma_decode_geometry(c.spec, {**c.kernel.defaults, **c.params}, c.caps,
                                      c.kernel.family)


def _mma_decode_splits(c: Ctx) -> dict[str, int]:
    g = _mma_decode_geometry(c)
    want = max(1, -(-2 * (c.caps.compute_units or 8) // g.n_groups(c.spec)))
    size = -(-c.spec.capacity // want)
    size = -(-size // g.tk) * g.tk
    return {"split_size": max(2 * (g.wg // 32) * g.tk, size)}


MMA_DECODE_SPLITS = Rule(
    "opencl_mma_decode_splits",
    "OpenCL tensor-core decode: about two work-groups per compute unit and at least two chunks "
    "per warp, longer splits than the sub-group decode's since every warp streams its own keys",
    "params", lambda c: _mma_decode(c) and "split_size" not in c.user
    and not c.flags.get("split_size"), _mma_decode_splits, measured=(RULE_NUMBERS,))

# matrix_units=auto: where the tensor-core prefill measured faster than every scalar prefill.
MMA_PREFILL_NVIDIA = Rule(
    "opencl_mma_prefill_nvidia",
    "NVIDIA with PTX mma.sync (probed): the tensor-core flash prefill, several times faster than "
    "the sub-group prefill (its bf16 and int8 / int4 K/V builds chosen alike, not yet "
    "measured)", "params",
    lambda c: c.kernel is not None and c.kernel.backend == probe.NAME
    and c.kernel.matrix is not None and c.kernel.family == "prefill"
    and c.flags.get("matrix_units", "auto") == "auto" and c.caps.vendor == "nvidia"
    and "mma" not in c.user and c.kernel.features <= c.caps.features,
    lambda c: {"mma": "hardware"}, measured=(MMA_BENCH,))

MMA_DECODE_NVIDIA = Rule(
    "opencl_mma_decode_nvidia",
    "NVIDIA with PTX mma.sync (probed): the tensor-core split-KV decode, faster than the "
    "sub-group decode up to head size 128 and past it only for groups of 128 query heads a KV "
    "head or more", "params",
    lambda c: _mma_decode(c) and c.flags.get("matrix_units", "auto") == "auto"
    and c.caps.vendor == "nvidia" and "mma" not in c.user
    and c.kernel is not None and c.kernel.features <= c.caps.features
    and (c.spec.head_size <= 128 or c.spec.group_size >= 128),
    lambda c: {"mma": "hardware"}, measured=(RULE_NUMBERS, MMA_DECODE_BENCH, PEERS))

# Quantized chunks hold half (int8) or a quarter (int4) of f16's raw registers, so they take
# longer chunks or the next chunk's prefetch where f16 could not (ptxas: 255 registers in
# every build; these two spill least).
_QUANT_TILES = {"int8": {"kv_tile": 32, "l2_prefetch": 1, "prefetch": 1},
                "int4": {"prefetch": 1}}
MMA_DECODE_QUANT_TILES = Rule(
    "opencl_mma_decode_quantized_tiles",
    "OpenCL tensor-core decode on quantized K/V, the fastest builds measured: int8 in 32-key "
    "chunks with the next round's chunk in L2 and the next chunk in registers, int4 with the "
    "next chunk in registers",
    "params",
    lambda c: _mma_decode(c) and c.spec.kv_dtype in _QUANT_TILES
    and not set(_QUANT_TILES[c.spec.kv_dtype]) & set(c.user),
    lambda c: dict(_QUANT_TILES[str(c.spec.kv_dtype)]), measured=(DECODE_ROWS_L2, DECODE_LOADS))


def _mid_rounds(c: Ctx) -> bool:
    """A float16 / bfloat16 tensor-core decode on NVIDIA whose warps each stream 4..8 rounds
    of chunks (split_size / (warps x kv_tile)), with no prefetch the caller chose."""
    if not (_mma_decode(c) and c.spec.kv_dtype is None and c.caps.vendor == "nvidia"
            and not {"l2_prefetch", "prefetch"} & set(c.user) and "split_size" in c.params):
        return False
    g = _mma_decode_geometry(c)
    rounds = -(-int(c.params["split_size"]) // (g.wg // 32 * g.tk))
    return 4 <= rounds <= 8


MMA_DECODE_MID_L2 = Rule(
    "opencl_mma_decode_l2_prefetch_mid_splits",
    "OpenCL tensor-core decode, float16 / bfloat16 K/V on NVIDIA with 4-8 rounds of chunks per "
    "warp: the chunk two rounds ahead is prefetched into L2, which fewer or more rounds "
    "measured slower",
    "params", _mid_rounds, lambda c: {"l2_prefetch": 2}, measured=(RULE_NUMBERS,))

RULES = (BLOCK_SKIP, UNFUSED_ON_CPU, NVIDIA_TWO_LAUNCH, NVIDIA_FAST_EXP, NVIDIA_PTX_CVT,
         NVIDIA_PTX_FENCE, NVIDIA_F32_SPLITS,
         MMA_PREFILL_ASYNC, MMA_PREFILL_WIDE_ROWS, MMA_TILES_FIT, MMA_DECODE_QUANT_TILES,
         MMA_DECODE_SPLITS, MMA_DECODE_MID_L2, MMA_PREFILL_NVIDIA, MMA_DECODE_NVIDIA)
