"""OpenCL backend plugin: registers the backend and its kernel variants through the
same hooks a third-party plugin uses (entry point ``opencl = backends.opencl.plugin``)."""

from __future__ import annotations

from collections.abc import Callable

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.rules import Ctx, Rule

from . import kernels, probe


class OpenCLBackend:
    """pyopencl platforms and devices; programs built once per device and shared."""

    name = kernels.BACKEND
    priority = 5

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> attnreg.Runtime:
        from .runtime import OpenCLRuntime  # pyopencl is imported only when a device is used

        return OpenCLRuntime(caps)


# Query rows from which block skipping pays in "auto" mode (measured; see BLOCK_SKIP's why).
SKIP_MIN_ROWS = 16


def _skip_pays(ctx: Ctx) -> bool:
    """auto: a bias whose whole query tiles x KV blocks are -inf (packed sequences, document
    masks) makes the dense loop mostly wasted; with few query rows there are no whole tiles
    to skip and the list costs more than it saves."""
    return ctx.op == "attention" and ctx.spec.seq_len >= SKIP_MIN_ROWS


def _block_skip(ctx: Ctx) -> dict[str, bool]:
    mode = ctx.flags.get("block_skip", "auto")
    on = ctx.spec.bias and ctx.op == "attention" and (
        mode == "on" or (mode == "auto" and _skip_pays(ctx)))
    return {"block_skip": bool(on)}


BLOCK_SKIP = Rule(
    "opencl_block_skip",
    "flag block_skip (OpenCL): 'on' with a bias runs the variants that visit only the KV blocks "
    "the bias's block list keeps; 'auto' does so from 16 query rows (prefill), where whole "
    "blocks can be -inf; 'off', no bias, or partial states: the dense kernels", "params",
    lambda c: c.kernel is not None and c.kernel.backend == kernels.BACKEND
    and "block_skip" in c.kernel.params and "block_skip" not in c.user, _block_skip)


def _unfused_pays(ctx: Ctx) -> bool:
    s = ctx.spec
    return ctx.caps.device_type == "cpu" and s.seq_len == 1 and (
        s.group_size >= 8 or s.total_len >= 4096)


UNFUSED_ON_CPU = Rule(
    "opencl_unfused_decode_on_cpu",
    "OpenCL CPU devices, one query row: the unfused decode (decode_qk -> decode_pv -> reduce) "
    "measured faster than the fused decodes on PoCL (2 cores, f16, Nkv=2) for GQA group 8 "
    "(1.3-2.7x, e.g. H=128 L=8192: 14.0 vs 38.3 ms) and from L=4096 at groups 1 and 4 "
    "(1.0-1.4x, e.g. group 4 H=64 L=8192: 4.7 vs 5.8 ms); below that the fused decode wins or "
    "ties (group 4 H=128 L=2048: 1.13 vs 1.65 ms)", "route_refine",
    lambda c: c.caps.backend == kernels.BACKEND and c.op == "attention"
    and c.flags.get("route", "auto") == "auto"
    and c.params.get("route") in ("split_kv", "split_kv_fused") and _unfused_pays(c),
    lambda c: {"route": "split_kv_unfused"})


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    register(BLOCK_SKIP)
    register(UNFUSED_ON_CPU)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(OpenCLBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.kernel_infos():
        register(k)
