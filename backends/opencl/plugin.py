"""OpenCL backend plugin: registers the backend and its kernel variants through the
same hooks a third-party plugin uses (entry point ``opencl = attnreg.backends.opencl.plugin``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.hookspecs import BackendInfo, registers

from . import kernels, probe, rules


def _open(caps: DeviceCaps, flags: Mapping[str, Any]) -> attnreg.Runtime:
    """pyopencl platforms and devices; programs built once per device and shared."""
    from .runtime import OpenCLRuntime  # pyopencl is imported only when a device is used

    return OpenCLRuntime(caps)


INFO = BackendInfo(probe.NAME, 5, probe.probe, _open)
attnreg_register_rules = registers(lambda: rules.RULES)
attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(kernels.declare)
