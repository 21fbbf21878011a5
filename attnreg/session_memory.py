"""A Session's device memory: the device its DeviceTensors live on, the runtimes opened
there, tensors allocated, uploaded or wrapped over a caller's buffer, and the KV caches
built from them. Session (session.py: plans and ops) inherits it; ``serialized`` marks the
operations that run one at a time under the session's guard."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from . import flags as flagmod
from . import params as paramsmod
from .caps import DeviceCaps
from .device_tensor import DTYPES, DeviceTensor
from .errors import SpecError
from .guard import Guard
from .hookspecs import Runtime
from .kv_cache import KVCache
from .plan import Plan
from .registry import Registry

F = TypeVar("F", bound=Callable[..., Any])


def serialized(method: F) -> F:
    """A Session operation: one thread at a time (the session's lock), refused after
    close(), and with Ctrl-C held until the device is consistent again (guard.py)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kw: Any) -> Any:
        with self._guard.held():
            return method(self, *args, **kw)
    return run  # type: ignore[return-value]


class SessionMemory:
    """The device memory half of a Session: what its DeviceTensors and KV caches ask of it.
    Session.__init__ sets the attributes below."""

    registry: Registry
    backend: str | None
    device: Any
    flags: dict[str, Any]
    _guard: Guard                        # the lock and open state its tensors share
    _adopted: Runtime | None             # the runtime on the caller's device object
    _home: str | None                    # where DeviceTensors live, once chosen
    _runtimes: dict[str, Runtime]        # device id -> the runtime opened on it

    def _runtime(self, caps: DeviceCaps) -> Runtime:
        with self._guard.lock:
            self._guard.check_open()
            rt = self._runtimes.get(caps.id)
            if rt is None:
                rt = self._runtimes[caps.id] = self.registry.open(
                    caps, flagmod.resolve(self.flags))
            return rt

    def home_device(self, device: str | int | None = None) -> str:
        """The device id DeviceTensors of this session live on (chosen once, best first)."""
        with self._guard.lock:
            if self._adopted is not None:
                here = self._adopted.caps.id
                if device not in (None, here):
                    raise SpecError("device", device, f"None or {here!r}: this Session runs on "
                                    "the caller's device")
                return here
            if device is None and self._home is not None:
                return self._home
            devs = [d for d in self.registry.find_device(self.backend, device if device is not None
                                                         else self.device) if d.available]
            if not devs:
                raise SpecError("device", device, "an available device for this session")
            if device is None:
                self._home = devs[0].id
            return devs[0].id

    def binding_limit(self, device_id: str) -> int | None:
        """The most bytes one kernel argument (a storage binding) may span on the device."""
        return self.device_runtime(device_id).caps.limit("storage_binding")

    def device_runtime(self, device_id: str) -> Runtime:
        """The runtime opened on a device (opened now if needed): its memory holds this
        session's DeviceTensors there."""
        with self._guard.lock:
            rt = self._runtimes.get(device_id)
        return rt if rt is not None else self._runtime(self._caps(device_id))

    def _caps(self, device_id: str) -> DeviceCaps:
        """A device of this session by id: among its backend's devices when it has one (so
        that a Session of one backend never probes the others)."""
        return next(d for d in self.registry.devices(self.backend) if d.id == device_id)

    @serialized
    def empty(self, shape: Sequence[int], dtype: str, *, device: str | int | None = None
              ) -> DeviceTensor:
        """An uninitialised tensor on the session's device (contents are unspecified)."""
        name, shape, nbytes, dev = self._checked_alloc(shape, dtype, device)
        rt = self.device_runtime(dev)
        return DeviceTensor(self, self._guard, rt, dev, rt.alloc(nbytes), shape, name)

    def _checked_alloc(self, shape: Any, dtype: Any, device: str | int | None
                       ) -> tuple[str, tuple[int, ...], int, str]:
        """(dtype name, shape, bytes, device id) of a tensor to allocate, every check done
        before anything of its size is allocated or copied."""
        dims, name = check_layout(shape, dtype)
        dev = self.home_device(device)
        nbytes = math.prod(dims) * np.dtype(name).itemsize
        caps = self.device_runtime(dev).caps       # a caller's device is not in the registry
        cap = caps.limit("buffer_size")
        if cap is not None and nbytes > cap:
            raise SpecError("shape", dims, f"at most buffer_size={cap} bytes on {caps.name} "
                            f"({nbytes} bytes asked)")
        return name, dims, nbytes, dev

    @serialized
    def wrap(self, buffer: Any, shape: Sequence[int], dtype: str, *, offset: int = 0,
             strides: Sequence[int] | None = None) -> DeviceTensor:
        """A DeviceTensor over a buffer the caller owns (a ``wgpu.GPUBuffer``, a
        ``pyopencl.Buffer`` or ``pyopencl.array.Array``) of this Session's device: ``shape``
        ``dtype`` elements from byte ``offset``, contiguous (``strides``, in elements, may say
        so). Checked against the buffer's size, usage and the device's alignment rules (a
        SpecError names what is wrong); runs read and write it in place, and attnreg never
        frees it (``free()`` only lets go of it). See docs/interop.md."""
        shape, name = check_layout(shape, dtype)
        dense = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        if strides is not None and (not isinstance(strides, (tuple, list))
                                    or tuple(strides) != dense):
            raise SpecError("strides", strides, f"None or the contiguous strides {dense} (in "
                            "elements): the kernels read tensors whole, laid out as the spec says")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise SpecError("offset", offset, "a byte offset >= 0 into the buffer")
        dev = self.home_device()
        rt = self.device_runtime(dev)
        dt = np.dtype(name)
        handle = rt.wrap(buffer, int(offset), math.prod(shape) * dt.itemsize, dt)
        return DeviceTensor(self, self._guard, rt, dev, handle, shape, name, owned=False)

    @serialized
    def tensor(self, array: Any, *, device: str | int | None = None) -> DeviceTensor:
        """Upload a host array once; pass the result to run() as often as you like."""
        if not isinstance(array, np.ndarray):
            raise SpecError("array", array, f"a numpy array of one of {DTYPES}")
        # checked before the copy that makes it contiguous (a broadcast view of 2**33
        # elements must be refused, not copied)
        self._checked_alloc(array.shape, array.dtype, device)
        arr = np.ascontiguousarray(array)
        t = self.empty(arr.shape, arr.dtype.name, device=device)
        t.write(arr)
        if arr.dtype in (np.int32, np.float32) and arr.size <= 4096:
            # seqlens, block tables, head sinks: checked on every run without a read-back
            t.host = arr.copy()
        return t

    @serialized
    def kv_cache(self, *, batch: int, kv_num_heads: int, head_size: int, capacity: int,
                 dtype: str = "float16", layout: str = "BSNH", kv_dtype: str | None = None,
                 page_size: int | None = None, num_pages: int | None = None,
                 block_table: np.ndarray | None = None,
                 device: str | int | None = None, v_head_size: int | None = None,
                 k: DeviceTensor | None = None, v: DeviceTensor | None = None,
                 k_scale: DeviceTensor | None = None, v_scale: DeviceTensor | None = None
                 ) -> KVCache:
        """A static KV cache on the device: layout BSNH, BNSH or paged (page_size, num_pages,
        an owned or given block_table), float K/V in ``dtype`` or quantized on append
        (kv_dtype "int8" / "int4"), v vectors of ``v_head_size`` (None: head_size) elements;
        over the caller's ``k`` / ``v`` (and scales) where given, e.g. wrapped engine buffers;
        see :class:`attnreg.KVCache`."""
        return KVCache(self, batch=batch, kv_num_heads=kv_num_heads, head_size=head_size,
                       capacity=capacity, dtype=dtype, layout=layout, kv_dtype=kv_dtype,
                       page_size=page_size, num_pages=num_pages, block_table=block_table,
                       device=device, v_head_size=v_head_size,
                       given={"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale})

    def _check_resident(self, plan: Plan, inputs: Mapping[str, Any]) -> None:
        """DeviceTensors must be live tensors of this session on the planned device."""
        for n, x in inputs.items():
            if not isinstance(x, DeviceTensor):
                continue
            x.check_live(f"tensors[{n!r}]")
            if x.session is not self:
                raise SpecError(f"tensors[{n!r}]", x, "a live DeviceTensor of this Session")
            if x.device_id != plan.caps.id:
                raise SpecError(f"tensors[{n!r}]", x, f"a tensor on the planned device {plan.caps.id}")


def check_layout(shape: Any, dtype: Any) -> tuple[tuple[int, ...], str]:
    """A DeviceTensor's shape (positive ints, int32-indexable) and dtype name, checked."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name not in DTYPES:
        raise SpecError("dtype", dtype, f"one of {DTYPES}")
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in shape):
        raise SpecError("shape", shape, "a tuple of integers")
    dims = tuple(int(x) for x in shape)
    if any(x < 1 for x in dims):
        raise SpecError("shape", dims, "positive sizes")
    if math.prod(dims) > paramsmod.INT_MAX:
        raise SpecError("shape", dims, "at most 2**31-1 elements (kernels index with int32)")
    return dims, name
