"""The WebGPU plugin's rules: tile fitting, the prefill step cap, masked-block skipping and
the unfused-decode crossover. Each says why in one sentence and names the ci/results/ files
that measured it (``python3 -m bench.webgpu_variants``: lavapipe here, the H100 on the device
machine)."""

from __future__ import annotations

from typing import Any

from attnreg.rules import RULE_NUMBERS, Ctx, Rule, split_size

from . import kernels, mma, probe, tiles


def _ours(ctx: Ctx, backend: str = probe.NAME) -> bool:
    k = ctx.kernel
    return k is not None and k.backend == backend and k.family in tiles.SHRINK


def _params(ctx: Ctx) -> dict[str, Any]:
    return {**(ctx.kernel.defaults if ctx.kernel else {}), **ctx.params}


def _fit(ctx: Ctx) -> dict[str, int]:
    assert ctx.kernel is not None
    fit = mma.fit_tiles if ctx.kernel.matrix is not None else kernels.fit_tiles
    return fit(ctx.kernel, ctx.spec, ctx.params, ctx.caps.limit("workgroup_storage"))


def fit_tiles(backend: str) -> Rule:
    """The tile-fitting rule for a backend that hosts these WGSL kernels (webgpu, browser)."""
    return Rule(
        f"{backend}_tiles_fit_storage",
        f"{backend} prefill/decode tiles are halved (kv_tile, then q_tile or group_tile) until "
        "the workgroup storage fits the device", "params",
        lambda c: _ours(c, backend) and bool(_fit(c)), _fit)


FIT_TILES = fit_tiles(probe.NAME)


def _step_over_tile(ctx: Ctx, backend: str = probe.NAME) -> bool:
    p = _params(ctx)
    return (_ours(ctx, backend) and ctx.kernel is not None and ctx.kernel.family == "prefill"
            and p.get("kv_staging") == "workgroup" and "max_k_step" not in ctx.user
            and int(p.get("max_k_step", 0)) > int(p.get("kv_tile", 0)))


def step_in_tile(backend: str) -> Rule:
    return Rule(
        f"{backend}_step_within_staged_tile",
        "with K/V staged in workgroup memory an inner step reads one staged tile, so max_k_step "
        "is capped at kv_tile", "params", lambda c: _step_over_tile(c, backend),
        lambda c: {"max_k_step": int(_params(c)["kv_tile"])})


STEP_IN_TILE = step_in_tile(probe.NAME)


# -- masked-block skipping -------------------------------------------------------------------
def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    return {"block_skip": mode == "on" or (mode == "auto" and _skip_pays(ctx))}


def _skip_pays(ctx: Ctx) -> bool:
    """'auto': where measured faster end to end: on CPU adapters, where the host-side block
    list (attnreg.blocks.build) is small next to the kernel, not on GPUs, where a host bias's
    list costs more than the kernel saves (ci/results/rule_measurements.md)."""
    return ctx.caps.device_type == "cpu"


def block_skip(backend: str) -> Rule:
    """Block skipping for a backend hosting these kernels ('auto' never skips on GPUs: there
    use 'on' with a device-resident bias, whose block list is built once per written version)."""
    return Rule(
        f"{backend}_block_skip",
        "flag block_skip with a bias: 'on' visits only the KV blocks the bias's block list "
        "keeps, and 'auto' does so on CPU adapters only, where the host-built list costs little "
        "next to the kernel", "params",
        lambda c: c.spec.bias and c.kernel is not None and c.kernel.backend == backend
        and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip,
        measured=(RULE_NUMBERS,))


BLOCK_SKIP = block_skip(probe.NAME)


# -- decode_partial's K/V staging and tiles ----------------------------------------------------
def _decode_partial(ctx: Ctx, backend: str) -> bool:
    k = ctx.kernel
    return (k is not None and k.backend == backend and k.family == "decode_partial"
            and k.matrix is None and "kv_staging" in k.defaults)


def _staging(ctx: Ctx, backend: str) -> bool:
    if not _decode_partial(ctx, backend) or "kv_staging" in ctx.user:
        return False
    p = {**_params(ctx), **ctx.kernel.params}               # type: ignore[union-attr]
    return tiles.decode_regs(ctx.spec, p) > tiles.DIRECT_MAX_REGS or int(p.get("m_tile", 1)) > 1


