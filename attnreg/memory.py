"""The runtime contract's memory half: what DeviceTensors and KV caches ask of the runtime
that holds them. :class:`attnreg.Runtime` (hookspecs.py) extends it with launches and
measurements; every runtime implements all of it, so the core never probes a runtime for
what it has. A runtime that cannot do something a request needs says why through a refusal
method (``write_refusal``, ``quantize_refusal``), whose words become the SpecError."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .caps import DeviceCaps


@runtime_checkable
class Memory(Protocol):
    """Buffers on one device: handles from :meth:`alloc`, written, read, copied and freed in
    the order the calls are made, and launches see every write made before them."""

    caps: DeviceCaps
    counters: Counter[str]
    """Events and bytes, under one name on every backend: host_uploads, host_upload_bytes,
    readbacks, readback_bytes, allocs, frees (and the Runtime's launch counters)."""

    def alloc(self, nbytes: int) -> Any:
        """A buffer of at least ``nbytes`` for a DeviceTensor (contents unspecified)."""
        ...

    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> Any:
        """A handle over ``nbytes`` bytes of a caller's buffer from ``offset_bytes``, for a
        DeviceTensor of ``dtype`` elements (``Session.wrap``), checked against what the
        buffer is, its device, its size, its usage and the device's alignment rules: a
        SpecError naming what is wrong. The buffer stays its owner's: :meth:`free` of the
        handle forgets what was prepared with it and never destroys the buffer."""
        ...

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        """None if :meth:`upload` can write ``nbytes`` at ``offset_bytes`` of a tensor of
        ``tensor_bytes`` bytes whose elements are ``itemsize`` bytes wide; otherwise the
        writes this memory can make, in words (the SpecError's expected value)."""
        ...

    def upload(self, handle: Any, array: np.ndarray, offset_bytes: int = 0) -> None:
        """Copy a host array into a buffer at a byte offset (a write that
        :meth:`write_refusal` let through), ordered with the launches."""
        ...

    def download(self, handle: Any, nbytes: int) -> bytes:
        """The first ``nbytes`` of a buffer, after every launch issued before."""
        ...

    def free(self, handle: Any) -> None:
        """Release a buffer from :meth:`alloc`; nothing prepared with it is used again. A
        handle from :meth:`wrap` is forgotten the same way, its buffer left to its owner."""
        ...

    def copy_rows(self, src: Any, dst: Any, rows: int, row_bytes: int, src_pitch: int,
                  dst_pitch: int) -> None:
        """Copy ``rows`` rows of ``row_bytes`` bytes from buffer ``src`` (rows ``src_pitch``
        bytes apart) into buffer ``dst`` (rows ``dst_pitch`` apart), with zeros in the rest
        of each ``dst`` row; ordered with launches and uploads like :meth:`upload`, on the
        device (no host transfer). Pitches and sizes may be any byte counts: it widens or
        narrows a tensor's last axis (attnreg/headpad.py)."""
        ...

    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        """None if :meth:`quantize_into` can quantize float ``dtype`` vectors of
        ``head_size`` into ``kv_dtype`` ("int8" / "int4") on this device; otherwise why
        not, in words (it becomes the SpecError's message)."""
        ...

    def quantize_into(self, kv_dtype: str, rows: np.ndarray,
                      jobs: list[tuple[np.ndarray, Any, Any]]) -> None:
        """For each job (x, codes, scales): quantize x [R, H] (float32 / float16 / bfloat16,
        finite: the caller checked) and write vector r's codes at vector ``rows[r]`` of the
        buffer ``codes`` (viewed as int8 [V, H] or, int4, uint8 [V, H/2]) and its scales at
        ``rows[r]`` of ``scales`` (float32 [V], or float16 [V, H/32]); ordered like
        :meth:`upload`. ``rows`` int32 [R]: distinct and in range (the caller checked).
        Codes and scales equal :func:`attnreg.quantize_kv`'s except at exact rounding ties
        (one code off at most). Called only where :meth:`quantize_refusal` said None."""
        ...
