"""A static KV cache on a Session's device, built from DeviceTensors (device_tensor.py).

A decode loop uploads its cache once, appends new tokens on the device and reads back only
what it asks for. A KVCache asks its Session for tensors through :class:`TensorSource`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .device_tensor import DeviceTensor
from .errors import SpecError
from .memory import Memory
from .spec import AttentionSpec


class TensorSource(Protocol):
    """What a KVCache asks of its Session (attnreg.Session is one)."""

    def home_device(self, device: str | int | None = None) -> str: ...

    def binding_limit(self, device_id: str) -> int | None: ...

    def device_runtime(self, device_id: str) -> Memory: ...

    def empty(self, shape: Sequence[int], dtype: str, *,
              device: str | int | None = None) -> DeviceTensor: ...

    def tensor(self, array: Any, *, device: str | int | None = None) -> DeviceTensor: ...


# the fields of the spec kv_cache makes -> the arguments the caller gave
_ARGS = {"kv_capacity": "capacity", "past_len": "capacity", "seq_len": "capacity",
         "num_heads": "kv_num_heads", "kv_layout": "layout"}


def _check_binding(probe: AttentionSpec, limit: int | None) -> None:
    """Kernels bind k and v whole: a cache past the device's storage-binding limit could
    never be attended over, so it is refused before it is allocated, naming its size."""
    for name, shape in (("k", probe.kv_code_shape), ("v", probe.v_code_shape)):
        nbytes = math.prod(shape) * np.dtype(probe.kv_code_dtype).itemsize
        if limit is not None and nbytes > limit:
            raise SpecError("capacity", probe.capacity, f"a cache whose {name} fits one storage "
                            f"binding of the device: {name} {list(shape)} would take {nbytes} "
                            f"bytes, the device binds at most {limit} (storage_binding)")


class KVCache:
    """A static KV cache on the device, and per-batch lengths that become the spec's
    ``seqlens_k``. Layouts (``layout``):

    - ``"BSNH"`` (the default): k, v [B, C, Nkv, H]; appending writes one strip per batch entry.
    - ``"BNSH"``: k, v [B, Nkv, C, H]; one strip per (batch, head).
    - ``"paged"`` (vLLM-style): k, v are page pools [num_pages, page_size, Nkv, H] and
      ``block_table`` [B, ceil(C / page_size)] int32 maps sequence b's page i to a pool page.
      By default the cache owns the table: pages come from a free list as sequences grow
      (lowest free page first), ``release(b)`` gives a finished sequence's pages back, and
      ``num_pages`` defaults to B * ceil(C / page_size) (every sequence can reach C). Or
      the caller passes ``block_table`` (its engine assigns pages): the cache writes through
      it, checks that written pages exist and that one append never writes a slot twice,
      and never changes it.

    ``k`` / ``v`` (and ``k_scale`` / ``v_scale``) may be DeviceTensors the caller brings,
    such as its engine's own buffers (``Session.wrap``): of this Session, in the cache's
    shape and storage dtype (a paged pool for ``"paged"``); appends write into them.

    ``kv_dtype`` "int8" / "int4" stores quantized K/V (docs/contract.md "Storage dtypes and
    quantized K/V"): k, v hold codes (spec.kv_code_shape / kv_code_dtype) and k_scale, v_scale the
    scales; ``append`` takes float K/V in ``dtype`` and quantizes it on the device (the runtime's
    ``quantize_into``) to quantize_kv's codes, give or take one at exact ties.

    Its :meth:`spec` fixes ``past_len = C - seq_len`` and ``kv_capacity = C`` so the spec,
    and therefore the plan, stay the same for every step of a decode loop.
    """

    def __init__(self, session: TensorSource, *, batch: int, kv_num_heads: int, head_size: int,
                 capacity: int, dtype: str = "float16", layout: str = "BSNH",
                 kv_dtype: str | None = None, page_size: int | None = None,
                 num_pages: int | None = None, block_table: np.ndarray | None = None,
                 device: str | int | None = None, v_head_size: int | None = None,
                 given: dict[str, DeviceTensor | None] | None = None) -> None:
        paged = layout == "paged"
        if paged and page_size is None:
            raise SpecError("page_size", page_size, "an integer >= 1, because layout is 'paged'")
        if not paged and block_table is not None:
            raise SpecError("block_table", block_table, "None, because layout is not 'paged'")
        if paged and num_pages is None and isinstance(page_size, int) and page_size >= 1 \
                and isinstance(capacity, int):
            num_pages = batch * -(-capacity // page_size)
        # The spec validates every field (and int4's head_size % 32) with its own messages,
        # under the names of kv_cache's own arguments.
        try:
            past = capacity - 1 if isinstance(capacity, int) else capacity   # "x" - 1: no
            probe = AttentionSpec(batch=batch, seq_len=1, past_len=past,
                                  num_heads=kv_num_heads, kv_num_heads=kv_num_heads,
                                  head_size=head_size, dtype=dtype, kv_layout=layout,
                                  kv_capacity=capacity, kv_dtype=kv_dtype, page_size=page_size,
                                  num_pages=num_pages, v_head_size=v_head_size)
        except SpecError as exc:
            field = _ARGS.get(exc.field, exc.field)
            expected = "an integer in [1, 2**31-1] (keys per sequence)" \
                if exc.field in ("past_len", "seq_len") else exc.expected
            raise SpecError(field, capacity if field == "capacity" else exc.value,
                            expected) from None
        self.session = session
        self.batch, self.kv_num_heads, self.head_size = batch, kv_num_heads, head_size
        self.v_head_size = v_head_size       # None: v's vectors have head_size elements too
        self.head_size_v = probe.head_size_v
        self.capacity, self.dtype, self.layout = capacity, dtype, layout
        self.kv_dtype, self.page_size, self.num_pages = kv_dtype, page_size, num_pages
        dev = session.home_device(device)
        _check_binding(probe, session.binding_limit(dev))
        if kv_dtype is not None:
            for h in {head_size, probe.head_size_v}:
                _quantizer(session.device_runtime(dev), kv_dtype, dtype, h)
        shapes = {"k": (probe.kv_code_shape, probe.kv_code_dtype),
                  "v": (probe.v_code_shape, probe.kv_code_dtype)}
        if kv_dtype is not None:
            shapes.update(k_scale=(probe.kv_scale_shape, probe.kv_scale_dtype),
                          v_scale=(probe.v_scale_shape, probe.kv_scale_dtype))
        made = {n: _given(session, dev, n, (given or {}).get(n), shape, dt)
                or session.empty(shape, dt, device=dev) for n, (shape, dt) in shapes.items()}
        self.k, self.v = made["k"], made["v"]
        self.guard = self.k.guard
        self.k_scale, self.v_scale = made.get("k_scale"), made.get("v_scale")
        self.lengths = np.zeros(batch, np.int32)
        self.seqlens = session.tensor(self.lengths.copy(), device=dev)
        self.block_table: DeviceTensor | None = None
        self.owns_pages = paged and block_table is None
        if paged:
            table = self._caller_table(block_table, probe) if block_table is not None else \
                np.zeros(probe.block_table_shape, np.int32)   # unassigned entries: page 0
            self.block_table = session.tensor(table, device=dev)
            self.block_table.host = table.copy()     # run() range-checks it, no read-back
            self.pages_held = np.zeros(batch, np.int64)  # owned: table[b, :pages_held[b]]
            self.free_pages = list(range(num_pages or 0))

    @staticmethod
    def _caller_table(table: Any, probe: AttentionSpec) -> np.ndarray:
        if not isinstance(table, np.ndarray) or table.dtype not in (np.int32, np.int64) \
                or table.shape != probe.block_table_shape:
            raise SpecError("block_table", table, f"an int32 array [B, ceil(C / page_size)] = "
                            f"{list(probe.block_table_shape)}")
        if (np.abs(table) > 2**31 - 1).any():
            raise SpecError("block_table", table, "values int32 can hold")
        return table.astype(np.int32)

    def spec(self, num_heads: int, seq_len: int = 1, **fields: Any) -> AttentionSpec:
        """The AttentionSpec for attending over this cache with seq_len new query rows."""
        paging = {"page_size": self.page_size, "num_pages": self.num_pages} \
            if self.layout == "paged" else {}
        return AttentionSpec(batch=self.batch, seq_len=seq_len, past_len=self.capacity - seq_len,
                             num_heads=num_heads, kv_num_heads=self.kv_num_heads,
                             head_size=self.head_size, dtype=self.dtype, kv_layout=self.layout,
                             kv_capacity=self.capacity, seqlens_k=True, kv_dtype=self.kv_dtype,
                             v_head_size=self.v_head_size, **paging, **fields)

    def tensors(self, q: Any) -> dict[str, Any]:
        """run()'s tensors: q, k, v, seqlens_k, and k_scale / v_scale, block_table if used."""
        t = {"q": q, "k": self.k, "v": self.v, "seqlens_k": self.seqlens}
        if self.kv_dtype is not None:
            t.update(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.block_table is not None:
            t["block_table"] = self.block_table
        return t

    def append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Write S new tokens per batch entry, [B, S, Nkv, H] in the cache's dtype, after each
        entry's length (quantized on the device for a quantized cache)."""
        for name, x, h in (("k_new", k_new, self.head_size), ("v_new", v_new, self.head_size_v)):
            want = (self.batch, None, self.kv_num_heads, h)
            if not isinstance(x, np.ndarray) or x.ndim != 4 or x.dtype != np.dtype(self.dtype) \
                    or any(w is not None and w != s for w, s in zip(want, x.shape)):
                raise SpecError(name, x, f"a {self.dtype} array [B={self.batch}, S, "
                                f"Nkv={self.kv_num_heads}, {'H' if name == 'k_new' else 'Hv'}"
                                f"={h}]")
        with self.guard.held(check_open=False):      # the tensors say if the session closed
            self._append(k_new, v_new)

    def _append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        for t in self._tensors():
            t.check_live()
        s = k_new.shape[1]
        if v_new.shape[:3] != k_new.shape[:3]:
            raise SpecError("v_new.shape", v_new.shape, f"the shape of k_new {k_new.shape} "
                            "in its first 3 dims")
        if (self.lengths + s > self.capacity).any():
            b = int(np.argmax(self.lengths + s > self.capacity))
            raise SpecError("k_new.shape[1]", s, f"at most capacity - length = "
                            f"{self.capacity - int(self.lengths[b])} new tokens for batch {b}")
        if self.kv_dtype is not None:
            _check_finite(k_new, v_new, self.kv_dtype)
        if self.layout == "paged":
            self._append_paged(k_new, v_new, s)
        elif self.kv_dtype is not None:
            self._quantize(self._rows(s, self.lengths), k_new, v_new)
        else:
            self._write_strips(k_new, v_new)
        self._grow(s)

    def _write_strips(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        n, c = self.kv_num_heads, self.capacity
        for b in range(self.batch):
            start = int(self.lengths[b])
            for dst, src, h in ((self.k, k_new, self.head_size), (self.v, v_new, self.head_size_v)):
                if self.layout == "BSNH":       # one contiguous strip per batch entry
                    dst.write(np.ascontiguousarray(src[b]), (b * c + start) * n * h)
                else:                           # one strip per (batch, head)
                    for j in range(n):
                        dst.write(np.ascontiguousarray(src[b, :, j]), ((b * n + j) * c + start) * h)

    def _grow(self, s: int) -> None:
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

    # -- paged -------------------------------------------------------------------------
    def _append_paged(self, k_new: np.ndarray, v_new: np.ndarray, s: int) -> None:
        """Assign the pages the new tokens need (owned table), write the tokens through the
        table, and on any failure give the new pages back and restore the table."""
        assert self.block_table is not None and self.block_table.host is not None
        table, held, free = self.block_table.host.copy(), self.pages_held.copy(), \
            list(self.free_pages)
        try:
            if self.owns_pages:
                self._assign_pages(s)
            slots = self._slots(s, self.lengths)            # [B, S] pool token slots
            if self.kv_dtype is not None:
                n = self.kv_num_heads
                rows = (slots[..., None] * n + np.arange(n)).reshape(-1).astype(np.int32)
                self._quantize(rows, k_new, v_new)
            else:
                self._write_slots(slots, k_new, v_new)
        except BaseException:
            self.pages_held, self.free_pages = held, free
            if not np.array_equal(self.block_table.host, table):
                self.block_table.write(table)
            raise

    def _assign_pages(self, s: int) -> None:
        assert self.block_table is not None and self.page_size is not None
        need = -(-(self.lengths.astype(np.int64) + s) // self.page_size)
        short = int((need - self.pages_held).clip(0).sum())
        if short > len(self.free_pages):
            raise SpecError("k_new.shape[1]", s, f"new tokens that fit the free pages: they need "
                            f"{short} new pages of {self.page_size}, {len(self.free_pages)} are "
                            f"free of num_pages={self.num_pages} (release() finished sequences)")
        for b in np.flatnonzero(need > self.pages_held):
            got = [self.free_pages.pop(0) for _ in range(int(need[b] - self.pages_held[b]))]
            self.block_table.write(np.array(got, np.int32),
                                   b * self.block_table.shape[1] + int(self.pages_held[b]))
            self.pages_held[b] = need[b]

    def _slots(self, s: int, lengths: np.ndarray) -> np.ndarray:
        """Pool token slot (page * page_size + offset) of each new token, [B, S]; checks the
        table's pages exist and that no slot is written twice."""
        assert self.block_table is not None and self.block_table.host is not None
        ps = int(self.page_size or 1)
        pos = lengths.astype(np.int64)[:, None] + np.arange(s)
        pages = np.take_along_axis(self.block_table.host.astype(np.int64), pos // ps, axis=1)
        bad = (pages < 0) | (pages >= int(self.num_pages or 0))
        if bad.any():
            b, i = (int(x) for x in np.argwhere(bad)[0])
            raise SpecError(f"block_table[{b}, {int(pos[b, i]) // ps}]", int(pages[b, i]),
                            f"a page in [0, num_pages={self.num_pages}) for the token at "
                            f"position {int(pos[b, i])} of batch {b}")
        slots = pages * ps + pos % ps
        if np.unique(slots).size != slots.size:
            raise SpecError("block_table", self.block_table.host, "pages that no two batch "
                            "entries write in one append (a slot would be written twice)")
        return slots

    def _write_slots(self, slots: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Unquantized paged append: one strip per run of consecutive slots (a page)."""
        for b in range(self.batch):
            cut = np.flatnonzero(np.diff(slots[b]) != 1) + 1
            for lo, hi in zip([0, *cut], [*cut, slots.shape[1]]):
                for dst, src, h in ((self.k, k_new, self.head_size),
                                    (self.v, v_new, self.head_size_v)):
                    per = self.kv_num_heads * h
                    dst.write(np.ascontiguousarray(src[b, lo:hi]), int(slots[b, lo]) * per)

    def release(self, b: int) -> None:
        """End sequence ``b``: its length becomes 0 and, when the cache owns the block table,
        its pages go back to the free list (a serving engine's finished request)."""
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.batch:
            raise SpecError("b", b, f"a batch index in [0, {self.batch})")
        with self.guard.held(check_open=False):
            for t in self._tensors():
                t.check_live()
            lengths = self.lengths.copy()
            lengths[b] = 0
            self.seqlens.write(lengths)
            self.lengths = lengths
            if self.owns_pages and self.block_table is not None:
                row = self.block_table.host[b, :self.pages_held[b]]  # type: ignore[index]
                self.free_pages = sorted(self.free_pages + [int(p) for p in row])
                self.pages_held[b] = 0

    # -- quantized ---------------------------------------------------------------------
    def _rows(self, s: int, lengths: np.ndarray) -> np.ndarray:
        """Destination vector (index into k viewed as [vectors, H]) of each new vector
        [b, s, n], flattened in k_new's order: where the kernel writes codes and scales."""
        n, c = self.kv_num_heads, self.capacity
        pos = lengths.astype(np.int64)[:, None, None] + np.arange(s)[None, :, None]
        bb = np.arange(self.batch)[:, None, None]
        nn = np.arange(n)[None, None, :]
        rows = (bb * c + pos) * n + nn if self.layout == "BSNH" else (bb * n + nn) * c + pos
        return rows.reshape(-1).astype(np.int32)

    def _quantize(self, rows: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """k_new, v_new quantized on the device into k / v and their scales at ``rows``
        (one runtime call: one upload, one submit), under append's lock."""
        assert self.kv_dtype is not None and self.k_scale is not None and self.v_scale is not None
        rt = _quantizer(self.k.memory, self.kv_dtype, self.dtype, self.head_size)
        jobs = [(np.ascontiguousarray(x).reshape(-1, x.shape[-1]), c.handle, sc.handle)
                for x, c, sc in ((k_new, self.k, self.k_scale), (v_new, self.v, self.v_scale))]
        # a runtime quantizes one vector width per call: k and v apart when Hv != H
        for part in ([jobs] if self.head_size_v == self.head_size else [jobs[:1], jobs[1:]]):
            rt.quantize_into(self.kv_dtype, rows, part)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            t.version += 1

    def _tensors(self) -> list[DeviceTensor]:
        return [t for t in (self.k, self.v, self.seqlens, self.k_scale, self.v_scale,
                            self.block_table) if t is not None]


def _given(session: TensorSource, dev: str, name: str, t: Any, shape: tuple[int, ...],
           dtype: str) -> DeviceTensor | None:
    """A cache tensor the caller brought (None: the cache makes its own), checked: a live
    DeviceTensor of this Session on the cache's device, in the cache's shape and dtype."""
    if t is None:
        return None
    want = f"a DeviceTensor of this Session on {dev}, {dtype} {list(shape)}"
    if not isinstance(t, DeviceTensor) or t.session is not session or t.device_id != dev \
            or t.shape != tuple(shape) or t.dtype != np.dtype(dtype):
        raise SpecError(name, t, want)
    t.check_live(name)
    return t


def _check_finite(k_new: np.ndarray, v_new: np.ndarray, kv_dtype: str) -> None:
    """A quantized cache cannot hold NaN or inf (quantize_kv refuses them too): checked on
    the host, where the new tokens are anyway, before anything is uploaded."""
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        bad = ~np.isfinite(x.astype(np.float32))
        if bad.any():
            at = [int(i) for i in np.argwhere(bad)[0]]
            raise SpecError(f"{name}{at}", float(x[tuple(at)]), f"a finite value (a {kv_dtype} "
                            "KV cache cannot hold NaN or inf)")


def _quantizer(rt: Memory, kv_dtype: str, dtype: str, head_size: int) -> Memory:
    """The device's runtime if it quantizes this storage on the device (its
    quantize_refusal says None); else a SpecError naming kv_dtype with the runtime's why."""
    why = rt.quantize_refusal(kv_dtype, dtype, head_size)
    if why:
        raise SpecError("kv_dtype", kv_dtype, f"a storage {rt.caps.backend} device "
                        f"{rt.caps.name} can quantize into: {why}")
    return rt
