"""A Session's browser: one headless Chromium (started on first launch, ended by close(),
and on errors and timeouts), and the encoding of a plan into one job for its page.

A launch sends one binary message: the buffers to (re)fill (the parameter block, the inputs'
raw bytes), the stages (the programs of backends/webgpu/program.py in Tint's dialect; the
source only the first time this page sees it, pipelines are cached there by source hash),
and the outputs to read back. All stages run in one compute pass and one submit, as in
backends/webgpu.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnreg import ports
from attnreg.backends import common
from attnreg.backends.webgpu import program
from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable
from attnreg.hostmem import HostMemory, wall_timings
from attnreg.plan import Plan
from attnreg.spec import AttentionSpec

from . import kernels
from .host import BrowserError, BrowserHost


def _raw(arr: np.ndarray) -> bytes:
    """An array's bytes, padded to a multiple of 4 (WebGPU's writeBuffer granule)."""
    data = np.ascontiguousarray(arr).tobytes()
    return data + b"\0" * (-len(data) % 4)


def _uploads(spec: AttentionSpec, inputs: Mapping[str, Any], families: tuple[str, ...],
             dtype: str) -> list[tuple[str, np.ndarray]]:
    """The inputs the stages read, as the page gets them: q, k, v in the dtype the first
    stage computes in, except quantized K/V (codes and scales), which go as stored: the
    kernels dequantize in their loads, whatever dtype they compute in."""
    widen = ("q",) if spec.kv_dtype else ("q", "k", "v")
    return [(name, inputs[name].astype(dtype, copy=False) if name in widen else inputs[name])
            for name in ports.reads(families, ports.WGSL) if inputs.get(name) is not None]


Job = tuple[dict[str, Any], dict[str, bytes], list[tuple[str, str, tuple[int, ...]]],
            list[program.Program]]


class BrowserRuntime(HostMemory):
    """Implements attnreg.Runtime on the page of one headless Chromium. DeviceTensors live
    in host memory and travel with each launch (a page has no memory a Session can keep)."""

    def __init__(self, caps: DeviceCaps) -> None:
        super().__init__()
        self.caps = caps
        self.host: BrowserHost | None = None
        self._sent: set[str] = set()         # pipeline keys whose source this page has
        self.browsers_started = 0
        self.warnings: list[str] = []        # Tint's non-error compiler messages
        self.last_ms: dict[str, float] = {}  # the page's compile / run time of the last job
        self._lock = threading.Lock()

    # -- the browser ---------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The browser's process id (None before the first launch and after close)."""
        return self.host.pid if self.host is not None and self.host.alive() else None

    def _ensure_host(self) -> BrowserHost:
        if self.host is not None and self.host.alive():
            return self.host
        if self.host is not None:
            self.host.close()
        self.host, self._sent = None, set()
        host = BrowserHost("run")
        if host.hello.get("error") or "deviceFeatures" not in host.hello:
            host.close()
            raise BrowserError(f"WebGPU in headless Chromium: {host.hello.get('error')}")
        self.host = host
        self.browsers_started += 1
        return host

    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        return ("the browser keeps DeviceTensors on the host and sends them with each "
                "launch: it has no on-device quantizer (the reference, webgpu, dawn and "
                "opencl backends have one)")

    # -- a plan as one job -------------------------------------------------------------------
    def programs(self, plan: Plan, bias_shape: tuple[int, ...] | None = None
                 ) -> list[program.Program]:
        """The plan's stages as Tint compiles them, each for the spec its device computes
        (float32 for a host-cast variant)."""
        return [program.build(st, kernels.device_spec(plan.spec, st.params), self.caps,
                              n_splits=program.n_splits(plan), op=plan.op,
                              bias_shape=bias_shape, dialect=program.TINT)
                for st in program.launch_stages(plan)]

    def job(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> Job:
        """(header, blobs, outputs as (name, dtype, shape), programs) of one launch; the
        header carries every stage's source (launch drops those the page has)."""
        spec = plan.spec
        bias = inputs.get("bias")
        if bias is not None and bias.dtype != np.float32:
            bias = bias.astype(np.float32)          # float16 / bfloat16 -> float32 is exact
        bias_shape = None if bias is None else tuple(int(n) for n in bias.shape)
        progs = self.programs(plan, bias_shape)
        n_splits = program.n_splits(plan)
        families = tuple(p.family for p in progs)
        # A host-cast stage computes in float32: its inputs are widened here (exactly) and
        # the output it writes is rounded back to the spec's dtype after the read-back.
        dev = spec if progs[-1].dtype == spec.dtype else spec.replace(dtype=progs[-1].dtype)
        blobs: dict[str, bytes] = {"params": program.param_block(plan, bias_shape)}
        buffers: list[dict[str, Any]] = [
            {"name": "params", "usage": "uniform", "size": common.SIZE, "blob": "params"},
            # Absent inputs bind a read-only stand-in, absent outputs a writable one: one
            # buffer may not be both in one dispatch.
            {"name": "dummy_r", "usage": "storage", "size": 16},
            {"name": "dummy_w", "usage": "storage", "size": 16}]
        for name, arr in _uploads(spec, {**inputs, "bias": bias}, families, progs[0].dtype):
            blobs[name] = _raw(arr)
            buffers.append({"name": name, "usage": "storage", "size": len(blobs[name]),
                            "blob": name})
        # the scratch one stage hands the next and the outputs (attnreg/ports.py)
        written = ports.written(families, dev, ports.WGSL)
        buffers += [{"name": p.name, "usage": "storage", "size": p.nbytes(dev, n_splits)}
                    for p in written]
        have = {buf["name"] for buf in buffers}

        def bound(bd: program.Binding) -> str:
            if bd.name in have:
                return bd.name
            return "dummy_w" if bd.access == "rw" else "dummy_r"

        results = ports.results(plan.op, written)
        header = {
            "label": "+".join(p.kernel for p in progs),
            "buffers": buffers,
            "stages": [{"key": p.key, "label": p.kernel, "family": p.family, "wgsl": p.wgsl,
                        "entry": p.entry, "grid": list(p.grid),
                        "bindings": [[bd.index, bd.access, bound(bd)] for bd in p.bindings]}
                       for p in progs],
            "outputs": [{"name": p.name, "buffer": p.name, "size": p.nbytes(dev, n_splits)}
                        for p in results],
        }
        outs = [(p.name, p.dtype(dev), p.shape_for(dev, n_splits)) for p in results]
        return header, blobs, outs, progs

    def launch(self, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run a plan in the browser; a stage Tint rejects raises KernelUnavailable with
        the compiler's messages (the session then plans without it)."""
        header, blobs, outs, _ = self.job(plan, self.host_inputs(inputs))
        with self._lock:
            res = self._launch(plan, header, blobs, outs)
        self.counters["launches"] += 1
        return self.place_outputs(res, outputs)

    def matrix_peak(self) -> tuple[float | None, str]:
        return None, ("the GEMM probe runs in-process through Dawn (backend dawn), not in "
                      "the page")

    def timings(self, plan: Plan, inputs: Mapping[str, Any], *, iters: int = 20,
                warmup: int = 3) -> dict[str, list[float]]:
        """Wall time per launch (a round trip to the page, inputs sent each time) and
        ``gpu_s``, the page's own time from submit to read-back."""
        page: list[float] = []

        def once() -> None:
            self.launch(plan, inputs)
            page.append(self.last_ms.get("run", 0.0) * 1e-3)
        res = wall_timings(once, iters, warmup)
        res["gpu_s"] = page[warmup:]
        return res

    def copy_bandwidth(self, nbytes: int = 32 << 20, repeats: int = 3) -> float:
        """GB/s (read + written) of the copy_bw kernel in the page, timed there from submit
        to the read-back of its last bytes."""
        n = nbytes // 16 * 16
        n_wg = min(65535, 8 * (self.caps.compute_units or 16))
        copy = program.utility("copy_bw", dialect=program.TINT)
        prog = {"key": f"copy_bw-{program.digest(copy.wgsl)}", "label": "copy_bw",
                "family": "copy_bw", "wgsl": copy.wgsl, "entry": program.ENTRY,
                "grid": [n_wg, 1, 1],
                "bindings": [[b.index, b.access, b.name] for b in copy.bindings]}
        header = {"label": "copy_bw", "stages": [prog], "outputs": [
            {"name": "tail", "buffer": "dst", "size": 16}], "buffers": [
            {"name": "job", "usage": "uniform", "size": 16, "blob": "job"},
            {"name": "src", "usage": "storage", "size": n},
            {"name": "dst", "usage": "storage", "size": n}]}
        blobs = {"job": struct.pack("<4I", n // 16, n_wg * copy.threads, 0, 0)}
        times = []
        with self._lock:
            for _ in range(repeats + 1):            # the first compiles and warms up
                self._launch(None, header, blobs, [("tail", "uint8", (16,))])
                times.append(self.last_ms.get("run", 0.0) * 1e-3)
        return 2 * n / max(min(times[1:]), 1e-9) / 1e9

    def _launch(self, plan: Plan | None, header: dict[str, Any], blobs: dict[str, bytes],
                outs: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        host = self._ensure_host()
        for attempt in range(2):
            sent = {**header, "stages": [
                {**st, "wgsl": None if st["key"] in self._sent else st["wgsl"]}
                for st in header["stages"]]}
            reply, data = host.call(sent, blobs)
            if reply.get("ok") or reply.get("kind") != "missing" or attempt:
                break
            self._sent.clear()                    # the page lost its cache: send sources
        self.warnings += [w for w in reply.get("warnings", []) if w not in self.warnings]
        if not reply.get("ok"):
            kind, err = reply.get("kind"), reply.get("error", "")
            if kind == "compile":
                raise KernelUnavailable(str(reply.get("stage")),
                                        f"WGSL compile failed in Chromium (Tint): {err}")
            raise BrowserError(f"the page could not run {header['label']} ({kind}): {err}")
        self._sent.update(st["key"] for st in header["stages"])
        self.last_ms = dict(reply.get("ms", {}))
        res: dict[str, np.ndarray] = {}
        for name, dtype, shape in outs:
            arr = np.frombuffer(bytes(data[name]), dtype=dtype).reshape(shape)
            res[name] = arr.astype(plan.spec.dtype) if plan and name == "out" else arr.copy()
        return res

    def close(self) -> None:
        """End this session's browser (and every process it started); a launch in flight
        on another thread then fails with BrowserError."""
        host, self.host = self.host, None
        self._sent = set()
        if host is not None:
            host.close()
