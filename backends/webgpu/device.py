"""One wgpu device per adapter, shared by every Session in the process, with its pipeline
cache keyed by (kernel id, WGSL source hash, binding layout): a new Session never
recompiles. Programs come from program.py; this module only compiles and lays them out."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from attnreg import env, interrupts
from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable

from . import probe
from .program import NAGA, Program, digest

# Runtime checks naga adds to our (trusted, generated) WGSL. The default, "bounds", keeps
# WebGPU's bounds checks but drops ForceLoopBounding: that extra counter in every loop hides
# the trip count from the driver, which then cannot unroll the tile loops and keeps the
# per-thread accumulators in local memory (10-30x slower on the H100). "all" is what
# create_shader_module does; "none" drops the bounds checks too.
CHECKS_ENV = "ATTNREG_WGSL_CHECKS"
_CHECKS = {"all": 0x3, "bounds": 0x1, "none": 0x0}
# A read-back waits for the device in slices of WAIT_SLICE_S, at most $ATTNREG_DEVICE_TIMEOUT
# seconds (default WAIT_S): between slices a held signal is delivered (interrupts.py), and a
# handler that raises, or the bound, cancels the map instead of leaving it pending.
WAIT_ENV = "ATTNREG_DEVICE_TIMEOUT"
WAIT_S = 600.0
WAIT_SLICE_S = 0.05


def _checks() -> int | None:
    """naga's runtime checks from ATTNREG_WGSL_CHECKS (a SpecError naming it when it is not
    one of _CHECKS); None for create_shader_module's own."""
    mode = env.choice(CHECKS_ENV, "bounds", tuple(_CHECKS))
    return None if mode == "all" else _CHECKS[mode]


def _trusted_module(dev: Any, label: str, code: str, checks: int) -> Any:
    """wgpuDeviceCreateShaderModuleTrusted through wgpu-py's cffi layer (wgpu-py 0.32 does
    not wrap it). Compile errors raise like create_shader_module's."""
    from wgpu.backends.wgpu_native import _api

    src = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
    src[0].chain.next = _api.ffi.NULL
    src[0].chain.sType = _api.lib.WGPUSType_ShaderSourceWGSL
    desc = _api.new_struct_p("WGPUShaderModuleDescriptor *",
                             nextInChain=_api.ffi.cast("WGPUChainedStruct *", src),
                             label=_api.to_c_string_view(label))
    handle = _api.libf.wgpuDeviceCreateShaderModuleTrusted(dev._internal, desc, checks)
    if handle == _api.ffi.NULL:
        raise RuntimeError("shader module creation failed")
    return _api.GPUShaderModule(label, handle, dev)