# H100, f16 GQA 32/8 L=32768: Dawn 130 -> 75 us, wgpu-native 100 -> 71 us reading K/V
# directly; whisper (m_tile 4): staged 21.2 / 17.5 us against direct 22.0 / 18.9 us
# (ci/results/h100_wgsl_decode.txt).
def decode_staging(backend: str) -> Rule:
    """decode_partial's kv_staging for a backend hosting these kernels (webgpu, dawn,
    browser)."""
    return Rule(
        f"{backend}_decode_kv_staging",
        "decode_partial reads K/V straight into the lanes' registers, except where a lane's "
        "share of a tile would spill or several query rows share a workgroup, where staging "
        "K/V measured faster",
        "params", lambda c: _staging(c, backend), lambda c: {"kv_staging": "workgroup"},
        measured=("ci/results/h100_wgsl_decode.txt",))


# Splits of one kv tile (the core rule keeps four) for the scalar decode_partial on NVIDIA,
# where few (batch, kv head, row tile) groups leave the 4-tile minimum short of the workgroups
# the device wants. H200, GPU us per launch Dawn / wgpu-native, median of 40, the two plans
# alternated over two rounds in one call (ci/results/h200_wgsl_decode_fixed_costs.txt, call
# 6): whisper S=4 T=1500 (8 heads, m_tile 4) 47 splits 18.0-18.2 / 15.2-15.3 us against the
# core rule's 24 19.8-19.9 / 17.3; GQA 32/8 H=128 L=2048 64 splits 20.3 / 17.0-17.1 against
# 32 21.1-21.2 / 17.9-18.0. Longer caches reach max_splits first, so L=8192 and L=32768 keep
# their plans. Measured on the H200 only (the H100 sweep agreed at L=2048 on wgpu-native:
# h100_split_sweep.txt), not on other NVIDIA GPUs.
SPLIT_TILES_MEASURED = "ci/results/h200_wgsl_decode_fixed_costs.txt"


def _short_splits(ctx: Ctx, backend: str) -> bool:
    return (_decode_partial(ctx, backend) and ctx.caps.vendor == "nvidia"
            and "split_size" not in ctx.user and not ctx.flags.get("split_size"))


def decode_short_splits(backend: str) -> Rule:
    return Rule(
        f"{backend}_decode_short_splits_nvidia",
        "NVIDIA: a split of the scalar decode_partial may hold a single kv tile, the reduce of "
        "the extra splits costing less than compute units left without work", "params",
        lambda c: _short_splits(c, backend),
        lambda c: split_size(c.spec, c.caps, _params(c), c.flags, min_tiles=1),
        measured=(SPLIT_TILES_MEASURED,))


DECODE_STAGING = decode_staging(probe.NAME)
DECODE_SHORT_SPLITS = decode_short_splits(probe.NAME)


# -- unfused decode crossover ------------------------------------------------------------------
# Where decode_qk + decode_pv measured faster than decode_partial (fused), by vendor or device
# type: (min GQA group, head sizes, min total length), single-row decode (the measured case);
# lavapipe showed no consistent region, so there is no CPU entry (the numbers:
# ci/results/rule_measurements.md).
UNFUSED_WINS: dict[str, list[tuple[int, tuple[int, ...], int]]] = {
    "nvidia": [(8, (128,), 8192)],
}


def _unfused_wins(ctx: Ctx) -> bool:
    regions = UNFUSED_WINS.get(ctx.caps.vendor, []) + UNFUSED_WINS.get(ctx.caps.device_type, [])
    s = ctx.spec
    return s.seq_len == 1 and any(s.group_size >= g and s.head_size in hs and s.total_len >= L
                                  for g, hs, L in regions)


UNFUSED_CROSSOVER = Rule(
    "webgpu_unfused_decode_crossover",
    "single-row decode with GQA group >= 8, H=128 and L >= 8192 on NVIDIA: the two unfused "
    "kernels beat the fused decode_partial, whose 8 query vectors a workgroup run short of "
    "registers there", "route_refine",
    lambda c: c.caps.backend == probe.NAME and c.params.get("route") == "split_kv"
    and c.flags.get("route", "auto") == "auto" and _unfused_wins(c),
    lambda c: {"route": "split_kv_unfused"}, measured=(RULE_NUMBERS,))


