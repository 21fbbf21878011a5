"""Tensors that live on a Session's device (the static KV cache built from them is
kv_cache.py's).

A DeviceTensor talks to the memory of the runtime that holds it
(:class:`attnreg.memory.Memory`, which every runtime implements) under its Session's guard
(guard.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ClosedError, SpecError
from .guard import Guard
from .memory import Memory

# Storage dtypes of DeviceTensors: the compute dtypes, int32 indices, and the codes of quantized
# K/V (int8 codes; uint8 pairs of int4 codes). Where a write may start and end is the
# memory's to say (Memory.write_refusal: WebGPU writes 1-byte tensors in whole words).
DTYPES = ("float32", "float16", "bfloat16", "int32", "int8", "uint8")


class DeviceTensor:
    """An array resident on one device of one Session (``Session.tensor`` / ``Session.empty``,
    or a caller's buffer: ``Session.wrap``).

    ``memory`` is the runtime that holds it; ``host`` optionally mirrors small integer
    tensors (seqlens) so that range checks need no device read-back. ``owned`` is False for
    a caller's buffer: attnreg never frees it, and its contents may change on the device at
    any time, so nothing derived from them is kept (its ``version`` changes on every read).
    """

    def __init__(self, session: object, guard: Guard, memory: Memory, device_id: str,
                 handle: Any, shape: tuple[int, ...], dtype: str,
                 host: np.ndarray | None = None, *, owned: bool = True) -> None:
        self.session = session      # the owner, for the "a tensor of this Session" checks
        self.guard, self.memory = guard, memory
        self.device_id = device_id
        self.handle = handle
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.host = host
        self.owned = owned
        self.freed = False
        self._version = 0

    @property
    def version(self) -> int:
        """Bumped on every write: derived data (block lists, padded twins, a widened bias)
        keys on it. A caller's buffer is written behind attnreg's back, so each read gives
        a new version and anything derived from it is derived again."""
        if not self.owned:
            self._version += 1
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value

    def check_live(self, field: str = "tensor") -> None:
        """ClosedError naming ``field`` if the tensor was freed or its Session closed."""
        if self.freed:
            raise ClosedError(field, self, "a live DeviceTensor (it was freed)")
        if self.guard.closed:
            raise ClosedError(field, self, "a tensor of an open Session (its Session was "
                              "closed, so its memory is gone)")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """Read the tensor back to the host (one device read)."""
        with self.guard.held():
            self.check_live()
            raw = self.memory.download(self.handle, self.nbytes)
        count = int(np.prod(self.shape))
        return np.frombuffer(bytes(raw), dtype=self.dtype, count=count).reshape(self.shape)

    def free(self) -> None:
        """Release the device memory now (a caller's buffer is only let go: it stays its
        owner's); any later use raises ClosedError. Freeing twice, or after the Session
        closed (which freed everything), is harmless."""
        with self.guard.held(check_open=False):
            if self.freed:
                return
            self.freed = True
            if not self.guard.closed:
                self.memory.free(self.handle)

    def write(self, array: np.ndarray, offset_elems: int = 0) -> None:
        """Copy a host array into the tensor, starting at a flat element offset."""
        with self.guard.held():
            self.check_live()
            arr, off = self._strip(array, offset_elems)
            self.memory.upload(self.handle, arr, off * self.dtype.itemsize)
            if self.host is not None:        # keep the host mirror of small tensors exact
                self.host.reshape(-1)[off:off + arr.size] = arr.reshape(-1)
            self.version += 1

    def _strip(self, array: Any, offset_elems: Any) -> tuple[np.ndarray, int]:
        """The checked array of a write and its element offset."""
        if not isinstance(array, np.ndarray):
            raise SpecError("array", array, f"a numpy array of {self.dtype.name}")
        if isinstance(offset_elems, bool) or not isinstance(offset_elems, (int, np.integer)):
            raise SpecError("offset_elems", offset_elems, "an integer >= 0")
        off = int(offset_elems)
        # every check before the copy that makes it contiguous (its size is the caller's)
        if array.dtype != self.dtype:
            raise SpecError("array.dtype", array.dtype.name, f"{self.dtype.name} like the tensor")
        size = self.dtype.itemsize
        if off < 0 or (off + array.size) * size > self.nbytes:
            raise SpecError("array", array, f"at most {self.nbytes // size - off} elements at "
                            "that offset")
        arr = np.ascontiguousarray(array)
        why = self.memory.write_refusal(size, off * size, arr.size * size, self.nbytes)
        if why:
            raise SpecError("offset_elems", offset_elems, f"a {self.dtype.name} write {why}")
        return arr, off

    def __repr__(self) -> str:
        whose = "" if self.owned else ", the caller's buffer"
        return (f"DeviceTensor(shape={self.shape}, dtype={self.dtype.name}, "
                f"device={self.device_id}{whose})")
