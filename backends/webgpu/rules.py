"""The WebGPU plugin's rules: tile fitting, the prefill step cap, masked-block skipping and
the unfused-decode crossover. Each why cites what it rests on; the measurements come from
``python3 -m bench.webgpu_variants`` (lavapipe here, the H100 on the device
machine)."""

from __future__ import annotations

from typing import Any

from attnreg.rules import Ctx, Rule

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
        "with K/V staged in workgroup memory an inner step reads one staged kv_tile tile: "
        "max_k_step is capped at kv_tile", "params", lambda c: _step_over_tile(c, backend),
        lambda c: {"max_k_step": int(_params(c)["kv_tile"])})


STEP_IN_TILE = step_in_tile(probe.NAME)


# -- masked-block skipping -------------------------------------------------------------------
def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    return {"block_skip": mode == "on" or (mode == "auto" and _skip_pays(ctx))}


def _skip_pays(ctx: Ctx) -> bool:
    """'auto': where measured faster end to end. On CPU adapters the kernel takes 100-500 ms
    at 4 x 128 packed tokens, the host-side block list (attnreg.blocks.build) 2-40 ms; on
    GPUs the list of a host bias (40 ms at 2048 x 2048, 0.6 s with 8 heads) costs more than
    the kernel saves (H100: 3.36 -> 0.78 ms)."""
    return ctx.caps.device_type == "cpu"


def block_skip(backend: str) -> Rule:
    return Rule(
        f"{backend}_block_skip",
        "flag block_skip with a bias: 'on' runs the variant that visits only the KV blocks the "
        "bias's block list keeps (4 x 512 packed sequences, block-diagonal bias, GPU time: "
        "H100 prefill 4.3x non-causal, 2.2x causal, decode S=4 1.9x; 0.89x the dense time with "
        "nothing to skip, as all-zero blocks skip the bias load); 'auto' does so on CPU adapters "
        "(lavapipe 3.6-3.7x prefill, 2.5x decode rows), where the host-built list (2-40 ms) is "
        "small next to the kernel, but not on GPUs, where a host bias's list costs more than the "
        "kernel saves (use 'on' with a device-resident bias: its list is built once per "
        "written version)", "params",
        lambda c: c.spec.bias and c.kernel is not None and c.kernel.backend == backend
        and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip)


BLOCK_SKIP = block_skip(probe.NAME)


# -- unfused decode crossover ------------------------------------------------------------------
# Where decode_qk + decode_pv measured faster than decode_partial (fused), by vendor or device
# type: (min GQA group, head sizes, min total length), single-row decode (the measured case).
# bench/webgpu_variants.py crossover, f16, Nkv=8, S=1, L=512..32768:
#   H100: unfused 1.19-1.99x slower everywhere except GQA group 8, H=128, L >= 8192
#         (fused 81.9 / 399.7 us, unfused 76.4 / 383.1 us at L=8192 / 32768: 0.93x, 0.96x),
#         where the fused kernel's 8 query vectors per workgroup run short of registers;
#   lavapipe: 0.76-2.33x, mostly slower, no consistent region (a shared, loaded 2-core
#             host: the same cell moved by 20-40% between runs), so no CPU entry.
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
    "single-row decode with GQA group >= 8, H=128 and L >= 8192 on NVIDIA: two kernels "
    "(decode_qk scores + split statistics, decode_pv normalise x V) measured 0.93-0.96x the "
    "fused decode_partial on the H100 (81.9 -> 76.4 us at L=8192, 399.7 -> 383.1 us at "
    "32768); everywhere else measured on the H100 the fused kernel is faster (unfused "
    "1.19-1.99x slower); lavapipe showed no consistent region",
    "route_refine", lambda c: c.caps.backend == probe.NAME and c.params.get("route") == "split_kv"
    and c.flags.get("route", "auto") == "auto" and _unfused_wins(c),
    lambda c: {"route": "split_kv_unfused"})

RULES: tuple[Rule, ...] = (BLOCK_SKIP, FIT_TILES, STEP_IN_TILE, UNFUSED_CROSSOVER)