# -- the matrix prefill's direct form under matrix_units=auto ----------------------------------
# H100 (Dawn, experimental subgroup matrices), f16 causal GQA 32/8 H=128, batch 1, GPU time,
# the direct form with K and V staged by the workgroup against the scalar prefill (the plan of
# matrix_units=off), alternated in one device call (two rounds): S=512 154.5 / 154.7 us
# against 214.7 / 214.3 us, S=2048 1403.2 / 1401.0 us against 2435.7 / 2436.5 us
# (ci/results/h100_wgsl_mma_prefill_kstaged.txt). A build with the rescale inside each PV
# step (since moved back) measured 185 / 1734-1767 us against 213-215 / 2418-2434: faster too.
# H200 (same call design, 2026-11-28, the build since its edge Q load's uniformity fix):
# 157.9-159.7 / 1407-1432 us against 213.1-213.9 / 2422-2431, and at q_tile 128 (the rule
# below) 92.2-92.5 / 826.0-831.8 (ci/results/h200_wgsl_mma_prefill_branches.txt). The next
# stop's build (the grid heavy-first, the softmax lanes rotated, the logits' fast path; the
# scalar prefill gained the first and the last): S=512 78.9-79.2 us against 174.7-174.8,
# S=1024 161.9-162.7 against 606.2-607.0, S=2048 522.4-528.5 against 2292.5-2293.6
# (ci/results/h200_wgsl_prefill_order.txt, call 7); S=256 52.5-53.1 against 56.6-56.7, but
# S=128 38.8 against 30.7 (call 8: two row tiles a head are too few to fill the GPU).
MATRIX_PREFILL_MIN_SEQ = 256
MATRIX_PREFILL_MEASURED = "ci/results/h100_wgsl_mma_prefill_kstaged.txt"
MATRIX_PREFILL_H200 = "ci/results/h200_wgsl_mma_prefill_branches.txt"
MATRIX_PREFILL_ORDER = "ci/results/h200_wgsl_prefill_order.txt"


def _direct_on_nvidia(ctx: Ctx, backend: str) -> bool:
    """The candidate is this backend's direct matrix prefill, on an NVIDIA adapter."""
    k = ctx.kernel
    return (k is not None and k.backend == backend and k.matrix is not None
            and k.family == "prefill" and k.params.get("form") == "direct"
            and ctx.caps.vendor == "nvidia")


def _matrix_prefill(ctx: Ctx, backend: str) -> bool:
    return (_direct_on_nvidia(ctx, backend) and ctx.kernel is not None
            and ctx.flags.get("matrix_units", "auto") == "auto" and "mma" not in ctx.user
            and ctx.kernel.features <= ctx.caps.features
            and ctx.spec.seq_len >= MATRIX_PREFILL_MIN_SEQ)


# H200 (Dawn), f16 causal GQA 32/8 H=128, the direct form at q_tile 128 against 64, alternated
# in one device call (two rounds): S=512 92.2-92.9 us against 158.2-159.8, S=2048 826.0-847.9
# against 1413.3-1436.2 (ci/results/h200_wgsl_mma_prefill_branches.txt); with the next
# stop's build S=512 78.9-79.2 against 108.4-108.6, S=1024 161.9-162.7 against 325.3-325.7,
# S=2048 522.4-528.5 against 1130.1-1130.5 (h200_wgsl_prefill_order.txt, call 7). Measured on
# the H200 only: not on other NVIDIA GPUs (nor the H100, not lent) or other vendors.
MATRIX_PREFILL_ROWS = 128


def _matrix_rows(ctx: Ctx, backend: str) -> bool:
    if not _direct_on_nvidia(ctx, backend) or ctx.kernel is None or "q_tile" in ctx.user:
        return False
    limit = ctx.caps.limit("workgroup_storage")
    need = ctx.kernel.storage_need(ctx.spec, {**_params(ctx), "q_tile": MATRIX_PREFILL_ROWS})
    return limit is not None and need <= limit


def matrix_prefill_rows(backend: str) -> Rule:
    """The direct matrix prefill's query rows per workgroup on NVIDIA, where they fit."""
    return Rule(f"{backend}_matrix_prefill_rows_nvidia",
                "NVIDIA: the direct matrix prefill takes 128 query rows a workgroup where the "
                "workgroup storage holds them, eight subgroups sharing each staged K and V tile",
                "params", lambda c: _matrix_rows(c, backend),
                lambda c: {"q_tile": MATRIX_PREFILL_ROWS},
                measured=(MATRIX_PREFILL_H200, MATRIX_PREFILL_ORDER))


def matrix_prefill(backend: str) -> Rule:
    """matrix_units=auto takes the direct matrix prefill's hardware build where it measured
    faster than the scalar prefill (a backend whose device exposes subgroup matrices: dawn)."""
    return Rule(f"{backend}_matrix_prefill_nvidia",
                f"NVIDIA with subgroup matrices: prompts of {MATRIX_PREFILL_MIN_SEQ} rows or more "
                "take the direct matrix prefill (Q in registers, K and V staged by the "
                "workgroup), faster than the scalar prefill there at every length measured",
                "params",
                lambda c: _matrix_prefill(c, backend), lambda c: {"mma": "hardware"},
                measured=(MATRIX_PREFILL_MEASURED, MATRIX_PREFILL_H200, MATRIX_PREFILL_ORDER))


