"""The OpenCL plugin's rules, as data: each cites the measurement behind it (PoCL in CI,
NVIDIA's OpenCL on the H100 through bench/opencl_gpu_check.py). They run after the
built-in rules, so they see the route and split geometry those chose."""

from __future__ import annotations

from attnreg.plan import SplitGeometry
from attnreg.rules import Ctx, Rule

from . import kernels, mma, tiling

# Query rows from which block skipping pays in "auto" mode.
SKIP_MIN_ROWS = 16


def _ours(ctx: Ctx) -> bool:
    return ctx.caps.backend == kernels.BACKEND


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
    "flag block_skip (OpenCL): 'on' with a bias runs the variants that visit only the KV blocks "
    "the bias's block list keeps; 'auto' does so from 16 query rows: 4 x 512 packed sequences "
    "(block-diagonal bias, causal) ran 4.6x (f16) / 4.4x (f32) faster on the H100 and 3.3-4.5x "
    "on PoCL with identical results, and a bias with nothing to skip cost 0.87-0.91x (H100) / "
    "1.02-1.07x (PoCL) of the dense time; one decode row over 4 packed documents gained only "
    "1.11x on the H100 (the tiled decode_partial.bs against the sub-group fused decode) and a "
    "per-head decode bias lost 1.5-2.9x on PoCL; 'off', no bias, or partial states: dense",
    "params",
    lambda c: c.kernel is not None and c.kernel.backend == kernels.BACKEND
    and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip)


def _decode_row(c: Ctx) -> bool:
    return (_ours(c) and c.op == "attention" and c.spec.seq_len == 1
            and c.flags.get("route", "auto") == "auto")


UNFUSED_ON_CPU = Rule(
    "opencl_unfused_decode_on_cpu",
    "OpenCL CPU devices, one query row: the unfused decode (decode_qk -> decode_pv -> reduce) "
    "measured faster than the fused decodes on PoCL (2 cores, f16, Nkv=2) for GQA group 8 "
    "(1.3-2.7x, e.g. H=128 L=8192: 14.0 vs 38.3 ms) and from L=4096 at groups 1 and 4 "
    "(1.0-1.4x, e.g. group 4 H=64 L=8192: 4.7 vs 5.8 ms); below that the fused decode wins or "
    "ties (group 4 H=128 L=2048: 1.13 vs 1.65 ms). On the H100 the unfused decode never won "
    "(1.5-2.2x slower over groups 1/4/8, H 64/128, L 512-32768)", "route_refine",
    lambda c: _decode_row(c) and c.caps.device_type == "cpu"
    and c.params.get("route") in ("split_kv", "split_kv_fused")
    and (c.spec.group_size >= 8 or c.spec.total_len >= 4096),
    lambda c: {"route": "split_kv_unfused"})

NVIDIA_TWO_LAUNCH = Rule(
    "opencl_nvidia_two_launch_long_context",
    "NVIDIA OpenCL, one query row, L >= 8192 with GQA group >= 8 or head size <= 64: the "
    "two-launch decode (decode_partial + reduce) measured 2-11% faster than decode_fused on "
    "the H100 (group 8 H=128: 51.1 vs 57.3 us at L=8192, 131.3 vs 137.0 at 32768; group 4 "
    "H=64: 78.3 vs 81.9 us at 32768): the last work-group's merge of 64 splits x 8 rows is "
    "latency-bound and outlasts the reduce launch there; elsewhere the one launch wins "
    "(e.g. GQA 32/8 H=128 f16 L=8192: 26.6 vs 28.3 us)", "route_refine",
    lambda c: _decode_row(c) and tiling.nv_platform(c.caps)
    and c.params.get("route") == "split_kv_fused" and c.spec.total_len >= 8192
    and (c.spec.group_size >= 8 or c.spec.head_size <= 64),
    lambda c: {"route": "split_kv"})


def _nv_fused(c: Ctx) -> bool:
    return (c.kernel is not None and c.kernel.backend == kernels.BACKEND
            and c.kernel.family == "decode_fused" and c.kernel.matrix is None
            and tiling.nv_platform(c.caps))


