"""Tensors that live on a Session's device, and a static KV cache built from them.

A decode loop uploads its cache once, appends new tokens on the device and reads back
only what it asks for. Runtimes that keep memory on a device implement four methods
(``alloc``, ``upload``, ``download``, ``free``) and accept DeviceTensors in ``launch``;
for others the Session moves data through the host, so the API works everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ClosedError, SpecError
from .interrupts import deferred
from .spec import AttentionSpec

if TYPE_CHECKING:
    from .session import Session

DTYPES = ("float32", "float16", "int32")


class DeviceTensor:
    """An array resident on one device of one Session (``Session.tensor`` / ``Session.empty``).

    ``host`` optionally mirrors small integer tensors (seqlens) so that range checks need
    no device read-back.
    """

    def __init__(self, session: Session, device_id: str, handle: Any, shape: tuple[int, ...],
                 dtype: str, host: np.ndarray | None = None) -> None:
        self.session = session
        self.device_id = device_id
        self.handle = handle
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.host = host
        self.freed = False
        self.version = 0            # bumped on every write: derived data (block lists) keys on it

    def check_live(self, field: str = "tensor") -> None:
        """ClosedError naming ``field`` if the tensor was freed."""
        if self.freed:
            raise ClosedError(field, self, "a live DeviceTensor (it was freed)")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """Read the tensor back to the host (one device read)."""
        return self.session._download(self)

    def free(self) -> None:
        """Release the device memory now; any later use raises ClosedError. Freeing twice,
        or after the Session closed (which freed everything), is harmless."""
        self.session._free(self)

    def write(self, array: np.ndarray, offset_elems: int = 0) -> None:
        """Copy a host array into the tensor, starting at a flat element offset."""
        self.session._upload(self, array, offset_elems)

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device_id})"


class KVCache:
    """A static KV cache on the device: k, v of shape [B, C, Nkv, H] (kv_layout BSNH, the
    default: appending a token writes one strip per batch entry) or [B, Nkv, C, H] (BNSH:
    one strip per (batch, head)), and per-batch lengths that become the spec's ``seqlens_k``.

    Its :meth:`spec` fixes ``past_len = C - seq_len`` and ``kv_capacity = C`` so the spec,
    and therefore the plan, stay the same for every step of a decode loop.
    """

    def __init__(self, session: Session, *, batch: int, kv_num_heads: int, head_size: int,
                 capacity: int, dtype: str = "float16", layout: str = "BSNH",
                 device: str | int | None = None) -> None:
        probe = AttentionSpec(batch=batch, seq_len=1, past_len=capacity - 1,
                              num_heads=kv_num_heads, kv_num_heads=kv_num_heads,
                              head_size=head_size, dtype=dtype, kv_layout=layout)
        self.session = session
        self.batch, self.kv_num_heads, self.head_size = batch, kv_num_heads, head_size
        self.capacity, self.dtype, self.layout = capacity, dtype, layout
        self.k = session.empty(probe.kv_shape, dtype, device=device)
        self.v = session.empty(probe.kv_shape, dtype, device=device)
        self.lengths = np.zeros(batch, np.int32)
        self.seqlens = session.tensor(self.lengths.copy(), device=self.k.device_id)

    def spec(self, num_heads: int, seq_len: int = 1, **fields: Any) -> AttentionSpec:
        """The AttentionSpec for attending over this cache with seq_len new query rows."""
        return AttentionSpec(batch=self.batch, seq_len=seq_len, past_len=self.capacity - seq_len,
                             num_heads=num_heads, kv_num_heads=self.kv_num_heads,
                             head_size=self.head_size, dtype=self.dtype, kv_layout=self.layout,
                             kv_capacity=self.capacity, seqlens_k=True, **fields)

    def tensors(self, q: Any) -> dict[str, Any]:
        return {"q": q, "k": self.k, "v": self.v, "seqlens_k": self.seqlens}

    def append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Write S new tokens per batch entry, [B, S, Nkv, H], after each entry's length."""
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            want = (self.batch, None, self.kv_num_heads, self.head_size)
            if not isinstance(x, np.ndarray) or x.ndim != 4 or x.dtype != np.dtype(self.dtype) \
                    or any(w is not None and w != s for w, s in zip(want, x.shape)):
                raise SpecError(name, x, f"a {self.dtype} array [B={self.batch}, S, "
                                f"Nkv={self.kv_num_heads}, H={self.head_size}]")
        with self.session._lock, deferred():
            self._append(k_new, v_new)

    def _append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        for t in (self.k, self.v, self.seqlens):
            self.session._live(t)
        s = k_new.shape[1]
        if v_new.shape != k_new.shape:
            raise SpecError("v_new.shape", v_new.shape, f"the shape of k_new {k_new.shape}")
        if (self.lengths + s > self.capacity).any():
            b = int(np.argmax(self.lengths + s > self.capacity))
            raise SpecError("k_new.shape[1]", s, f"at most capacity - length = "
                            f"{self.capacity - int(self.lengths[b])} new tokens for batch {b}")
        h, n, c = self.head_size, self.kv_num_heads, self.capacity
        for b in range(self.batch):
            start = int(self.lengths[b])
            for dst, src in ((self.k, k_new), (self.v, v_new)):
                if self.layout == "BSNH":       # one contiguous strip per batch entry
                    dst.write(np.ascontiguousarray(src[b]), (b * c + start) * n * h)
                else:                           # one strip per (batch, head)
                    for j in range(n):
                        dst.write(np.ascontiguousarray(src[b, :, j]), ((b * n + j) * c + start) * h)
        # The lengths move last, device first: an exception (or an interrupt that was not
        # deferred, from another signal) before this point leaves the old lengths on both
        # sides (the new tokens sit beyond them, unseen); one during the seqlens write is
        # rolled back, so host lengths and device seqlens never disagree.
        old, grown = self.lengths, self.lengths + s
        try:
            self.seqlens.write(grown)
            self.lengths = grown
        except BaseException:
            self.lengths = old
            self.seqlens.write(old)
            raise
