"""OpenCLRuntime: one device opened for one Session -- its queue, buffer pool and launches.

Programs come from the process-wide cache in programs.py (a new Session does not
rebuild); buffers are pooled per Session by (role, size); a run uploads its inputs,
enqueues every stage, reads back only the outputs and waits once (one queue.finish).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyopencl as cl

from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable, SpecError
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec
from backends import common

from . import kernels, programs

_POOL_MAX = 48                 # buffers kept per session (least recently used go first)
_CTX_LOCK = threading.Lock()
_CONTEXTS: dict[str, tuple[cl.Context, cl.Device]] = {}


def device_context(caps: DeviceCaps) -> tuple[cl.Context, cl.Device]:
    """The one context per device in this process (programs are shared through it)."""
    with _CTX_LOCK:
        got = _CONTEXTS.get(caps.id)
        if got is None:
            pi, di = int(caps.extra["platform_index"]), int(caps.extra["device_index"])
            dev = cl.get_platforms()[pi].get_devices()[di]
            got = _CONTEXTS[caps.id] = (cl.Context([dev]), dev)
        return got


@dataclass
class _Launch:
    kernel_id: str
    kernel: cl.Kernel
    gsize: int
    lsize: int
    args: list[Any]


@dataclass
class _Prepared:
    launches: list[_Launch]
    outputs: dict[str, tuple[cl.Buffer, tuple[int, ...], Any]] = field(default_factory=dict)
    uploads: list[Any] = field(default_factory=list)


def _variant(kernel_id: str) -> tuple[str, str]:
    info = kernels.VARIANTS.get(kernel_id)
    if info is None:
        raise KernelUnavailable(kernel_id, "not an OpenCL kernel this runtime can launch")
    return info


class OpenCLRuntime:
    """Runs plans on one OpenCL device; implements attnreg.Runtime (and timings)."""

    def __init__(self, caps: DeviceCaps) -> None:
        self.caps = caps
        self.ctx, self.device = device_context(caps)
        props = cl.command_queue_properties.PROFILING_ENABLE
        self.queue = cl.CommandQueue(self.ctx, self.device, properties=props)
        self._pool: OrderedDict[tuple[str, int], cl.Buffer] = OrderedDict()
        self._kernels: dict[tuple[int, str], cl.Kernel] = {}
        self._params: OrderedDict[bytes, cl.Buffer] = OrderedDict()
        self._lock = threading.RLock()

    # -- resources ---------------------------------------------------------------------
    def _buffer(self, role: str, nbytes: int) -> cl.Buffer:
        key = (role, max(4, int(nbytes)))
        buf = self._pool.pop(key, None)
        if buf is None:
            if nbytes > (self.caps.limit("buffer_size") or nbytes):
                raise SpecError(role, f"{nbytes} bytes", f"at most buffer_size="
                                f"{self.caps.limit('buffer_size')} bytes on {self.caps.name}")
            buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, key[1])
            while len(self._pool) >= _POOL_MAX:
                self._pool.popitem(last=False)[1].release()
        self._pool[key] = buf
        return buf

    def _param_block(self, block: bytes) -> cl.Buffer:
        """The parameter block as a small __constant buffer, one per distinct block (a
        decode loop reuses it: no upload per launch)."""
        buf = self._params.pop(block, None)
        if buf is None:
            buf = cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                            hostbuf=np.frombuffer(block, np.uint8))
            while len(self._params) >= _POOL_MAX:
                self._params.popitem(last=False)[1].release()
        self._params[block] = buf
        return buf

    def _upload(self, prep: _Prepared, role: str, arr: np.ndarray) -> cl.Buffer:
        buf = self._buffer(role, arr.nbytes)
        prep.uploads.append(cl.enqueue_copy(self.queue, buf, arr, is_blocking=False))
        return buf

    def _kernel(self, kernel_id: str, family: str, g: kernels.Geometry,
                defines: dict[str, int]) -> cl.Kernel:
        source = programs.load_source(family)
        prog = programs.build(self.ctx, self.device, kernel_id, source,
                              programs.options({**defines, **g.defines()}))
        key = (prog.int_ptr, programs.ENTRY[family])
        k = self._kernels.get(key)
        if k is None:
            k = cl.Kernel(prog, programs.ENTRY[family])
            self._check_kernel(kernel_id, k, g)
            self._kernels[key] = k
        return k

    def _check_kernel(self, kernel_id: str, k: cl.Kernel, g: kernels.Geometry) -> None:
        info = cl.kernel_work_group_info
        allowed = k.get_work_group_info(info.WORK_GROUP_SIZE, self.device)
        if allowed < g.wg:
            raise KernelUnavailable(kernel_id, f"compiled kernel allows {allowed} work-items "
                                    f"per work-group, geometry needs {g.wg}")
        if g.sg_impl in (kernels.SG_IMPLS["khr"], kernels.SG_IMPLS["intel"]):
            # The code assumes sub-groups of exactly g.sg work-items; ask the driver.
            try:
                got = k.get_sub_group_info(
                    self.device, cl.kernel_sub_group_info.MAX_SUB_GROUP_SIZE_FOR_NDRANGE,
                    (g.wg,))
            except cl.Error as exc:
                raise KernelUnavailable(kernel_id, f"sub-group size query failed: {exc}") from None
            if got != g.sg:
                raise KernelUnavailable(kernel_id, f"driver runs sub-groups of {got}, the "
                                        f"kernel was built for {g.sg}")
        local = k.get_work_group_info(info.LOCAL_MEM_SIZE, self.device)
        limit = self.caps.limit("workgroup_storage")
        if limit is not None and local > limit:
            raise KernelUnavailable(kernel_id, f"uses {local} B of local memory, device has "
                                    f"{limit} B")

    # -- planning a launch -------------------------------------------------------------
    def _stage(self, prep: _Prepared, spec: AttentionSpec, stage: Stage,
               bufs: dict[str, cl.Buffer], bias: np.ndarray | None,
               split: dict[str, int]) -> None:
        family, variant = _variant(stage.kernel)
        params = {**stage.params, **split}
        g = kernels.geometry(family, variant, spec, params, self.caps)
        defines = {"IS_F16": int(spec.dtype == "float16"), "HD": spec.head_size,
                   "BIAS_F16": int(bias is not None and bias.dtype == np.float16)}
        k = self._kernel(stage.kernel, family, g, defines)
        block = self._param_block(common.pack(spec, params, None if bias is None else bias.shape))
        if family == "reduce":
            gsize = spec.batch * spec.num_heads * spec.seq_len * g.wg
            args = [block, bufs["o_parts"], bufs["lse_parts"], bufs.get("head_sink"),
                    bufs["out"], bufs.get("lse")]
        elif family == "prefill":
            gsize = g.n_groups(spec) * g.wg
            args = [block, bufs["q"], bufs["k"], bufs["v"], bufs.get("bias"),
                    bufs.get("seqlens_k"), bufs.get("head_sink"), bufs["out"], bufs.get("lse")]
        else:
            gsize = g.n_groups(spec, int(params["n_splits"])) * g.wg
            args = [block, bufs["q"], bufs["k"], bufs["v"], bufs.get("bias"),
                    bufs.get("seqlens_k"), bufs["o_parts"], bufs["lse_parts"]]
        prep.launches.append(_Launch(stage.kernel, k, gsize, g.wg, args))

    def _prepare(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> _Prepared:
        spec = plan.spec
        prep = _Prepared([])
        bufs: dict[str, cl.Buffer] = {}
        for name in ("q", "k", "v", "bias", "seqlens_k", "head_sink", "o_parts", "lse_parts"):
            if name in inputs:
                bufs[name] = self._upload(prep, name, np.ascontiguousarray(inputs[name]))
        bias = inputs.get("bias")
        split: dict[str, int] = {}
        if plan.op == "reduce":
            split["n_splits"] = int(inputs["o_parts"].shape[3])
        elif plan.op == "partial" or plan.route == "split_kv":
            # One split geometry for both stages, derived from split_size (a caller may
            # give split_size alone; the reduce must see the same n_splits).
            size = int(plan.stage("decode_partial").params.get("split_size", spec.capacity))
            split = {"split_size": size, "n_splits": -(-spec.capacity // size)}
            parts = (spec.batch, spec.num_heads, spec.seq_len, split["n_splits"])
            bufs["o_parts"] = self._buffer("o_parts", int(np.prod(parts)) * spec.head_size * 4)
            bufs["lse_parts"] = self._buffer("lse_parts", int(np.prod(parts)) * 4)
            if plan.op == "partial":
                prep.outputs["o_parts"] = (bufs["o_parts"], (*parts, spec.head_size), np.float32)
                prep.outputs["lse_parts"] = (bufs["lse_parts"], parts, np.float32)
        if plan.op != "partial":
            out_bytes = int(np.prod(spec.out_shape)) * spec.itemsize
            bufs["out"] = self._buffer("out", out_bytes)
            prep.outputs["out"] = (bufs["out"], spec.out_shape, np.dtype(spec.dtype))
            if spec.return_lse:
                bufs["lse"] = self._buffer("lse", int(np.prod(spec.lse_shape)) * 4)
                prep.outputs["lse"] = (bufs["lse"], spec.lse_shape, np.float32)
        for stage in plan.stages:
            self._stage(prep, spec, stage, bufs, bias, split)
        return prep

    def _enqueue(self, prep: _Prepared) -> list[cl.Event]:
        return [ln.kernel(self.queue, (ln.gsize,), (ln.lsize,), *ln.args)
                for ln in prep.launches]

    # -- Runtime protocol --------------------------------------------------------------
    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the plan's stages; partial states stay on the device between stages."""
        with self._lock:
            prep = self._prepare(plan, inputs)
            try:
                self._enqueue(prep)
            except cl.Error as exc:
                raise KernelUnavailable(plan.kernel, f"enqueue failed: {exc}") from None
            res: dict[str, np.ndarray] = {}
            for name, (buf, shape, dtype) in prep.outputs.items():
                res[name] = np.empty(shape, dtype)
                cl.enqueue_copy(self.queue, res[name], buf, is_blocking=False)
            self.queue.finish()
            return res

    def timings(self, plan: Plan, inputs: Mapping[str, np.ndarray], *, iters: int = 20,
                warmup: int = 3) -> dict[str, Any]:
        """Upload once, run ``iters`` times without reading back. gpu_s: first kernel's
        start to last kernel's end (profiling events); wall_s: host time per launch
        (enqueue to finish); stage_gpu_s: each kernel's own GPU time."""
        with self._lock:
            prep = self._prepare(plan, inputs)
            self.queue.finish()
            for _ in range(warmup):
                self._enqueue(prep)
            self.queue.finish()
            gpu, wall = [], []
            stages: dict[str, list[float]] = {ln.kernel_id: [] for ln in prep.launches}
            for _ in range(iters):
                t0 = time.perf_counter()
                evs = self._enqueue(prep)
                self.queue.finish()
                wall.append(time.perf_counter() - t0)
                gpu.append((evs[-1].profile.end - evs[0].profile.start) * 1e-9)
                for ln, ev in zip(prep.launches, evs):
                    stages[ln.kernel_id].append((ev.profile.end - ev.profile.start) * 1e-9)
            info = cl.kernel_work_group_info
            kinfo = {ln.kernel_id: {
                "private_bytes": int(ln.kernel.get_work_group_info(info.PRIVATE_MEM_SIZE,
                                                                   self.device)),
                "local_bytes": int(ln.kernel.get_work_group_info(info.LOCAL_MEM_SIZE, self.device)),
                "work_items": ln.lsize, "groups": ln.gsize // ln.lsize} for ln in prep.launches}
            return {"gpu_s": gpu, "wall_s": wall, "stage_gpu_s": stages, "kernels": kinfo}

    def close(self) -> None:
        with self._lock:
            self.queue.finish()
            for buf in [*self._pool.values(), *self._params.values()]:
                buf.release()
            self._pool.clear()
            self._params.clear()
            self._kernels.clear()
