"""The runtime contract's memory half (memory.py) on host bytes, for runtimes whose data lives
on the host: the reference backend computes there, the browser ships each launch's inputs to
its page.

A handle is a uint8 numpy array; any byte of it can be written. DeviceTensors of such a
runtime are read as numpy views (no copy) when launched, and results asked for in a
DeviceTensor are written into it.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .device_tensor import DeviceTensor
from .errors import SpecError
from .plan import Plan
from .quant import quantize_kv

# Why host-memory runtimes take no caller's buffers and record into no caller's stream.
_HOST_ONLY = "this runtime keeps its tensors in host memory and runs each launch itself"


class HostMemory:
    """alloc / upload / download / free / copy_rows / copy_bandwidth and K/V quantization
    (attnreg.quantize_kv itself) on host memory, with the counters every runtime keeps
    (``host_uploads``, ``readbacks``, ``allocs``, ``frees``, ...)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def alloc(self, nbytes: int) -> np.ndarray:
        self.counters["allocs"] += 1
        return np.zeros(max(1, int(nbytes)), np.uint8)

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        return None

    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> Any:
        raise SpecError("buffer", buffer, f"a device buffer of a backend that runs on one "
                        f"({_HOST_ONLY})")

    def record_refusal(self, plan: Plan, inputs: Mapping[str, Any]) -> str | None:
        return f"there is no command stream of the caller's to record into ({_HOST_ONLY})"

    def record(self, plan: Plan, inputs: Mapping[str, Any], outputs: Mapping[str, Any],
               stream: Any, wait_for: Any = None) -> Any:
        raise SpecError("stream", stream, self.record_refusal(plan, inputs) or "")

    def upload(self, handle: np.ndarray, array: np.ndarray, offset_bytes: int = 0) -> None:
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        off = int(offset_bytes)
        if off < 0 or off + raw.size > handle.size:
            raise ValueError(f"upload of {raw.size} B at {off} overruns a {handle.size} B buffer")
        handle[off:off + raw.size] = raw
        self.counters["host_uploads"] += 1
        self.counters["host_upload_bytes"] += int(raw.size)

    def download(self, handle: np.ndarray, nbytes: int) -> bytes:
        self.counters["readbacks"] += 1
        self.counters["readback_bytes"] += int(nbytes)
        return bytes(handle[:int(nbytes)])

    def free(self, handle: np.ndarray) -> None:
        self.counters["frees"] += 1

    def copy_rows(self, src: np.ndarray, dst: np.ndarray, rows: int, row_bytes: int,
                  src_pitch: int, dst_pitch: int) -> None:
        if rows <= 0:
            return
        s = np.lib.stride_tricks.as_strided(src, (rows, row_bytes), (src_pitch, 1))
        d = np.lib.stride_tricks.as_strided(dst, (rows, dst_pitch), (dst_pitch, 1))
        d[:, row_bytes:] = 0
        d[:, :row_bytes] = s
        self.counters["copy_rows"] += 1

    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        return None                    # quantize_kv takes every float dtype and head size

    def quantize_into(self, kv_dtype: str, rows: np.ndarray,
                      jobs: list[tuple[np.ndarray, Any, Any]]) -> None:
        """attnreg.quantize_kv itself, written into the host-memory buffers at ``rows``."""
        for x, codes, scales in jobs:
            c, sc = quantize_kv(x, kv_dtype)
            c_all = codes.view(c.dtype)[: codes.size // c.shape[1] * c.shape[1]]
            c_all.reshape(-1, c.shape[1])[rows] = c
            per = 1 if sc.ndim == 1 else sc.shape[1]
            s_all = scales.view(sc.dtype)
            s_all[: s_all.size // per * per].reshape(-1, per)[rows] = sc.reshape(-1, per)
            self.counters["quantize_calls"] += 1

    def copy_bandwidth(self, nbytes: int = 64 << 20, repeats: int = 5) -> float:
        """Host memory copy GB/s (bytes read + written), median of ``repeats`` copies."""
        src = np.ones(int(nbytes), np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)                                   # warm-up: pages faulted in
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            secs.append(time.perf_counter() - t0)
        return 2 * src.nbytes / statistics.median(secs) / 1e9

    # -- helpers for launch ------------------------------------------------------------
    @staticmethod
    def host_inputs(inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The inputs with DeviceTensors of this memory replaced by numpy views of them."""
        return {n: view(x) if isinstance(x, DeviceTensor) else x for n, x in inputs.items()}

    def place_outputs(self, results: dict[str, Any], outputs: Mapping[str, Any] | None
                      ) -> dict[str, Any]:
        """Write the results asked for in DeviceTensors there; those come back as given."""
        for name, t in (outputs or {}).items():
            if t is not None:
                self.upload(t.handle, np.ascontiguousarray(results[name], dtype=t.dtype))
                results[name] = t
        return results


def view(t: DeviceTensor) -> np.ndarray:
    """A numpy view of a host-memory DeviceTensor, in its shape and dtype."""
    count = int(np.prod(t.shape, dtype=np.int64))
    return np.frombuffer(t.handle, dtype=t.dtype, count=count).reshape(t.shape)


def wall_timings(launch: Callable[[], Any], iters: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of ``launch`` by wall clock (runtimes without device timers)."""
    for _ in range(warmup):
        launch()
    wall = []
    for _ in range(iters):
        t0 = time.perf_counter()
        launch()
        wall.append(time.perf_counter() - t0)
    return {"wall_s": wall}
