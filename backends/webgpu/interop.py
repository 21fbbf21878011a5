"""Devices the caller opened: ``Session(backend="webgpu", device=<wgpu.GPUDevice>)`` runs on
the caller's device as the caller asked for it (its features and limits), and what an engine
does there (a buffer, a submit, a wait) for tests, the interop conformance cells and the
bench. Every host of the wgpu-py API uses it with its own API module and devices (dawn).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError
from attnreg.hookspecs import Interop

from . import device, probe
from .device import GpuDevice
from .runtime import WebGpuRuntime

# Ids of the caller's devices, one per Session that adopts one ("webgpu:caller1", ...).
_CALLERS = itertools.count(1)


@dataclass(frozen=True)
class Host:
    """A host of the wgpu-py API, as interop needs it."""

    backend: str
    package: str
    api: Callable[[], Any]                          # its API module (imported when used)
    caps_of: Callable[[Any, Any], DeviceCaps]       # (adapter, a device's view) -> caps
    request: tuple[str, ...]                        # the features attnreg opens devices with
    opened: Callable[[], Sequence[GpuDevice]]       # the devices attnreg opened
    get: Callable[[DeviceCaps, Mapping[str, Any]], GpuDevice]  # attnreg's, under flags
    make: Callable[[DeviceCaps, Any], GpuDevice]    # a GpuDevice over a caller's device
    tick: Callable[[], None] = lambda: None         # after a submit (Dawn frees finished work)

    def interop(self) -> Interop:
        return Interop(self.backend, adopt=self.adopt,
                       device=lambda caps, flags: self.get(caps, flags).device,
                       buffer=self.buffer, submit=self.submit, wait=self.wait)

    def adopt(self, obj: Any, flags: Mapping[str, Any], probed: list[DeviceCaps]) -> WebGpuRuntime:
        """A runtime on the caller's device: caps from the device's own features and limits,
        programs compiled on it (shared with attnreg's where it is attnreg's device)."""
        api = self.api()
        if not isinstance(obj, api.GPUDevice):
            raise SpecError("device", obj, f"a device id, index or name, or a {self.package}."
                            "GPUDevice the caller opened")
        view = SimpleNamespace(info=obj.adapter_info, features=obj.features, limits=obj.limits)
        caps = self.caps_of(obj.adapter, view)
        have = {str(f) for f in obj.features}
        offered = sorted(f for f in self.request if f in obj.adapter.features and f not in have)
        line = (f"the caller's device, as it was requested: features {sorted(have)}, its limits"
                + (f"; its adapter also offers {offered}, which kernels that need them would "
                   "use on a device requested with them" if offered else ""))
        caps = caps.model_copy(update={"id": f"{self.backend}:caller{next(_CALLERS)}",
                                       "settings": (*caps.settings, line)})
        return WebGpuRuntime(caps, device.adopted(obj, self.opened(), lambda: self.make(caps, obj)))

    def buffer(self, obj: Any, array: np.ndarray) -> Any:
        """A buffer of the engine's with the array's bytes (STORAGE | COPY_SRC | COPY_DST)."""
        U = self.api().BufferUsage
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        raw = np.concatenate([raw, np.zeros(-raw.size % 4 if raw.size else 4, np.uint8)])
        return obj.create_buffer_with_data(data=raw, usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)

    def submit(self, obj: Any, record: Callable[[Any], Any]) -> Any:
        """A new command encoder of the device, ``record(encoder)``, submitted."""
        enc = obj.create_command_encoder()
        got = record(enc)
        obj.queue.submit([enc.finish()])
        self.tick()
        return got

    def wait(self, obj: Any) -> None:
        device.wait_idle(self.api(), obj)


def _wgpu() -> Any:
    import wgpu

    return wgpu


HOST = Host(probe.NAME, "wgpu", _wgpu, lambda adapter, view: probe.caps_of(0, view),
            probe.REQUEST, device.opened, lambda caps, flags: device.get(caps),
            lambda caps, obj: GpuDevice(caps, None, obj))