class GpuDevice:
    """A wgpu device opened with every feature the kernels may need and the adapter's
    full compute limits (the defaults are far below what the kernels use); or, given
    ``device``, a device the caller opened, as it opened it (interop.py)."""

    dialect = NAGA          # the WGSL compiler behind this device (program.py adapts to it)
    request: tuple[str, ...] = probe.REQUEST  # adapter features asked for whenever present

    def __init__(self, caps: DeviceCaps, adapter: Any, device: Any = None) -> None:
        self.wgpu = self.api()
        self.caps = caps
        self.device: Any
        if device is not None:
            self.features = sorted(str(f) for f in device.features)
            self.device = device
        else:
            self.features = [f for f in self.request if f in adapter.features]
            wanted = [*probe.LIMITS.values(), "max-compute-workgroup-size-y",
                      "max-compute-workgroup-size-z"]
            limits = {k: adapter.limits[k] for k in wanted if k in adapter.limits}
            self.device = self.open(adapter, self.features, limits)
        self.has_timestamps = "timestamp-query" in self.features
        self._lock = threading.Lock()
        self._pipelines: dict[tuple[Any, ...], Any] = {}
        self._layouts: dict[tuple[str, ...], tuple[Any, Any]] = {}
        self.compiles = 0          # how many pipelines were built (tests check the cache)
        self.trusted_ok = True

    # -- what another host of the wgpu-py API (backends.dawn) overrides ---------------------
    def api(self) -> Any:
        """The wgpu-py-API module of this host."""
        import wgpu

        return wgpu

    def open(self, adapter: Any, features: list[str], limits: dict[str, int]) -> Any:
        """The device, with these features and limits."""
        return adapter.request_device_sync(required_features=features, required_limits=limits)

    def submit(self, commands: list[Any]) -> None:
        """Submit command buffers (every submit of the runtime and memory goes here)."""
        self.device.queue.submit(commands)

    def map_read(self, buf: Any, size: int) -> bytes:
        """The first ``size`` bytes of a MAP_READ buffer whose copy was submitted. The wait is
        bounded and sliced (WAIT_ENV); on any exception (a signal's handler, the bound) the
        caller destroys the buffer, which cancels the pending map."""
        limit = env.seconds(WAIT_ENV, WAIT_S)            # before the map: a SpecError here
        deadline = time.monotonic() + limit
        promise = buf.map_async(self.wgpu.MapMode.READ, 0, size)
        while promise._state == "pending":               # wgpu-py's GPUPromise (both hosts)
            if interrupts.pending():
                interrupts.deliver()                     # its exception, if any, cancels
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the device did not finish within {limit:g} s "
                                   f"({WAIT_ENV}); the read-back was cancelled")
            self.wait_slice(promise, min(WAIT_SLICE_S, left))
        promise.sync_wait()                              # settled: raises a failed map
        try:
            return bytes(buf.read_mapped(0, size))
        finally:
            buf.unmap()

    def read_buffer(self, buf: Any, size: int) -> bytes:
        """The first ``size`` bytes of a COPY_SRC buffer: copied into a MAP_READ buffer of its
        own, read through map_read (bounded), which is destroyed after (for the probes, whose
        buffers live outside a runtime's Memory)."""
        U = self.wgpu.BufferUsage
        rb = self.device.create_buffer(size=size, usage=U.MAP_READ | U.COPY_DST)
        try:
            enc = self.device.create_command_encoder()
            enc.copy_buffer_to_buffer(buf, 0, rb, 0, size)
            self.submit([enc.finish()])
            return self.map_read(rb, size)
        finally:
            rb.destroy()

    def wait_slice(self, promise: Any, seconds: float) -> None:
        """Wait up to ``seconds`` for ``promise`` (wgpu-native's poll thread settles it)."""
        promise._thread_event.wait(seconds)

    def wait(self) -> None:
        """Block until every submitted command buffer has finished."""
        wait_idle(self.wgpu, self.device)

    def layout(self, accesses: tuple[str, ...]) -> tuple[Any, Any]:
        """(bind group layout, pipeline layout) for bindings 0.. with these accesses
        (uniform | read | rw), made once."""
        if accesses not in self._layouts:
            wgpu = self.wgpu
            kinds = {"uniform": wgpu.BufferBindingType.uniform,
                     "read": wgpu.BufferBindingType.read_only_storage,
                     "rw": wgpu.BufferBindingType.storage}
            bgl = self.device.create_bind_group_layout(entries=[
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                 "buffer": {"type": kinds[kind]}} for i, kind in enumerate(accesses)])
            pl = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            self._layouts[accesses] = (bgl, pl)
        return self._layouts[accesses]

    def matrix_peak(self) -> tuple[float | None, str]:
        """The matrix units' measured rate (Runtime.matrix_peak): naga has no subgroup
        matrices; backends.dawn overrides this."""
        return None, "no subgroup matrices through wgpu-native (naga has none): use backend dawn"

    def module(self, label: str, wgsl: str, checks: int | None) -> Any:
        """The shader module; naga's runtime ``checks`` (ATTNREG_WGSL_CHECKS)."""
        if checks is not None and self.trusted_ok:
            try:
                return _trusted_module(self.device, label, wgsl, checks)
            except (ImportError, AttributeError, TypeError):
                self.trusted_ok = False      # this wgpu-py cannot: use the checked path
        return self.device.create_shader_module(label=label, code=wgsl)

    def pipeline(self, prog: Program) -> Any:
        """The compute pipeline of a program, compiled on first use."""
        return self.compile(prog.kernel, prog.wgsl, prog.layout)

    def compile(self, label: str, wgsl: str, accesses: tuple[str, ...]) -> Any:
        """The compute pipeline for this source and binding layout (cached). A compile or
        validation failure raises KernelUnavailable carrying the compiler's message."""
        checks = _checks()              # a malformed variable fails here, not as a compile
        key = (label, digest(wgsl), checks, accesses)
        with self._lock:
            got = self._pipelines.get(key)
            if got is not None:
                return got
            _, pl = self.layout(accesses)
            try:
                module = self.module(label, wgsl, checks)
                got = self.device.create_compute_pipeline(
                    label=label, layout=pl, compute={"module": module, "entry_point": "main"})
            except Exception as exc:
                raise KernelUnavailable(label, f"WGSL compile failed: {exc}") from exc
            self.compiles += 1
            self._pipelines[key] = got
            return got


_DEVICES: dict[str, GpuDevice] = {}
_LOCK = threading.Lock()


def wait_idle(api: Any, device: Any) -> None:
    """Block until every command buffer submitted to a device has finished. wgpu-py 0.32's
    on_submitted_work_done_sync() has a broken callback signature, so poll the device
    with wait=True (wgpuDevicePoll), falling back to mapping a scratch buffer."""
    poll = getattr(device, "_poll_wait", None)
    if poll is not None:
        poll()
        return
    U = api.BufferUsage
    buf = device.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
    buf.map_sync(api.MapMode.READ)
    buf.unmap()
    buf.destroy()


def opened() -> list[GpuDevice]:
    """The devices attnreg opened for probed adapters."""
    with _LOCK:
        return list(_DEVICES.values())


# GpuDevices over devices the caller opened, while a runtime uses them
_ADOPTED: weakref.WeakValueDictionary[int, GpuDevice] = weakref.WeakValueDictionary()


def adopted(obj: Any, opened: Sequence[GpuDevice], make: Callable[[], GpuDevice]) -> GpuDevice:
    """The GpuDevice over a caller's device object: the one attnreg opened when the caller
    passes that very device (its compiled pipelines are shared), else one per object
    (``make()`` builds it), kept while a runtime uses it."""
    with _LOCK:
        dev = next((d for d in opened if d.device is obj), None) or _ADOPTED.get(id(obj))
        if dev is None or dev.device is not obj:
            dev = _ADOPTED[id(obj)] = make()
        return dev


def get(caps: DeviceCaps) -> GpuDevice:
    """The process-wide device for a probed adapter."""
    with _LOCK:
        dev = _DEVICES.get(caps.id)
        if dev is None:
            index = int(caps.id.rsplit(":", 1)[1])
            dev = _DEVICES[caps.id] = GpuDevice(caps, probe.adapters()[index])
        return dev
