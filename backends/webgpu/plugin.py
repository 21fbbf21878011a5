"""The WebGPU backend plugin: hookimpls only; the work lives in the sibling modules."""

from __future__ import annotations

from collections.abc import Callable

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.rules import Ctx, Rule

from . import kernels, probe
from .runtime import WebGpuRuntime


class WebGpuBackend:
    name = probe.NAME
    priority = 10

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> WebGpuRuntime:
        return WebGpuRuntime(caps)


def _ours(ctx: Ctx) -> bool:
    k = ctx.kernel
    return k is not None and k.backend == probe.NAME and k.family in kernels.SHRINK


def _fit(ctx: Ctx) -> dict[str, int]:
    assert ctx.kernel is not None
    return kernels.fit_tiles(ctx.kernel, ctx.spec, ctx.params, ctx.caps.limit("workgroup_storage"))


def _step_over_tile(ctx: Ctx) -> bool:
    p = {**(ctx.kernel.defaults if ctx.kernel else {}), **ctx.params}
    return (_ours(ctx) and ctx.kernel is not None and ctx.kernel.family == "prefill"
            and p.get("kv_staging") == "workgroup" and "max_k_step" not in ctx.user
            and int(p.get("max_k_step", 0)) > int(p.get("kv_tile", 0)))


STEP_IN_TILE = Rule(
    "webgpu_step_within_staged_tile",
    "with K/V staged in workgroup memory an inner step reads one staged kv_tile tile: "
    "max_k_step is capped at kv_tile", "params", _step_over_tile,
    lambda c: {"max_k_step": int({**(c.kernel.defaults if c.kernel else {}), **c.params}["kv_tile"])})

def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    on = ctx.spec.bias and (mode == "on" or (mode == "auto" and _skip_pays(ctx)))
    return {"block_skip": bool(on)}


def _skip_pays(ctx: Ctx) -> bool:
    return False


BLOCK_SKIP = Rule(
    "webgpu_block_skip",
    "flag block_skip: 'on' (with a bias) runs the variant that visits only the KV blocks the "
    "bias's block list keeps; 'off' and no bias the dense kernel", "params",
    lambda c: c.kernel is not None and c.kernel.backend == probe.NAME
    and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip)

FIT_TILES = Rule(
    "webgpu_tiles_fit_storage",
    "WebGPU prefill/decode tiles are halved (kv_tile, then q_tile or group_tile) until the "
    "workgroup storage fits the device", "params", lambda c: _ours(c) and bool(_fit(c)), _fit)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(WebGpuBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare() + kernels.declare_block_skip():
        register(k)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    register(BLOCK_SKIP)
    register(FIT_TILES)
    register(STEP_IN_TILE)