NVIDIA_FAST_EXP = Rule(
    "opencl_nvidia_fused_fast_exp",
    "NVIDIA OpenCL decode_fused: native_exp (ex2.approx) measured 1-4% faster on the H100 (GQA "
    "32/8 H=128 f16 with PTX conversion: 25.5 vs 26.6 us at L=8192, 67.3 vs 68.2 at 32768; f32 "
    "L=8192: 44.7 vs 45.7 us) and passed the conformance cases there (f16 and f32)", "params",
    lambda c: _nv_fused(c) and "fast_exp" not in c.user, lambda c: {"fast_exp": True})


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
    "NVIDIA OpenCL decode_fused in float32: splits twice as long while the grid still gives "
    "every compute unit a work-group; the f32 kernel holds 208 registers (ptxas), so 512 "
    "work-groups of 128 run in two waves: GQA 32/8 H=128 L=8192 measured 39.2 vs 45.7 us on "
    "the H100 (split 256 vs 128)", "params", _f32_wider,
    lambda c: {"split_size": 2 * int(c.params["split_size"])})


def _mma_fit(c: Ctx) -> dict[str, int]:
    assert c.kernel is not None
    return mma.fit_tiles(c.kernel, c.spec, c.params, c.caps.limit("workgroup_storage"), c.user)


def _async_tiles(c: Ctx) -> bool:
    """A tensor-core prefill reading float16 / bfloat16 K/V whose Q fragments stay in
    registers (head size <= 128), its prefetch not the caller's."""
    if not (c.kernel is not None and c.kernel.backend == kernels.BACKEND
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
    "OpenCL tensor-core prefill, float16 / bfloat16 K/V, head size <= 128: the K and V tiles "
    "stream global -> local by asynchronous copies into two buffers while the other is "
    "computed, V's fragments by transposing loads (prefetch 2); on the H100 (causal f16 GQA "
    "32/8 H=128, GPU time, one run, after the logits' per-tile choice and ex2 weights) S=2048 "
    "268.5 vs 377.9 us with prefetch 0, S=512 45.0 vs 55.1 us; bf16 S=2048 "
    "269 us, H=64 163 us (441 and 283 before this build); head size 256 keeps prefetch 0 (Q's "
    "fragments would not fit registers, and Q, two K and two V tiles not 48 KiB)",
    "params", _async_tiles, lambda c: {"prefetch": 2})


def _wide_rows(c: Ctx) -> bool:
    """prefetch 2 on NVIDIA whose 64-row grid gives fewer than two work-groups per compute
    unit, q_tile not the caller's."""
    if not (c.caps.vendor == "nvidia" and c.params.get("prefetch") == 2
            and c.kernel is not None and "q_tile" not in c.user):
        return False
    g = tiling.mma_geometry(c.spec, {**c.kernel.defaults, **c.params, "q_tile": 64}, c.caps)
    return g.n_groups(c.spec) < 2 * (c.caps.compute_units or 1)


MMA_PREFILL_WIDE_ROWS = Rule(
    "opencl_mma_prefill_wide_rows_short_grids",
    "OpenCL tensor-core prefill with asynchronous tiles on NVIDIA, when 64-row work-groups "
    "would give fewer than two per compute unit: 128 rows (8 warps) per work-group; on the "
    "H100 (causal f16 GQA 32/8 H=128, GPU time, one run) S=512 (256 work-groups of 64 rows "
    "on 132 compute units) 39.5 vs 45.0 us with 64, while S=2048 (1024) was not faster with "
    "128 (271.0 vs 268.5 us): its 208 registers per work-item leave one work-group of 8 "
    "warps per compute unit, against three of 4 warps",
    "params", _wide_rows, lambda c: {"q_tile": 128})

MMA_TILES_FIT = Rule(
    "opencl_mma_tiles_fit_storage",
    "OpenCL tensor-core prefill: kv_tile, then q_tile, halved until the Q, K and transposed V "
    "tiles fit the device's local memory (NVIDIA: 48 KiB, so head size 256 runs q_tile 32 x "
    "kv_tile 16)", "params",
    lambda c: c.kernel is not None and c.kernel.backend == kernels.BACKEND
    and c.kernel.matrix is not None and bool(_mma_fit(c)), _mma_fit)

