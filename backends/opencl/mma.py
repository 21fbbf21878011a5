"""The tensor-core kernels' tiles (kernels_cl/flash_prefill_mma.cl, decode_mma.cl): their
primitive, builds, defaults, local-memory layout and tile fitting. Their geometry is in
tiles.py and their declarations in kernels.py, with the other variants'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnreg.backends import common
from attnreg.kernel import MMA_BUILDS, KernelInfo, MatrixUnit
from attnreg.spec import AttentionSpec

_F32 = 4
# mma.sync m16n8k16 (f16 in, f32 accumulators) through inline PTX, 32-lane warps, one warp per
# 16 query rows. q_tile: rows per work-group (16 per warp); kv_tile: keys per staged tile.
PTX_MMA = MatrixUnit("ptx_mma", 16, 8, 16, "f16", "f32")
# The bf16 twins (-D IS_BF16=1): mma.sync m16n8k16 .bf16 (sm_80+, as .f16), same fragments.
PTX_MMA_BF16 = MatrixUnit("ptx_mma", 16, 8, 16, "bf16", "f32")
# The primitive of each dtype the tensor-core kernels compute in (spec.dtype -> MatrixUnit).
PTX_MMA_BY_DTYPE = {"float16": PTX_MMA, "bfloat16": PTX_MMA_BF16}
# The builds of param "mma" as -D MMA: the PTX primitive, or its plain-C emulation.
MMA_IMPLS = {"hardware": 1, "emulate": 2}
assert set(MMA_IMPLS) == set(MMA_BUILDS)
# prefetch: 1 loads the next K/V tile into registers while the current one is computed, 0
# loads each tile just before staging it. 0 by default: it frees ~80 registers at kv_tile 32
# (166 vs 243, ptxas) and measured faster where it matters most (H200, causal f16 GQA 32/8
# H=128 S=2048: 447 vs 480 us; H=256: 1319 vs 1490 us, no spills), 5% slower at S=512 (67 vs
# 63 us). native_exp weights (FAST_EXP) measured 1-4% slower there, so it is no knob here.
# prefetch 2 (kernels_cl/mma_async.cl): K and V tiles copied global -> local asynchronously
# into two buffers (the next tile's copies fly while this one is computed), V's fragments read
# by transposing loads from its row-major tile, Q's fragments in registers up to head size
# 128; float16 / bfloat16 K/V only (quantized codes are dequantized as they are staged).
MMA_DEFAULTS: Mapping[str, Any] = {"q_tile": 64, "kv_tile": 32, "prefetch": 0,
                                   "mma": "hardware"}
MMA_CHOICES: Mapping[str, tuple[Any, ...]] = {"q_tile": (16, 32, 64, 128),
                                              "kv_tile": (16, 32, 64), "prefetch": (0, 1, 2)}
MMA_SHRINK = (("kv_tile", 16), ("q_tile", 16))     # halved in this order to fit local memory
# The decode kernels (kernels_cl/decode_mma.cl): at most 16 rows (one M tile), wg / 32 warps
# each streaming its own chunks of kv_tile keys. prefetch 1 keeps the next chunk's loads in
# flight but takes 255 registers with spills at head size 128 (ptxas; 190 without): measured
# on the H100 (GQA 32/8 H=128 f16, decode_fused, 4 warps): L=8192 23.2 vs 25.2 us, L=32768
# 62.2 vs 69.4 us; kv_tile 32 and 8 warps were slower everywhere.
# l2_prefetch n (NVIDIA builds): each round prefetches into L2 the chunk n rounds ahead (PTX
# prefetch.global.L2, no registers held). Off by default: on the H100 (L=32768, after the
# 8-row products of 2026-11-25) f16 70.9 -> 75.8 us and int4 48.0 -> 53.3 us with 1, slower
# again with 2; int8 gains (opencl_mma_decode_quantized_tiles), and so do f16 / bf16 splits
# of 4-8 rounds per warp (opencl_mma_decode_l2_prefetch_mid_splits).
DECODE_DEFAULTS: Mapping[str, Any] = {"m_tile": 1, "kv_tile": 16, "wg": 128, "prefetch": 0,
                                      "l2_prefetch": 0, "mma": "hardware"}
DECODE_CHOICES: Mapping[str, tuple[Any, ...]] = {
    "m_tile": (1, 2, 4, 8, 16), "kv_tile": (16, 32, 64), "wg": (32, 64, 128, 256),
    "prefetch": (0, 1), "l2_prefetch": (0, 1, 2)}
DECODE_SHRINK = (("wg", 32),)                      # fewer warps, less to merge in local memory
_MMA_WARP_WORDS = 192                              # mma_sync.cl's exchange per emulated warp


def mma_pitch(halves: int) -> int:
    """Row pitch in 32-bit words of a local tile whose rows hold ``halves`` f16 values (a
    multiple of 16): 8 or 24 modulo 32 words, so the 64-bit fragment reads of the 4 rows a
    half-warp touches fall on distinct banks."""
    words = halves // 2
    return words + (8 if words % 32 in (0, 16) else 0)


def async_q_in_registers(head_size: int) -> bool:
    """Whether prefetch 2 keeps Q's fragments in registers (-D QREG): up to head size 128
    (32 registers a lane); its staging words are then the K / V buffers'."""
    return head_size <= 128


def ldsm_pitch(halves: int) -> int:
    """Row pitch in words of prefetch 2's row-major K and V tiles (rows of ``halves`` values,
    a multiple of 16): an odd multiple of 4 words, so the 8 16-byte rows of each ldmatrix
    phase fall on distinct banks."""
    return halves // 2 + 4


def mma_storage(head_size: int, rows: int, kv_tile: int, emulate: bool,
                head_size_v: int | None = None, prefetch: int = 0) -> int:
    """Bytes of local memory of flash_prefill_mma.cl: Q and K tiles, V transposed (its
    head_size_v rows), the v flag; prefetch 2 two buffers of K and V, both row-major at
    ldsm_pitch (ldmatrix reads them), Q's words shared with them where its fragments live in
    registers; the emulation adds its fragment exchange and the shuffle scratch."""
    hv = head_size_v or head_size
    qw = mma_pitch(head_size)
    if prefetch == 2:
        kv = 2 * kv_tile * (ldsm_pitch(head_size) + ldsm_pitch(hv))
        q = rows * qw
        words = (max(kv, q) if async_q_in_registers(head_size) else kv + q) + 1
    else:
        words = rows * qw + kv_tile * qw + hv * mma_pitch(kv_tile) + 1
    if emulate:
        wg = 2 * rows
        words += wg // 32 * _MMA_WARP_WORDS + wg
    return words * _F32


def mma_decode_storage(head_size: int, rows: int, wg: int, emulate: bool, family: str) -> int:
    """Bytes of local memory of decode_mma.cl: every warp's (m, l, o) per row for the final
    merge (o of v's head size, ``head_size`` here), the fused kernel's flag; the emulation's
    exchange and shuffle scratch."""
    words = (wg // 32) * rows * (2 + head_size) + (family == "decode_fused")
    if emulate:
        words += wg // 32 * _MMA_WARP_WORDS + wg
    return words * _F32


def fit_tiles(kernel: KernelInfo, spec: AttentionSpec, params: Mapping[str, Any],
              limit: int | None, fixed: frozenset[str] = frozenset()) -> dict[str, int]:
    """The tiles halved in MMA_SHRINK order (not those in ``fixed``) until the local memory
    fits ``limit``."""
    order = MMA_SHRINK if kernel.family == "prefill" else DECODE_SHRINK
    return common.fit_tiles(kernel, spec, params, limit, order, fixed)
