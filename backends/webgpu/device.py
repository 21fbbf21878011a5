"""One wgpu device per adapter, shared by every Session in the process, with its pipeline
cache keyed by (kernel id, WGSL source hash): a new Session never recompiles."""

from __future__ import annotations

import os
import threading
from typing import Any

from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable

from . import probe, source

# Runtime checks naga adds to our (trusted, generated) WGSL. The default, "bounds", keeps
# WebGPU's bounds checks but drops ForceLoopBounding: that extra counter in every loop hides
# the trip count from the driver, which then cannot unroll the tile loops and keeps the
# per-thread accumulators in local memory (10-30x slower on the H100). "all" is what
# create_shader_module does; "none" drops the bounds checks too.
CHECKS_ENV = "ATTNREG_WGSL_CHECKS"
_CHECKS = {"all": 0x3, "bounds": 0x1, "none": 0x0}


def _checks() -> int | None:
    mode = os.environ.get(CHECKS_ENV, "bounds").strip().lower()
    if mode not in _CHECKS:
        raise ValueError(f"{CHECKS_ENV}={mode!r}: expected one of {sorted(_CHECKS)}")
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


# Bindings of each family's module (see shaders/*.wgsl): (binding, kind).
_ATTN = [(0, "uniform")] + [(i, "read") for i in range(1, 7)] + [(7, "rw"), (8, "rw")]
BINDINGS: dict[str, list[tuple[int, str]]] = {
    "prefill": _ATTN,
    "decode_partial": _ATTN,
    "reduce": [(0, "uniform"), (1, "read"), (2, "read"), (3, "read"), (4, "rw"), (5, "rw")],
    # q, k, v, bias, seqlens, sink in; scores [B,Nq,S,C] and per-split (max, sum) out
    "decode_qk": _ATTN,
    # attn_common's v (3) and seqlens (5); o_parts, lse_parts out; scores, stats in
    "decode_pv": [(0, "uniform"), (3, "read"), (5, "read"), (7, "rw"), (8, "rw"),
                  (9, "read"), (10, "read")],
    # f16 strips at 2-byte offsets (memory.py): params, source words, destination words
    "patch16": [(0, "uniform"), (1, "read"), (2, "rw")],
    "copy_bw": [(0, "uniform"), (1, "read"), (2, "rw")],
}
# Optional read-only inputs a variant adds after its family's bindings (the paged KV block
# table, the masked-block list) sit at source.AUX_BINDINGS; a layout key names them:
# "prefill+block_table".


def layout_key(family: str, aux: tuple[str, ...] = ()) -> str:
    """The bind-group layout of a family with optional aux inputs (sorted, '+'-joined)."""
    return "+".join((family, *sorted(aux)))


def bindings(key: str) -> list[tuple[int, str]]:
    """(binding, kind) of a layout key: the family's bindings, then its aux inputs."""
    family, *aux = key.split("+")
    return BINDINGS[family] + [(source.AUX_BINDINGS[a][family], "read") for a in aux]


class GpuDevice:
    """A wgpu device opened with every feature the kernels may need and the adapter's
    full compute limits (the defaults are far below what the kernels use)."""

    def __init__(self, caps: DeviceCaps, adapter: Any) -> None:
        import wgpu

        self.wgpu = wgpu
        self.caps = caps
        self.features = [f for f in probe.REQUEST if f in adapter.features]
        wanted = [*probe.LIMITS.values(), "max-storage-buffers-per-shader-stage",
                  "max-compute-workgroup-size-y", "max-compute-workgroup-size-z"]
        limits = {k: adapter.limits[k] for k in wanted if k in adapter.limits}
        self.device = adapter.request_device_sync(required_features=self.features,
                                                  required_limits=limits)
        self.has_timestamps = "timestamp-query" in self.features
        self._lock = threading.Lock()
        self._pipelines: dict[tuple[str, str, str], Any] = {}
        self._layouts: dict[str, tuple[Any, Any]] = {}
        self.compiles = 0          # how many pipelines were built (tests check the cache)
        self.trusted_ok = True

    def wait(self) -> None:
        """Block until every submitted command buffer has finished. wgpu-py 0.32's
        on_submitted_work_done_sync() has a broken callback signature, so poll the device
        with wait=True (wgpuDevicePoll), falling back to mapping a scratch buffer."""
        poll = getattr(self.device, "_poll_wait", None)
        if poll is not None:
            poll()
            return
        U = self.wgpu.BufferUsage
        buf = self.device.create_buffer(size=16, usage=U.MAP_READ | U.COPY_DST)
        buf.map_sync(self.wgpu.MapMode.READ)
        buf.unmap()
        buf.destroy()

    def layout(self, family: str) -> tuple[Any, Any]:
        """(bind group layout, pipeline layout) of a family or layout key, made once."""
        if family not in self._layouts:
            wgpu = self.wgpu
            kinds = {"uniform": wgpu.BufferBindingType.uniform,
                     "read": wgpu.BufferBindingType.read_only_storage,
                     "rw": wgpu.BufferBindingType.storage}
            bgl = self.device.create_bind_group_layout(entries=[
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                 "buffer": {"type": kinds[kind]}} for i, kind in bindings(family)])
            pl = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            self._layouts[family] = (bgl, pl)
        return self._layouts[family]

    def module(self, label: str, wgsl: str) -> Any:
        checks = _checks()
        if checks is not None and self.trusted_ok:
            try:
                return _trusted_module(self.device, label, wgsl, checks)
            except (ImportError, AttributeError, TypeError):
                self.trusted_ok = False      # this wgpu-py cannot: use the checked path
        return self.device.create_shader_module(label=label, code=wgsl)

    def pipeline(self, kernel_id: str, family: str, wgsl: str) -> Any:
        """The compute pipeline for this source, compiled on first use (``family`` is the
        layout key). A compile or validation failure raises KernelUnavailable carrying the
        compiler's message."""
        key = (kernel_id, source.digest(wgsl), os.environ.get(CHECKS_ENV, "") + family)
        with self._lock:
            got = self._pipelines.get(key)
            if got is not None:
                return got
            _, pl = self.layout(family)
            try:
                module = self.module(kernel_id, wgsl)
                got = self.device.create_compute_pipeline(
                    label=kernel_id, layout=pl, compute={"module": module, "entry_point": "main"})
            except Exception as exc:
                raise KernelUnavailable(kernel_id, f"WGSL compile failed: {exc}") from exc
            self.compiles += 1
            self._pipelines[key] = got
            return got


_DEVICES: dict[str, GpuDevice] = {}
_LOCK = threading.Lock()


def get(caps: DeviceCaps) -> GpuDevice:
    """The process-wide device for a probed adapter."""
    with _LOCK:
        dev = _DEVICES.get(caps.id)
        if dev is None:
            index = int(caps.id.rsplit(":", 1)[1])
            dev = _DEVICES[caps.id] = GpuDevice(caps, probe.adapters()[index])
        return dev