def _mma_decode(c: Ctx) -> bool:
    return (c.kernel is not None and c.kernel.backend == kernels.BACKEND
            and c.kernel.matrix is not None and c.kernel.family in kernels.MMA_DECODES)


def _mma_decode_geometry(c: Ctx) -> tiling.Geometry:
    """The tensor-core decode's geometry with the params chosen so far."""
    assert c.kernel is not None
    return tiling.mma_decode_geometry(c.spec, {**c.kernel.defaults, **c.params}, c.caps,
                                      c.kernel.family)


def _mma_decode_splits(c: Ctx) -> dict[str, int]:
    g = _mma_decode_geometry(c)
    want = max(1, -(-2 * (c.caps.compute_units or 8) // g.n_groups(c.spec)))
    size = -(-c.spec.capacity // want)
    size = -(-size // g.tk) * g.tk
    return {"split_size": max(2 * (g.wg // 32) * g.tk, size)}


MMA_DECODE_SPLITS = Rule(
    "opencl_mma_decode_splits",
    "OpenCL tensor-core decode: about two work-groups per compute unit, each warp at least two "
    "chunks; its warps stream their own keys, so longer splits than the sub-group decode's "
    "pay: on the H100 (GQA 32/8 H=128 f16, decode_fused) L=8192 took 23.2 us with 256-key "
    "splits against 31.6 us with 128, L=32768 62.2 us with 1024 against 71.0 with 512",
    "params", lambda c: _mma_decode(c) and "split_size" not in c.user
    and not c.flags.get("split_size"), _mma_decode_splits)

# matrix_units=auto: where the tensor-core prefill measured faster than every scalar prefill.
MMA_PREFILL_NVIDIA = Rule(
    "opencl_mma_prefill_nvidia",
    "NVIDIA with PTX mma.sync (probed): the tensor-core flash prefill measured 6.8x-11.3x "
    "faster than the sub-group prefill on the H100 (causal f16 GQA 32/8 H=128, GPU time: "
    "S=512 66.5 vs 454.8 us, S=2048 458.9 vs 5172 us; H=64 / 256 at S=2048 7.9x / 9.8x; "
    "also 3.2x / 5.2x faster than the best WGSL prefill there); the bf16 twin (mma.sync .bf16, "
    "same tiles) is chosen alike against a bf16 sub-group prefill measured as slow (S=2048: "
    "5158 us; bf16 twin: to be measured), and both alike on int8 / int4 K/V (dequantized as "
    "the tiles are staged, same tiles: to be measured)", "params",
    lambda c: c.kernel is not None and c.kernel.backend == kernels.BACKEND
    and c.kernel.matrix is not None and c.kernel.family == "prefill"
    and c.flags.get("matrix_units", "auto") == "auto" and c.caps.vendor == "nvidia"
    and "mma" not in c.user and c.kernel.features <= c.caps.features,
    lambda c: {"mma": "hardware"})

MMA_DECODE_NVIDIA = Rule(
    "opencl_mma_decode_nvidia",
    "NVIDIA with PTX mma.sync (probed): the tensor-core split-KV decode measured faster than "
    "the sub-group decode on the H100 (f16, GPU time, one run): GQA 32/8 H=128 L=2048 15.4 vs "
    "17.6 us, L=8192 23.2 vs 27.6 us, L=32768 62.2 vs 69.9 us; whisper cross-attention (S=4, "
    "T=1500, 8 heads H=64) 14.4 vs 17.9 us; 16 requests x 4096-key shared prefix (16/4 heads) "
    "38.2 vs 87.8 us; quantized K/V (codes made f16 fragments by byte permutes, L=32768, "
    "tiles of opencl_mma_decode_quantized_tiles): int8 57.1 vs 80.3 us, int4 46.8 vs 102.4 "
    "us; the bf16 twins (mma.sync .bf16; int8 / int4 K/V made bf16 fragments) are chosen "
    "alike (bf16 twin: to be measured); past head size 128 only for groups of 128 query "
    "heads a KV head or more (ci/results/h100_peers.txt: one KV head, L=4096, tensor-core vs "
    "sub-group us: H=256 16 heads 95.1 vs 34.3; MLA 576/512 16 heads 494 vs 101, 64 heads 372 "
    "vs 299, 128 heads 353 vs 554; H=128 16 heads 26.8 vs 41.0)", "params",
    lambda c: _mma_decode(c) and c.flags.get("matrix_units", "auto") == "auto"
    and c.caps.vendor == "nvidia" and "mma" not in c.user
    and c.kernel is not None and c.kernel.features <= c.caps.features
    and (c.spec.head_size <= 128 or c.spec.group_size >= 128),
    lambda c: {"mma": "hardware"})

# Quantized chunks hold half (int8) or a quarter (int4) of f16's raw registers, so they take
# longer chunks or the next chunk's prefetch where f16 could not (ptxas: 255 registers in
# every build; these two spill least).
_QUANT_TILES = {"int8": {"kv_tile": 32, "l2_prefetch": 1, "prefetch": 1},
                "int4": {"prefetch": 1}}
MMA_DECODE_QUANT_TILES = Rule(
    "opencl_mma_decode_quantized_tiles",
    "OpenCL tensor-core decode on quantized K/V: int8 in 32-key chunks with the next round's "
    "chunk prefetched into L2 and the next chunk into registers, int4 with the next chunk "
    "prefetched into registers; on the H100 (GQA 32/8 H=128 L=32768, decode_fused, GPU time, "
    "one run) int8 49.8 us against 53.3 (no L2 prefetch), 55.5 (16-key chunks) and 51.1 "
    "(register prefetch alone), int4 48.0 us against 48.0 (no prefetch), 53.9 (with L2 "
    "prefetch) and 64.2 (32-key chunks); after the loads became L1::no_allocate (2026-11-25) "
    "int8 with both prefetches 43.5 us against 46.6 (L2 prefetch alone) and 47.4 (16-key "
    "chunks), int4 48.1 against 56.8 (no prefetch) and 53.8 (both prefetches); 64-key "
    "chunks, 256- or 512-key splits and 2 or 8 warps were slower for both (f16; the bf16 "
    "twins take the same: to be measured)",
    "params",
    lambda c: _mma_decode(c) and c.spec.kv_dtype in _QUANT_TILES
    and not set(_QUANT_TILES[c.spec.kv_dtype]) & set(c.user),
    lambda c: dict(_QUANT_TILES[str(c.spec.kv_dtype)]))


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
    "OpenCL tensor-core decode, float16 / bfloat16 K/V on NVIDIA, 4-8 rounds of chunks per "
    "warp: the chunk two rounds ahead is prefetched into L2; on the H100 (GQA 32/8 H=128, "
    "decode_fused, GPU time, two rounds in one call) f16 L=8192 (4 rounds) 22.7 vs 23.5 us, "
    "L=12288 (6) 31.1 vs 33.7, L=16384 (8) 36.4 vs 38.5, bf16 L=8192 23.3 vs 24.9; with "
    "2 rounds (L=4096) 19.1 vs 18.0 and 16 (L=32768) 68.0 vs 60.6 it was slower, and 3 or 4 "
    "rounds ahead no better than 2",
    "params", _mid_rounds, lambda c: {"l2_prefetch": 2})

RULES = (BLOCK_SKIP, UNFUSED_ON_CPU, NVIDIA_TWO_LAUNCH, NVIDIA_FAST_EXP, NVIDIA_F32_SPLITS,
         MMA_PREFILL_ASYNC, MMA_PREFILL_WIDE_ROWS, MMA_TILES_FIT, MMA_DECODE_QUANT_TILES,
         MMA_DECODE_SPLITS, MMA_DECODE_MID_L2, MMA_PREFILL_NVIDIA, MMA_DECODE_NVIDIA)
