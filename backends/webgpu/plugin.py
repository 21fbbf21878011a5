"""The WebGPU backend plugin: hookimpls only; the work lives in the sibling modules."""

from __future__ import annotations

from collections.abc import Callable

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.rules import Rule

from . import kernels, mma, probe, rules
from .runtime import WebGpuRuntime


class WebGpuBackend:
    name = probe.NAME
    priority = 10

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> WebGpuRuntime:
        return WebGpuRuntime(caps)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(WebGpuBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare() + kernels.declare_block_skip() + mma.declare_matrix():
        register(k)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    for rule in rules.RULES:
        register(rule)
