"""OpenCL backend plugin: registers the backend and its kernel variants through the
same hooks a third-party plugin uses (entry point ``opencl = attnreg.backends.opencl.plugin``)."""

from __future__ import annotations

from collections.abc import Callable

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.rules import Rule

from . import kernels, probe, rules


class OpenCLBackend:
    """pyopencl platforms and devices; programs built once per device and shared."""

    name = probe.NAME
    priority = 5

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> attnreg.Runtime:
        from .runtime import OpenCLRuntime  # pyopencl is imported only when a device is used

        return OpenCLRuntime(caps)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    for rule in rules.RULES:
        register(rule)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(OpenCLBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare():
        register(k)