# -- the scalar prefill's sliced QK on NVIDIA --------------------------------------------------
# H200 (Dawn), f16 causal GQA 32/8 H=128, GPU us a launch, the library's prefill alternated in
# one device call, two rounds each (SLICED_PREFILL_MEASURED):
#   these params (64 rows, 32-key tiles in 16-key steps; call 7): S=512 138.0-138.2,
#     S=1024 446.9-447.8, S=2048 1596.2-1597.7;
#   the keys layout as it was (32 rows, row_lanes 16, K/V staged as f16; call 6): 167.2-167.4,
#     589.9-590.0, 2257.0-2258.0;
#   sliced with 32-key steps (call 7): 152.9 / - / -; 128 rows (16-key tiles and steps, the
#     storage fit's): 211.4-211.5, 454.5-454.7, 1592.5-1599.0; 64 rows in 16-key tiles:
#     146.9-147.0, 478.9-479.3, 1717.8-1722.9.
# The standalone probe (bench/wgsl_scalar_prefill_probe.py) has the layout's account. Head
# sizes past 128 were not measured (q's and the output's slices grow with the head: the
# register tile would spill), nor GPUs other than the H200: NVIDIA returns a 16-byte load
# that lanes n and n^1 share in half the cycles, which the layout's lane order is for.
# Short prompts keep the keys layout: its 32-row tiles give twice the workgroups, which a
# prompt of a few 64-row tiles a head leaves the GPU short of. The same build, the two
# layouts alternated, two rounds (SLICED_PREFILL_MEASURED, twelfth session), sliced / keys:
# S=32 22.2 / 15.0-15.1 us, 64 32.5-32.6 / 20.2, 128 45.5 / 28.9-29.0, 256 68.4-68.5 /
# 53.5-53.6, 320 79.9-80.0 / 77.8-77.9, 384 92.4 / 103.5-103.6, 448 115.2-115.5 /
# 131.9-132.1, 512 138.0 / 166.2-166.4. Measured with 32 query heads and batch 1 only.
SLICED_PREFILL: dict[str, Any] = {"qk_layout": "sliced", "kv_stage": "f32", "row_lanes": 8,
                                  "q_tile": 64, "rows_per_thread": 2, "max_k_step": 16}
SLICED_MAX_HEAD = 128
SLICED_MIN_SEQ = 384
SLICED_PREFILL_MEASURED = "ci/results/h200_wgsl_sliced_prefill.txt"


def _sliced(ctx: Ctx, backend: str) -> bool:
    k = ctx.kernel
    if (k is None or k.backend != backend or k.family != "prefill" or k.matrix is not None
            or k.params.get("reduction") != "subgroup" or ctx.caps.vendor != "nvidia"
            # its tiles go together: none fixed by the caller or by an earlier rule (the
            # tuning cache's), or a later rule's sets would leave them half applied
            or any(n in ctx.user or n in ctx.fixed for n in SLICED_PREFILL)):
        return False
    p = {**_params(ctx), **k.params, **SLICED_PREFILL}
    # fits with 16-key tiles (the storage fit halves kv_tile to that where it must)
    p["kv_tile"] = min(int(p.get("kv_tile", 16)), 16)
    limit = ctx.caps.limit("workgroup_storage")
    return (p.get("kv_staging") == "workgroup" and ctx.spec.seq_len >= SLICED_MIN_SEQ
            and max(ctx.spec.head_size, ctx.spec.head_size_v) <= SLICED_MAX_HEAD
            and limit is not None and k.storage_need(ctx.spec, p) <= limit)


def sliced_prefill(backend: str) -> Rule:
    """NVIDIA: the scalar prefill with its row groups' lanes splitting the head dimension."""
    return Rule(f"{backend}_sliced_prefill_nvidia",
                "NVIDIA, prompts long enough to fill the device with its tiles: the scalar "
                "prefill's lanes split the head dimension (q in registers, scores and weights "
                "moved by subgroup shuffles, K/V staged as f32)", "params",
                lambda c: _sliced(c, backend), lambda c: dict(SLICED_PREFILL),
                measured=(SLICED_PREFILL_MEASURED,))


SLICED = sliced_prefill(probe.NAME)


RULES: tuple[Rule, ...] = (BLOCK_SKIP, DECODE_STAGING, DECODE_SHORT_SPLITS,
                          SLICED, FIT_TILES, STEP_IN_TILE, UNFUSED_CROSSOVER)
