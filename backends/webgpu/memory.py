"""Device memory of a WebGPU runtime: the Session's DeviceTensors (alloc / upload / download /
free) and the runtime's own named buffers (host-input staging, scratch, read-back); the
copy-bandwidth probe that gives the bench its roof is copy_probe.py.

Every host<->device transfer is counted in ``counters`` so tests can check that a decode
loop over resident tensors moves nothing it does not have to.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError

from . import device, program

# queue.writeBuffer and copies need 4-byte offsets and sizes; storage bindings at an offset
# need the device's minStorageBufferOffsetAlignment (256 on every adapter we know).
_WORD = 4
BIND_ALIGN = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class Window:
    """The bytes of a caller's buffer that a wrapped DeviceTensor covers (Session.wrap): bound
    and copied at ``offset`` for ``size`` bytes; the buffer stays the caller's."""

    buffer: Any
    offset: int
    size: int


def span(handle: Any) -> tuple[Any, int, int]:
    """(buffer, first byte, bytes) of a handle: a Window's part of its buffer, or a buffer."""
    if isinstance(handle, Window):
        return handle.buffer, handle.offset, handle.size
    return handle, 0, int(handle.size)


def resource(handle: Any) -> dict[str, Any]:
    """A bind-group resource for a handle (a Window binds its part of the buffer)."""
    buf, off, size = span(handle)
    return {"buffer": buf, "offset": off, "size": size} if isinstance(handle, Window) \
        else {"buffer": buf}


