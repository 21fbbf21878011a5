"""Device memory of one OpenCL runtime: DeviceTensor storage, the per-session buffer pool,
parameter blocks, and the copy-bandwidth probe.

DeviceTensors own plain ``cl.Buffer`` handles (``alloc``/``upload``/``download``/``free``);
the pool holds the runtime's own buffers (uploads of host inputs, partial states, scratch),
keyed by role and size so that a decode loop gets the same buffers every call -- which is
what lets a prepared launch keep its kernel arguments. Every host<->device transfer is
counted in ``counters`` (tests check that resident inputs cost none).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, OrderedDict
from typing import Any, cast

import numpy as np
import pyopencl as cl
import pyopencl.array as cl_array

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError

# The host-access flags a caller's buffer may carry (pyopencl names them).
_HOST_FLAGS = ("HOST_NO_ACCESS", "HOST_READ_ONLY", "HOST_WRITE_ONLY")
POOL_MAX = 48                 # buffers kept per session (least recently used go first)
COPY_BYTES = 256 * 2**20      # copy-bandwidth probe size


def raw_bytes(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as uint8 (a view, no copy): pyopencl copies through the
    buffer protocol, which ml_dtypes' bfloat16 does not export."""
    return arr.reshape(-1).view(np.uint8)


class DeviceMemory:
    """Buffers of one runtime on one device (all operations go through one in-order queue)."""

    def __init__(self, caps: DeviceCaps, ctx: cl.Context, queue: cl.CommandQueue, *,
                 owns_queue: bool = True) -> None:
        self.caps, self.ctx, self.queue = caps, ctx, queue
        # A caller's queue (interop) carries the caller's work too: wait for our own events
        # on it, never for the whole queue.
        self.owns_queue = owns_queue
        self._pool: OrderedDict[tuple[str, int], cl.Buffer] = OrderedDict()
        self._params: OrderedDict[bytes, cl.Buffer] = OrderedDict()
        # Events of non-blocking uploads and the host arrays they read, kept alive (and
        # unchanged) until the next sync.
        self._pending: list[Any] = []
        self.counters: Counter[str] = Counter()

    # -- DeviceTensor storage (the Runtime contract) ----------------------------------
    def _check_size(self, what: str, nbytes: int) -> None:
        cap = self.caps.limit("buffer_size")
        if cap is not None and nbytes > cap:
            raise SpecError(what, f"{nbytes} bytes", f"at most buffer_size={cap} bytes on "
                            f"{self.caps.name}")

    def alloc(self, nbytes: int) -> cl.Buffer:
        """A device buffer of at least ``nbytes`` (contents unspecified)."""
        self._check_size("tensor", int(nbytes))
        self.counters["allocs"] += 1
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(4, int(nbytes)))

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        return None                     # enqueue_copy writes at any byte offset

    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> cl.Buffer:
        """A handle of our own on a caller's ``pyopencl.Buffer`` (or an Array's buffer, its
        offset added) of this context: the buffer retained once more, or a sub-buffer at
        ``offset_bytes`` (aligned to the device's CL_DEVICE_MEM_BASE_ADDR_ALIGN). Freeing it
        drops only that reference; the caller's stays, and the memory lives while either
        does (a buffer the caller releases first stays valid for attnreg)."""
        if isinstance(buffer, cl_array.Array):
            buffer, offset_bytes = _array_bytes(buffer, offset_bytes, nbytes, dtype)
        if not isinstance(buffer, cl.Buffer) or buffer.context != self.ctx:
            raise SpecError("buffer", buffer, "a pyopencl.Buffer or pyopencl.array.Array of "
                            "this Session's context")
        align = max(1, int(self.queue.device.mem_base_addr_align) // 8)
        if offset_bytes % align:
            raise SpecError("offset", offset_bytes, f"a multiple of {align} bytes (this "
                            "device's CL_DEVICE_MEM_BASE_ADDR_ALIGN: where a sub-buffer starts)")
        if offset_bytes + nbytes > buffer.size:
            raise SpecError("buffer.size", buffer.size, f"at least {offset_bytes + nbytes} "
                            f"bytes: the tensor's {nbytes} bytes from offset {offset_bytes}")
        self.counters["wraps"] += 1
        if offset_bytes:
            return buffer.get_sub_region(offset_bytes, max(1, nbytes))
        return cast(cl.Buffer, cl.Buffer.from_int_ptr(buffer.int_ptr, retain=True))

    def _host_access(self, handle: cl.Buffer, denied: int, what: str) -> None:
        if int(handle.flags) & (denied | cl.mem_flags.HOST_NO_ACCESS):
            raise SpecError("buffer.flags", [n for n in _HOST_FLAGS if int(handle.flags)
                                             & getattr(cl.mem_flags, n)],
                            f"flags that let the host {what} it")

    def upload(self, handle: cl.Buffer, array: np.ndarray, offset_bytes: int = 0) -> None:
        """Copy a host array into a buffer at a byte offset (ordered with every launch)."""
        arr = np.array(array, copy=True, order="C")     # the caller may reuse its array
        self._host_access(handle, cl.mem_flags.HOST_READ_ONLY, "write")
        self.counters["host_uploads"] += 1
        self.counters["host_upload_bytes"] += int(arr.nbytes)
        ev = cl.enqueue_copy(self.queue, handle, raw_bytes(arr), dst_offset=int(offset_bytes),
                             is_blocking=False)
        self._keep(ev, arr)

    def download(self, handle: cl.Buffer, nbytes: int) -> bytes:
        """The first ``nbytes`` of a buffer (waits for the launches that write it)."""
        out = np.empty(int(nbytes), np.uint8)
        self._host_access(handle, cl.mem_flags.HOST_WRITE_ONLY, "read")
        self.counters["readbacks"] += 1
        self.counters["readback_bytes"] += int(nbytes)
        cl.enqueue_copy(self.queue, out, handle, is_blocking=True)
        self._pending.clear()              # an in-order queue: the uploads before are done
        return out.tobytes()

    def copy_rows(self, src: cl.Buffer, dst: cl.Buffer, rows: int, row_bytes: int,
                  src_pitch: int, dst_pitch: int) -> None:
        """Rows of ``row_bytes`` from src into dst at other pitches, zeros in the rest of
        dst's rows: one fill (only when dst's rows are wider) and one rectangular copy on
        the queue, any byte pitch."""
        if rows <= 0:
            return
        if dst_pitch > row_bytes:
            cl.enqueue_fill_buffer(self.queue, dst, np.uint8(0), 0, rows * dst_pitch)
        cl.enqueue_copy(self.queue, dst, src, src_origin=(0, 0, 0), dst_origin=(0, 0, 0),
                        region=(row_bytes, rows, 1), src_pitches=(src_pitch, rows * src_pitch),
                        dst_pitches=(dst_pitch, rows * dst_pitch))
        self.counters["copy_rows"] += 1

    def free(self, handle: cl.Buffer) -> None:
        """Release our reference to a tensor's buffer: on our own queue once it no longer
        uses it; on a caller's (which we never wait for) at once, as OpenCL deletes a buffer
        only after the commands queued with it have finished."""
        if self.owns_queue:
            self.sync()
        handle.release()

    def sync(self, events: list[Any] | None = None) -> None:
        """Wait for the uploads in flight (and ``events``): on our own queue, for the queue;
        on a caller's, for our own events only."""
        if self.owns_queue:
            self.queue.finish()
        else:
            mine = [e for e in [*self._pending, *(events or [])] if isinstance(e, cl.Event)]
            if mine:
                cl.wait_for_events(mine)
        self._pending.clear()

    def _keep(self, *objs: Any) -> None:
        self._pending.extend(objs)
        if len(self._pending) > 256:        # bound host memory held for in-flight copies
            self.sync()

    # -- the runtime's own buffers -----------------------------------------------------
    def pooled(self, role: str, nbytes: int, *, zeroed: bool = False) -> cl.Buffer:
        """The pool's buffer for (role, size); ``zeroed`` ones are filled with 0 when created
        (kernels that use them must leave them 0 again, see decode_fused)."""
        key = (role, max(4, int(nbytes)))
        buf = self._pool.pop(key, None)
        if buf is None:
            self._check_size(role, key[1])
            buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, key[1])
            if zeroed:
                cl.enqueue_fill_buffer(self.queue, buf, np.uint32(0), 0, key[1])
            while len(self._pool) >= POOL_MAX:
                # Not released here: a prepared launch may still hold it (GC frees it).
                self._pool.popitem(last=False)
        self._pool[key] = buf
        return buf

    def upload_pooled(self, role: str, array: np.ndarray, *, private: bool = False) -> cl.Buffer:
        """A host input copied into the pool's buffer for its role; ``private`` first takes
        a host copy (for runs that return before the copy has happened)."""
        arr = np.array(array, copy=True, order="C") if private else np.ascontiguousarray(array)
        buf = self.pooled(role, arr.nbytes)
        self.counters["host_uploads"] += 1
        self.counters["host_upload_bytes"] += int(arr.nbytes)
        ev = cl.enqueue_copy(self.queue, buf, raw_bytes(arr), is_blocking=False)
        self._keep(ev, arr)
        return buf

    def param_block(self, block: bytes) -> cl.Buffer:
        """The parameter block as a small __constant buffer, one per distinct block (a
        decode loop reuses it: no upload per launch)."""
        buf = self._params.pop(block, None)
        if buf is None:
            buf = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                            hostbuf=np.frombuffer(block, np.uint8))
            while len(self._params) >= POOL_MAX:
                self._params.popitem(last=False)
        self._params[block] = buf
        return buf

    def pool_ids(self) -> dict[tuple[str, int], int]:
        return {k: id(v) for k, v in self._pool.items()}

    # -- probes ------------------------------------------------------------------------
    def copy_bandwidth(self, nbytes: int = COPY_BYTES, iters: int = 10) -> float:
        """Device-to-device copy bandwidth in GB/s, counting bytes read and written (a copy
        of n bytes moves 2n), median of ``iters`` copies timed by profiling events."""
        limit = self.caps.limit("buffer_size") or nbytes
        n = int(min(nbytes, limit)) // 4 * 4
        src = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, n)
        dst = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, n)
        try:
            cl.enqueue_fill_buffer(self.queue, src, np.float32(1.0), 0, n)
            for _ in range(2):                                  # warm-up (clocks ramp)
                cl.enqueue_copy(self.queue, dst, src)
            self.queue.finish()
            secs = []
            timed = bool(self.queue.properties & cl.command_queue_properties.PROFILING_ENABLE)
            for _ in range(iters):
                t0 = time.perf_counter()
                ev = cl.enqueue_copy(self.queue, dst, src)
                ev.wait()
                secs.append((ev.profile.end - ev.profile.start) * 1e-9 if timed
                            else time.perf_counter() - t0)
            return 2 * n / statistics.median(secs) / 1e9
        finally:
            src.release()
            dst.release()

    def close(self) -> None:
        self.sync()
        for buf in [*self._pool.values(), *self._params.values()]:
            buf.release()
        self._pool.clear()
        self._params.clear()


def _array_bytes(arr: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> tuple[Any, int]:
    """(buffer, byte offset) of a wrapped ``pyopencl.array.Array``: contiguous, of the
    tensor's dtype, holding the tensor's bytes from ``offset_bytes`` into the array."""
    if arr.dtype != dtype or not arr.flags.c_contiguous:
        raise SpecError("buffer", arr, f"a C-contiguous {dtype.name} pyopencl.array.Array")
    if offset_bytes + nbytes > arr.nbytes:
        raise SpecError("buffer.nbytes", arr.nbytes, f"at least {offset_bytes + nbytes} bytes: "
                        f"the tensor's {nbytes} bytes from offset {offset_bytes}")
    return arr.base_data, int(arr.offset) + offset_bytes
