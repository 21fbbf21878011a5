"""One Dawn device per adapter (and per opt-in to experimental features), shared by every
Session in the process: backends.webgpu's GpuDevice (pipeline and layout caches, waits) with
wgpudawn as the API and Tint as the WGSL compiler."""

from __future__ import annotations

import threading
from typing import Any

from attnreg.backends.webgpu import program
from attnreg.backends.webgpu.device import GpuDevice
from attnreg.caps import DeviceCaps

from . import gemm_probe, probe


class DawnDevice(GpuDevice):
    """A wgpudawn device with every feature the kernels may need, the adapter's full compute
    limits and the device toggles of toggles.py (given to Dawn with the instance's)."""

    dialect = program.TINT
    request: tuple[str, ...] = probe.REQUEST

    def __init__(self, caps: DeviceCaps, adapter: Any, experimental: bool = False,
                 device: Any = None) -> None:
        if experimental:
            self.request = (*probe.REQUEST, *probe.EXPERIMENTAL)
        self.experimental = experimental
        super().__init__(caps, adapter, device)

    def api(self) -> Any:
        import wgpudawn

        return wgpudawn

    def open(self, adapter: Any, features: list[str], limits: dict[str, int]) -> Any:
        from wgpudawn.backends.dawn import extras

        return extras.request_device_sync(adapter, required_features=features,
                                          required_limits=limits)

    def submit(self, commands: list[Any]) -> None:
        """Submit, then let Dawn process finished work: it frees a submitted command
        buffer's memory only when its device is ticked, and a decode loop that never waits
        (outputs left on the device) grew by 55 KB a step without this."""
        from wgpudawn.backends.dawn import extras

        self.device.queue.submit(commands)
        extras.process_events()

    def matrix_peak(self) -> tuple[float | None, str]:
        """The GEMM probe's best f16 -> f32 rate on this adapter (gemm_probe.py), run on
        the device that requests the experimental feature; or None and why not."""
        why = gemm_probe.refusal(self.caps)
        if why:
            return None, why
        return gemm_probe.peak(self if self.experimental else get(self.caps, True))

    def wait_slice(self, promise: Any, seconds: float) -> None:
        """Dawn settles a promise only inside a wait or processEvents of this thread: wait
        for its future in Dawn, up to ``seconds`` (the GIL released), as wgpudawn's own sync
        wait does in 0.1 s chunks."""
        from wgpudawn.backends.dawn import _api, extras

        future = getattr(promise, "_wgpu_future_id", None)
        if future is None:
            extras.process_events()
            promise._thread_event.wait(min(seconds, 0.001))
            return
        info = _api.ffi.new("WGPUFutureWaitInfo *")
        info.future.id = future
        _api.libf.wgpuInstanceWaitAny(_api.get_wgpu_instance(), 1, info, int(seconds * 1e9))

    def module(self, label: str, wgsl: str, checks: int | None) -> Any:
        """Tint's checks are Dawn's robustness toggle (toggles.py), not a naga option."""
        return self.device.create_shader_module(label=label, code=wgsl)


_DEVICES: dict[tuple[str, bool], DawnDevice] = {}
_LOCK = threading.Lock()


def get(caps: DeviceCaps, experimental: bool = False) -> DawnDevice:
    """The process-wide Dawn device for a probed adapter."""
    key = (caps.id, experimental)
    with _LOCK:
        dev = _DEVICES.get(key)
        if dev is None:
            index = int(caps.id.rsplit(":", 1)[1])
            # Dawn lets an adapter make one device: the first device of a GPU takes the
            # probed adapter, a second one (the experimental kind) a fresh adapter object.
            first = not any(k[0] == caps.id for k in _DEVICES)
            adapter = probe.adapters()[index] if first else probe.fresh_adapter(index)
            dev = _DEVICES[key] = DawnDevice(caps, adapter, experimental)
        return dev


def opened() -> list[DawnDevice]:
    """The Dawn devices attnreg opened for probed adapters."""
    with _LOCK:
        return list(_DEVICES.values())