class DeviceMemory:
    """Buffers of one runtime on one wgpu device. ``forget(buffer)`` is called before a
    buffer is destroyed, so the runtime drops everything prepared with it (bind groups)."""

    def __init__(self, dev: device.GpuDevice, caps: DeviceCaps,
                 forget: Callable[[Any], None]) -> None:
        self.dev, self.wgpu, self.caps = dev, dev.wgpu, caps
        self._forget = forget
        self._bufs: dict[str, tuple[Any, int]] = {}
        self._owned: dict[int, Any] = {}           # id -> buffer handed out by alloc()
        self.counters: Counter[str] = Counter()

    # -- the runtime's own buffers ----------------------------------------------------------
    def buffer(self, name: str, nbytes: int, usage: int) -> Any:
        """A named buffer of at least nbytes, reused while big enough. Growing it lets go of
        the old one, and everything prepared with it is forgotten; the old one is released,
        not destroyed: a caller's encoder that a launch was recorded into may still hold it
        unsubmitted (wgpu frees it once nothing uses it)."""
        nbytes = max(16, cdiv(nbytes, 16) * 16)
        got = self._bufs.get(name)
        if got is None or got[1] < nbytes:
            if got is not None:
                self._forget(got[0])
            buf = self.dev.device.create_buffer(label=name, size=nbytes, usage=usage)
            self._bufs[name] = got = (buf, nbytes)
        return got[0]

    def storage(self, name: str, nbytes: int) -> Any:
        U = self.wgpu.BufferUsage
        return self.buffer(name, nbytes, U.STORAGE | U.COPY_SRC | U.COPY_DST)

    def stage(self, name: str, arr: np.ndarray) -> Any:
        """A host input copied into the named buffer (counted as a host upload)."""
        data = np.ascontiguousarray(arr)
        buf = self.storage(name, data.nbytes)
        raw = data.view(np.uint8).reshape(-1)
        if raw.size % _WORD:
            raw = np.concatenate([raw, np.zeros(_WORD - raw.size % _WORD, np.uint8)])
        self.dev.device.queue.write_buffer(buf, 0, raw)
        self.counters["host_uploads"] += 1
        self.counters["host_upload_bytes"] += int(data.nbytes)
        return buf

    def dummy(self, writable: bool) -> Any:
        # A read-only and a writable stand-in: one buffer may not be both in one dispatch.
        return self.storage("dummy_w" if writable else "dummy_r", 16)

    def read(self, handle: Any, nbytes: int, enc: Any = None) -> bytes:
        """Copy nbytes from the start of a handle to the host (one submit and wait)."""
        U = self.wgpu.BufferUsage
        size = cdiv(nbytes, _WORD) * _WORD
        self._need(handle, U.COPY_SRC, "COPY_SRC", "read it back (numpy())")
        # (not span(): a buffer's size is a wgpu call this path need not make)
        buf, first = (handle.buffer, handle.offset) if isinstance(handle, Window) else (handle, 0)
        rb = self.buffer("rb_download", size, U.MAP_READ | U.COPY_DST)
        enc = enc or self.dev.device.create_command_encoder()
        enc.copy_buffer_to_buffer(buf, first, rb, 0, size)
        self.dev.submit([enc.finish()])
        return self.map_read(rb, nbytes)

    def map_read(self, rb: Any, nbytes: int) -> bytes:
        """Wait for and copy out the first nbytes of a MAP_READ buffer (a submitted copy)."""
        size = cdiv(nbytes, _WORD) * _WORD
        try:
            raw = self.dev.map_read(rb, size)
        except BaseException:
            # Interrupted, timed out or failed while a map was pending: the buffer may stay
            # mapped or pending, and copying into it would abort the process. Destroying it
            # cancels the map; the next read makes a new buffer.
            self.discard(rb)
            raise
        self.counters["readbacks"] += 1
        self.counters["readback_bytes"] += nbytes
        return raw[:nbytes]

    def discard(self, buf: Any) -> None:
        """Destroy one of the runtime's named buffers (a later request recreates it)."""
        for name, (b, _) in list(self._bufs.items()):
            if b is buf:
                del self._bufs[name]
                self._forget(b)
                b.destroy()

    # -- a caller's buffers (Session.wrap) -------------------------------------------------------
    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> Window:
        """A Window over a caller's GPUBuffer of this device, which the kernels bind as a
        storage buffer at ``offset_bytes`` (the device's minStorageBufferOffsetAlignment) for
        ``nbytes`` rounded up to whole words; read-back and writes check their own usages."""
        api, U, mine = self.wgpu, self.wgpu.BufferUsage, self.dev.device
        if not isinstance(buffer, api.GPUBuffer) or getattr(buffer, "_device", None) is not mine:
            raise SpecError("buffer", buffer, f"a {api.__name__}.GPUBuffer of this Session's "
                            "device")
        if not buffer.usage & U.STORAGE:
            raise SpecError("buffer.usage", self.usages(buffer), "STORAGE among its usages: the "
                            "kernels bind it as a storage buffer (COPY_SRC too to read it back, "
                            "COPY_DST to write it)")
        align = int(self.dev.device.limits.get("min-storage-buffer-offset-alignment", BIND_ALIGN))
        if offset_bytes % align:
            raise SpecError("offset", offset_bytes, f"a multiple of {align} bytes (this device's "
                            "minStorageBufferOffsetAlignment: where a storage binding may start)")
        size = max(_WORD, cdiv(nbytes, _WORD) * _WORD)
        if offset_bytes + size > buffer.size:
            raise SpecError("buffer.size", buffer.size, f"at least {offset_bytes + size} bytes: "
                            f"the tensor's {nbytes} bytes (in whole {_WORD}-byte words) from "
                            f"offset {offset_bytes}")
        limit = self.caps.limit("storage_binding")
        if limit is not None and size > limit:
            raise SpecError("buffer", f"{size} bytes from {offset_bytes}", f"at most "
                            f"max-storage-buffer-binding-size={limit} bytes: one binding")
        return Window(buffer, offset_bytes, size)

    def usages(self, buffer: Any) -> list[str]:
        U = self.wgpu.BufferUsage
        return [n for n in ("MAP_READ", "MAP_WRITE", "COPY_SRC", "COPY_DST", "INDEX", "VERTEX",
                            "UNIFORM", "STORAGE", "INDIRECT", "QUERY_RESOLVE")
                if buffer.usage & getattr(U, n)]

    def _need(self, handle: Any, flag: int, name: str, why: str) -> None:
        """A caller's buffer lacking a usage a copy needs: a SpecError instead of the API's
        validation error (wgpu-native aborts the process on some)."""
        if isinstance(handle, Window) and not handle.buffer.usage & flag:
            raise SpecError("buffer.usage", self.usages(handle.buffer), f"{name} among its "
                            f"usages, to {why}")

    # -- DeviceTensor memory (the Runtime contract) ---------------------------------------------
    def alloc(self, nbytes: int) -> Any:
        """A device buffer for a DeviceTensor: STORAGE | COPY_SRC | COPY_DST, size rounded up
        to 4 bytes. Its contents are unspecified until written."""
        U = self.wgpu.BufferUsage
        size = max(_WORD, cdiv(int(nbytes), _WORD) * _WORD)
        buf = self.dev.device.create_buffer(label="tensor", size=size,
                                            usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
        self._owned[id(buf)] = buf
        self.counters["allocs"] += 1
        return buf

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        """The write granule: queue.writeBuffer writes whole 32-bit words. 2-byte elements
        at any element offset are patched in (patch16); 1-byte ones are not, so their writes
        start and end on words, except that one reaching the tensor's end is padded into
        its allocation's last word (alloc rounds sizes up to words)."""
        end = offset_bytes + nbytes
        if itemsize == 1 and (offset_bytes % _WORD or (end % _WORD and end != tensor_bytes)):
            return (f"that starts and ends on {_WORD}-byte boundaries (or at the tensor's "
                    f"end): byte {offset_bytes}..{end} of {tensor_bytes}")
        return None

    def upload(self, handle: Any, array: np.ndarray, offset_bytes: int = 0) -> None:
        """Write a host array into a device buffer at a byte offset. 4-byte aligned strips go
        through queue.writeBuffer; f16 strips at an odd element offset or of odd length go
        through the patch16 kernel (no read-back; queue order keeps writes in call order);
        a 1-byte strip off the word (a tensor's last, write_refusal lets no other through)
        is padded with zeros to the word."""
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if array.dtype.itemsize == 1 and raw.size % _WORD:
            raw = np.concatenate([raw, np.zeros(-raw.size % _WORD, np.uint8)])
        off, n = int(offset_bytes), int(raw.size)
        if n == 0:
            return
        buf, first, size = span(handle)
        if off < 0 or off + n > size:
            raise ValueError(f"upload of {n} B at {off} overruns a {size} B buffer")
        self._need(handle, self.wgpu.BufferUsage.COPY_DST, "COPY_DST", "write it (write(), "
                   "KV cache appends)")
        self.counters["host_uploads"] += 1
        self.counters["host_upload_bytes"] += n
        if off % _WORD == 0 and n % _WORD == 0:
            self.dev.device.queue.write_buffer(buf, first + off, raw)
            return
        if off % 2 or n % 2:
            raise ValueError(f"upload at byte {off} of {n} B: offsets and sizes must be even")
        self._patch16(handle, raw, off)

    def _patch16(self, dst: Any, raw: np.ndarray, off: int) -> None:
        U = self.wgpu.BufferUsage
        q = self.dev.device.queue
        padded = raw if raw.size % _WORD == 0 else np.concatenate([raw, np.zeros(2, np.uint8)])
        src = self.buffer("patch_src", padded.size, U.STORAGE | U.COPY_DST)
        q.write_buffer(src, 0, padded)
        base = off // BIND_ALIGN * BIND_ALIGN          # bind a window: buffers may exceed
        end = cdiv(off + raw.size, _WORD) * _WORD         # the storage-binding limit
        first = (off - base) // _WORD
        nwords = (end - base) // _WORD - first
        buf, at, _ = span(dst)
        self._utility("patch16", struct.pack("<4I", off - base, raw.size, first, nwords),
                      {"buffer": src, "offset": 0, "size": padded.size},
                      {"buffer": buf, "offset": at + base, "size": end - base}, nwords)

    def _utility(self, name: str, block: bytes, src: dict[str, Any], dst: dict[str, Any],
                 nwords: int) -> None:
        """One dispatch of a utility kernel (shaders/<name>.wgsl, built by program.utility:
        a uniform block, source words, destination words; one invocation per destination
        word) in its own submit, ordered with uploads and launches by the queue; nothing
        waits."""
        U = self.wgpu.BufferUsage
        params = self.buffer(f"{name}_params", len(block), U.UNIFORM | U.COPY_DST)
        self.dev.device.queue.write_buffer(params, 0, block)
        prog = program.utility(name, dialect=self.dev.dialect)
        pipe = self.dev.compile(f"webgpu.{name}", prog.wgsl, prog.layout)
        group = self.dev.device.create_bind_group(
            layout=self.dev.layout(prog.layout)[0],
            entries=[{"binding": 0, "resource": {"buffer": params}},
                     {"binding": 1, "resource": src}, {"binding": 2, "resource": dst}])
        enc = self.dev.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, group)
        groups = cdiv(nwords, prog.threads)
        x = min(groups, 65535)
        cp.dispatch_workgroups(x, cdiv(groups, x), 1)
        cp.end()
        self.dev.device.queue.submit([enc.finish()])
        self.counters[name] += 1

    def copy_rows(self, src: Any, dst: Any, rows: int, row_bytes: int, src_pitch: int,
                  dst_pitch: int) -> None:
        """Rows of ``row_bytes`` from src into dst at other pitches, zeros in the rest of
        each dst row (shaders/copy_rows.wgsl: one dispatch, one submit, no wait). dst is
        written in whole words up to its rows' end rounded to a word, which an alloc()
        buffer always holds."""
        if rows <= 0:
            return
        nwords = cdiv(rows * dst_pitch, _WORD)
        buf, at, _ = span(dst)
        self._utility("copy_rows", struct.pack("<8I", rows, row_bytes, src_pitch, dst_pitch,
                                               nwords, 0, 0, 0),
                      resource(src), {"buffer": buf, "offset": at, "size": nwords * _WORD},
                      nwords)

    def download(self, handle: Any, nbytes: int) -> bytes:
        """The first nbytes of a device buffer (one copy, one wait)."""
        return self.read(handle, int(nbytes))

    def free(self, handle: Any) -> None:
        """Destroy a buffer from alloc(); prepared launches that bound it are forgotten, so a
        later buffer at the same address never meets a stale bind group. A Window is only
        forgotten: its buffer is the caller's."""
        self._forget(handle)
        if self._owned.pop(id(handle), None) is not None:
            handle.destroy()
            self.counters["frees"] += 1

    def drop(self, handle: Any) -> None:
        """Forget a buffer from alloc() without destroying it: wgpu releases it once no
        command buffer (a caller's recorded one, not submitted yet, included) holds it."""
        self._forget(handle)
        self._owned.pop(id(handle), None)

    def close(self) -> None:
        for buf, _ in self._bufs.values():
            buf.destroy()
        for buf in self._owned.values():
            buf.destroy()
        self._bufs.clear()
        self._owned.clear()
