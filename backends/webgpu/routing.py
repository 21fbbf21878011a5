"""The WebGPU plugin's rules: tile fitting, the prefill step cap, masked-block skipping and
the unfused-decode crossover. Each why cites what it rests on; the measurements come from
``python3 -m backends.webgpu.bench_variants`` (lavapipe here, the H100 on the device
machine)."""

from __future__ import annotations

from typing import Any

from attnreg.rules import Ctx, Rule

from . import kernels, probe


def _ours(ctx: Ctx) -> bool:
    k = ctx.kernel
    return k is not None and k.backend == probe.NAME and k.family in kernels.SHRINK


def _params(ctx: Ctx) -> dict[str, Any]:
    return {**(ctx.kernel.defaults if ctx.kernel else {}), **ctx.params}


def _fit(ctx: Ctx) -> dict[str, int]:
    assert ctx.kernel is not None
    return kernels.fit_tiles(ctx.kernel, ctx.spec, ctx.params, ctx.caps.limit("workgroup_storage"))


FIT_TILES = Rule(
    "webgpu_tiles_fit_storage",
    "WebGPU prefill/decode tiles are halved (kv_tile, then q_tile or group_tile) until the "
    "workgroup storage fits the device", "params", lambda c: _ours(c) and bool(_fit(c)), _fit)


def _step_over_tile(ctx: Ctx) -> bool:
    p = _params(ctx)
    return (_ours(ctx) and ctx.kernel is not None and ctx.kernel.family == "prefill"
            and p.get("kv_staging") == "workgroup" and "max_k_step" not in ctx.user
            and int(p.get("max_k_step", 0)) > int(p.get("kv_tile", 0)))


STEP_IN_TILE = Rule(
    "webgpu_step_within_staged_tile",
    "with K/V staged in workgroup memory an inner step reads one staged kv_tile tile: "
    "max_k_step is capped at kv_tile", "params", _step_over_tile,
    lambda c: {"max_k_step": int(_params(c)["kv_tile"])})


# -- masked-block skipping -------------------------------------------------------------------
def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    return {"block_skip": mode == "on" or (mode == "auto" and _skip_pays(ctx))}


def _skip_pays(ctx: Ctx) -> bool:
    """'auto': where measured faster end to end. On CPU adapters the kernel takes 100-500 ms
    at 4 x 512 packed tokens, the host-side block list (attnreg.blocks.build) 2-40 ms."""
    return ctx.caps.device_type == "cpu"


BLOCK_SKIP = Rule(
    "webgpu_block_skip",
    "flag block_skip with a bias: 'on' runs the variant that visits only the KV blocks the "
    "bias's block list keeps; 'auto' does so on CPU adapters (lavapipe, 4 x 128 packed "
    "sequences: prefill 3.6-3.7x, decode rows 2.5x faster, and 0.97x the dense time on a "
    "bias with nothing to skip, while the host list costs 2-40 ms next to a 100-500 ms "
    "kernel); on GPUs a host bias's list costs more than the kernel saves, so 'auto' keeps "
    "the dense kernel there (use 'on' with a device-resident bias: its list is built once "
    "per written version)", "params",
    lambda c: c.spec.bias and c.kernel is not None and c.kernel.backend == probe.NAME
    and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip)


# -- unfused decode crossover ------------------------------------------------------------------
# Where decode_qk + decode_pv measured faster than decode_partial (fused), by device kind:
# (min GQA group, head sizes, min total length). Empty: fused everywhere it was measured.
UNFUSED_WINS: dict[str, list[tuple[int, tuple[int, ...], int]]] = {}


def _unfused_wins(ctx: Ctx) -> bool:
    regions = UNFUSED_WINS.get(ctx.caps.vendor, []) + UNFUSED_WINS.get(ctx.caps.device_type, [])
    s = ctx.spec
    return any(s.group_size >= g and s.head_size in hs and s.total_len >= L
               for g, hs, L in regions)


UNFUSED_CROSSOVER = Rule(
    "webgpu_unfused_decode_crossover",
    "split-KV decode as two kernels (decode_qk writes scores + split statistics, decode_pv "
    "normalises x V) where it measured faster than the fused decode_partial",
    "route_refine", lambda c: c.caps.backend == probe.NAME and c.params.get("route") == "split_kv"
    and c.flags.get("route", "auto") == "auto" and _unfused_wins(c),
    lambda c: {"route": "split_kv_unfused"})

RULES: tuple[Rule, ...] = (BLOCK_SKIP, FIT_TILES, STEP_IN_TILE, UNFUSED_CROSSOVER)
