"""The browser backend plugin: hookimpls only; the work lives in the sibling modules."""

from __future__ import annotations

from collections.abc import Callable

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.rules import Ctx, Rule
from backends.webgpu import kernels as wkernels

from . import kernels, probe
from .runtime import BrowserRuntime


class BrowserBackend:
    """WebGPU in headless Chromium. Ranked below backends.webgpu: a CPU adapter behind a
    browser is for proving portability, not for speed."""

    name = probe.NAME
    priority = 0            # below webgpu (10) and opencl (5); above reference (-100)

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> BrowserRuntime:
        return BrowserRuntime(caps)


def _ours(ctx: Ctx) -> bool:
    k = ctx.kernel
    return (k is not None and k.backend == probe.NAME
            and k.family in ("prefill", "decode_partial") and "kv_tile" in k.defaults)


def _fit(ctx: Ctx) -> dict[str, int]:
    assert ctx.kernel is not None
    return wkernels.fit_tiles(ctx.kernel, ctx.spec, ctx.params, ctx.caps.limit("workgroup_storage"))


FIT_TILES = Rule(
    "browser_tiles_fit_storage",
    "browser prefill/decode tiles are halved (kv_tile, then q_tile or group_tile) until the "
    "workgroup storage fits the adapter, as for backends.webgpu", "params",
    lambda c: _ours(c) and bool(_fit(c)), _fit)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(BrowserBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare():
        register(k)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    register(FIT_TILES)
