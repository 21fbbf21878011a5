"""OpenCL backend plugin: registers the backend and its kernel variants through the
same hooks a third-party plugin uses (entry point ``opencl = attnreg.backends.opencl.plugin``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attnreg
from attnreg.caps import DeviceCaps
from attnreg.hookspecs import BackendInfo, Interop, registers

from . import kernels, probe, rules


def _open(caps: DeviceCaps, flags: Mapping[str, Any]) -> attnreg.Runtime:
    """pyopencl platforms and devices; programs built once per device and shared."""
    from .runtime import OpenCLRuntime  # pyopencl is imported only when a device is used

    return OpenCLRuntime(caps)


def _lazy(name: str) -> Any:
    """interop.<name>, imported when called (pyopencl only when a queue is used)."""
    def call(*args: Any) -> Any:
        from . import interop

        return getattr(interop, name)(*args)
    return call


# How a Session runs on the caller's CommandQueue (interop.py).
INTEROP = Interop(probe.NAME, adopt=_lazy("adopt"), device=_lazy("engine_queue"),
                  buffer=_lazy("buffer"), submit=_lazy("submit"), wait=_lazy("wait"))
INFO = BackendInfo(probe.NAME, 5, probe.probe, _open)
attnreg_register_rules = registers(lambda: rules.RULES)
attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(kernels.declare)
attnreg_register_interop = registers(lambda: [INTEROP])
