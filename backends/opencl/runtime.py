"""OpenCLRuntime: one device opened for one Session -- its queue, memory and launches.

Programs come from the process-wide cache in device.py (a new Session does not rebuild);
their sources, arguments and grids from program.py.
Plan once, run many: a launch is *prepared* once per (plan, bound buffers) -- kernel objects
created and their arguments set -- and later calls with the same plan and buffers only
enqueue it. DeviceTensors are bound directly (no host copy); host arrays go into pooled
buffers of fixed role and size, so a decode loop keeps hitting the same prepared launch.
A run enqueues every stage on one in-order queue and waits once (one queue.finish), or,
with ``outputs={"out": DeviceTensor}``, not at all.
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

from attnreg import blocks, ports
from attnreg.backends import common
from attnreg.backends.launch_cache import LaunchCache, buffers_key
from attnreg.caps import DeviceCaps
from attnreg.device_tensor import DeviceTensor
from attnreg.errors import KernelUnavailable, SpecError
from attnreg.plan import Plan, Stage

from . import device, kernels, program, quantize, tiles
from .memory import DeviceMemory, raw_bytes


@dataclass
class _Launch:
    kernel_id: str
    kernel: cl.Kernel          # this launch's own kernel object: its arguments are set once
    gsize: int
    lsize: int


@dataclass
class _Prepared:
    plan: Plan
    launches: list[_Launch] = field(default_factory=list)
    outputs: dict[str, tuple[cl.Buffer, tuple[int, ...], Any]] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)     # buffers the arguments refer to


@dataclass
class _Layout:
    """What a plan launches, worked out once per (plan, bias shape)."""

    stages: list[tuple[Stage, str, dict[str, Any], tiles.Geometry]]
    written: dict[str, int]                          # bytes of each buffer the stages write
    results: dict[str, tuple[tuple[int, ...], Any]]  # shape, dtype of each buffer read back


def _variant(kernel_id: str) -> tuple[str, str]:
    info = kernels.VARIANTS.get(kernel_id)
    if info is None:
        raise KernelUnavailable(kernel_id, "not an OpenCL kernel this runtime can launch")
    return info


class OpenCLRuntime:
    """Implements attnreg.Runtime on one OpenCL device: memory in memory.py, programs from
    program.py, built programs shared through device.py."""

    def __init__(self, caps: DeviceCaps, queue: cl.CommandQueue | None = None) -> None:
        """On the process's context of the device, with a queue of its own; or on the
        caller's ``queue`` (interop.py), its context and device, waiting only for its own
        commands."""
        self.caps = caps
        if queue is None:
            self.ctx, self.device = device.context(caps)
            props = cl.command_queue_properties.PROFILING_ENABLE
            self.queue = cl.CommandQueue(self.ctx, self.device, properties=props)
        else:
            self.ctx, self.device, self.queue = queue.context, queue.device, queue
        self.profiling = bool(self.queue.properties & cl.command_queue_properties.PROFILING_ENABLE)
        self.mem = DeviceMemory(caps, self.ctx, self.queue, owns_queue=queue is None)
        self.counters = self.mem.counters
        self._checked: set[tuple[int, str]] = set()
        self._preps: LaunchCache[_Prepared] = LaunchCache()
        self._lists: OrderedDict[int, tuple[blocks.BlockList, dict[str, cl.Buffer]]] = OrderedDict()
        self._layouts: LaunchCache[_Layout] = LaunchCache()
        self._lock = threading.RLock()

    # -- memory (the Runtime contract; memory.py does the work) -------------------------
    def alloc(self, nbytes: int) -> cl.Buffer:
        """A device buffer for a DeviceTensor."""
        return self.mem.alloc(nbytes)

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        return self.mem.write_refusal(itemsize, offset_bytes, nbytes, tensor_bytes)

    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> cl.Buffer:
        with self._lock:
            return self.mem.wrap(buffer, offset_bytes, nbytes, dtype)

    def upload(self, handle: cl.Buffer, array: np.ndarray, offset_bytes: int = 0) -> None:
        """Host array -> buffer at a byte offset, ordered with the launches."""
        with self._lock:
            self.mem.upload(handle, array, offset_bytes)

    def download(self, handle: cl.Buffer, nbytes: int) -> bytes:
        """Buffer -> host bytes, after every launch enqueued before."""
        with self._lock:
            return self.mem.download(handle, nbytes)

    def free(self, handle: cl.Buffer) -> None:
        with self._lock:
            self.mem.free(handle)

    def copy_rows(self, src: cl.Buffer, dst: cl.Buffer, rows: int, row_bytes: int,
                  src_pitch: int, dst_pitch: int) -> None:
        with self._lock:
            self.mem.copy_rows(src, dst, rows, row_bytes, src_pitch, dst_pitch)

    def copy_bandwidth(self, nbytes: int = 256 << 20) -> float:
        with self._lock:
            return self.mem.copy_bandwidth(nbytes)

    def matrix_peak(self) -> tuple[float | None, str]:
        return None, "no GEMM probe for OpenCL (its tensor-core kernels are inline PTX)"

    # -- quantized KV caches (the Runtime contract's quantize methods; quantize.py) --------
    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        return quantize.refusal(kv_dtype, dtype, head_size)

    def quantize_into(self, kv_dtype: str, rows: np.ndarray,
                      jobs: list[tuple[np.ndarray, Any, Any]]) -> None:
        with self._lock:
            quantize.quantize_into(self.ctx, self.device, self.queue, self.mem, kv_dtype,
                                   rows, jobs, program.device_options(self.caps))

    # -- programs ----------------------------------------------------------------------
    def _program(self, kernel_id: str, family: str, defines: dict[str, int]) -> cl.Program:
        return device.build(self.ctx, self.device, kernel_id,
                            program.source(family, _variant(kernel_id)[1]),
                            program.options(defines, program.device_options(self.caps)))

    def _new_kernel(self, kernel_id: str, family: str, g: tiles.Geometry,
                    defines: dict[str, int]) -> cl.Kernel:
        prog = self._program(kernel_id, family, defines)
        k = cl.Kernel(prog, program.ENTRY[family])
        if (prog.int_ptr, kernel_id) not in self._checked:
            self._check_kernel(kernel_id, k, g)
            self._checked.add((prog.int_ptr, kernel_id))
        return k

    def _check_kernel(self, kernel_id: str, k: cl.Kernel, g: tiles.Geometry) -> None:
        info = cl.kernel_work_group_info
        allowed = k.get_work_group_info(info.WORK_GROUP_SIZE, self.device)
        if allowed < g.wg:
            raise KernelUnavailable(kernel_id, f"compiled kernel allows {allowed} work-items "
                                    f"per work-group, geometry needs {g.wg}")
        if g.sg_impl in (tiles.SG_IMPLS["khr"], tiles.SG_IMPLS["intel"]):
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

    # -- binding -----------------------------------------------------------------------
    def _bind_inputs(self, plan: Plan, inputs: Mapping[str, Any], private: bool
                     ) -> dict[str, Any]:
        """Buffers for the inputs the plan's kernels read: a DeviceTensor's own, or a pooled
        copy of a host array."""
        bufs: dict[str, Any] = {}
        for name in ports.reads(tuple(st.family for st in plan.stages), ports.OPENCL):
            x = inputs.get(name)
            if x is None:
                continue
            bufs[name] = x.handle if isinstance(x, DeviceTensor) else \
                self.mem.upload_pooled(name, np.asarray(x), private=private)
        return bufs

    def _block_lists(self, plan: Plan, stage: Stage, g: tiles.Geometry, bias: Any,
                     bufs: dict[str, Any]) -> None:
        """Block-list buffers (and the prefill order) for a block-skipping stage. A
        DeviceTensor bias's lists are built and uploaded once per bias version."""
        spec = plan.spec
        bl = blocks.cached(spec, bias, g.mq, g.tk)
        arrays = {"blk_off": bl.offsets, "blk_ids": bl.blocks, "blk_zero": bl.zero}
        if stage.family == "prefill":
            arrays["wg_order"] = program.heavy_first(spec, g, bl)
        if not isinstance(bias, DeviceTensor):
            for name, arr in arrays.items():
                bufs[name] = self.mem.upload_pooled(name, arr.astype(np.int32))
            return
        hit = self._lists.get(id(bl))
        if hit is None or hit[0] is not bl or set(hit[1]) != set(arrays):
            made = {}
            for name, arr in arrays.items():
                a = np.ascontiguousarray(arr, np.int32)
                made[name] = self.mem.alloc(max(4, a.nbytes))
                if a.size:
                    self.mem.upload(made[name], a)
            hit = self._lists[id(bl)] = (bl, made)
            while len(self._lists) > 16:
                self._lists.popitem(last=False)
        bufs.update(hit[1])

    def _layout(self, plan: Plan, bias_shape: tuple[int, ...] | None) -> _Layout:
        """Each stage's family, parameters and geometry, and the buffers the stages write
        (pure: cached per plan)."""
        spec, split = plan.spec, program.split_params(plan)
        stages = []
        for stage in plan.stages:
            family, variant = _variant(stage.kernel)
            params = program.stage_params(plan, stage, split, bias_shape)
            stages.append((stage, family, params,
                           tiles.geometry(family, variant, spec, params, self.caps)))
        n = int(split.get("n_splits", 1))
        written = ports.written([family for _, family, _, _ in stages], spec, ports.OPENCL)
        # decode_fused's tickets, one per row tile of its geometry, are sized in _prepare
        return _Layout(stages, {p.name: p.nbytes(spec, n) for p in written
                                if p.shape is not None},
                       {p.name: (p.shape_for(spec, n), np.dtype(p.dtype(spec)))
                        for p in ports.results(plan.op, written)})

    def _prepare(self, plan: Plan, inputs: Mapping[str, Any],
                 outputs: Mapping[str, Any] | None = None) -> _Prepared:
        spec = plan.spec
        bufs = self._bind_inputs(plan, inputs, private=bool(outputs))
        bias = inputs.get("bias")
        bias_shape = tuple(bias.shape) if bias is not None else None
        # the programs read the bias as stored (common.cl): one build per bias dtype
        bias_dtype = None if bias is None else np.dtype(bias.dtype).name
        lay = self._layouts.get(plan, bias_shape)
        if lay is None:
            lay = self._layouts.put(plan, bias_shape, self._layout(plan, bias_shape))
        given = (outputs or {}).get("out")
        if given is not None:
            bufs["out"] = given.handle
        for name, size in lay.written.items():
            if name not in bufs:
                bufs[name] = self.mem.pooled(name, size)
        outs = {name: (bufs[name], shape, dtype) for name, (shape, dtype) in lay.results.items()
                if not (name == "out" and given is not None)}
        for stage, family, params, g in lay.stages:
            if params.get("block_skip"):
                self._block_lists(plan, stage, g, bias, bufs)
            if family == "decode_fused":
                n = program.tiles(spec, g, params) * 4
                bufs.setdefault("tickets", self.mem.pooled("tickets", n, zeroed=True))
        key = (bias_shape, bias_dtype, buffers_key(bufs))
        prep = self._preps.get(plan, key)
        if prep is None:
            prep = _Prepared(plan, outputs=outs, keep=list(bufs.values()))
            for stage, family, params, g in lay.stages:
                k = self._new_kernel(stage.kernel, family, g,
                                     program.defines(spec, g, bias_dtype, params, self.caps))
                block = self.mem.param_block(common.pack(spec, params, bias_shape))
                k.set_args(*program.arguments(family, block, bufs))
                prep.keep.append(block)
                prep.launches.append(_Launch(stage.kernel, k,
                                             program.global_size(family, spec, g, params), g.wg))
            self.counters["prepares"] += 1
            self._preps.put(plan, key, prep)
        return prep

    def _enqueue(self, prep: _Prepared, wait_for: list[cl.Event] | None = None) -> list[cl.Event]:
        evs: list[cl.Event] = []
        for ln in prep.launches:      # the first stage after wait_for, the others in queue order
            evs.append(cl.enqueue_nd_range_kernel(self.queue, ln.kernel, (ln.gsize,), (ln.lsize,),
                                                  wait_for=None if evs else wait_for))
        return evs

    # -- recording on the caller's queue -----------------------------------------------
    def record_refusal(self, plan: Plan, inputs: Mapping[str, Any]) -> str | None:
        """A caller's bias for a block-skipping plan: its block lists are built on the host,
        before the caller's commands on the queue write it."""
        bias = inputs.get("bias")
        if isinstance(bias, DeviceTensor) and not bias.owned and \
                any(st.params.get("block_skip") for st in plan.stages):
            return ("a plan without block skipping when the bias is the caller's buffer (its "
                    "block lists are built on the host)")
        return None

    def record(self, plan: Plan, inputs: Mapping[str, Any], outputs: Mapping[str, Any],
               stream: Any, wait_for: Any = None) -> cl.Event:
        """The plan's stages enqueued on the runtime's queue (the caller's, for a Session on
        it), the first after the events ``wait_for``; the last stage's event."""
        if stream is not None and stream != self.queue:
            raise SpecError("stream", stream, "None or the CommandQueue this Session runs on "
                            "(Session(backend='opencl', device=<that queue>))")
        waits = list(wait_for) if wait_for is not None else None
        if waits is not None and not all(isinstance(e, cl.Event) for e in waits):
            raise SpecError("wait_for", wait_for, "None or a list of pyopencl.Event")
        with self._lock:
            prep = self._prepare(plan, inputs, outputs)
            try:
                evs = self._enqueue(prep, waits)
            except cl.Error as exc:
                raise KernelUnavailable(plan.kernel, f"enqueue failed: {exc}") from None
            self.counters["recorded"] += 1
            return evs[-1]

    # -- Runtime protocol --------------------------------------------------------------
    def launch(self, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run the plan's stages; intermediate states stay on the device. Inputs may be
        numpy arrays or DeviceTensors. With ``outputs={"out": DeviceTensor}`` the result is
        written there and nothing waits (lse, if asked for, still comes back to the host)."""
        with self._lock:
            prep = self._prepare(plan, inputs, outputs)
            self.counters["launches"] += 1
            try:
                self._enqueue(prep)
            except cl.Error as exc:
                raise KernelUnavailable(plan.kernel, f"enqueue failed: {exc}") from None
            res: dict[str, Any] = {}
            copies = []
            for name, (buf, shape, dtype) in prep.outputs.items():
                res[name] = np.empty(shape, dtype)
                copies.append(cl.enqueue_copy(self.queue, raw_bytes(res[name]), buf,
                                              is_blocking=False))
                self.counters["readbacks"] += 1
                self.counters["readback_bytes"] += int(res[name].nbytes)
            if outputs and "out" in outputs:
                res["out"] = outputs["out"]
            if prep.outputs:
                self.mem.sync(copies)
            return res

    def timings(self, plan: Plan, inputs: Mapping[str, Any], *, iters: int = 20,
                warmup: int = 3) -> dict[str, Any]:
        """Upload once, run ``iters`` times without reading back. gpu_s: first kernel's
        start to last kernel's end (profiling events), one launch at a time; wall_s: host
        time per launch (enqueue to finish); stage_gpu_s: each kernel's own GPU time;
        b2b_s: back to back (see _back_to_back)."""
        with self._lock:
            prep = self._prepare(plan, inputs)
            self.mem.sync()
            for _ in range(warmup):
                self._enqueue(prep)
            self.mem.sync()
            gpu, wall = [], []
            stages: dict[str, list[float]] = {ln.kernel_id: [] for ln in prep.launches}
            for _ in range(iters):
                t0 = time.perf_counter()
                evs = self._enqueue(prep)
                self.queue.finish()
                wall.append(time.perf_counter() - t0)
                if not self.profiling:        # a caller's queue without profiling events
                    continue
                gpu.append((evs[-1].profile.end - evs[0].profile.start) * 1e-9)
                for ln, ev in zip(prep.launches, evs):
                    stages[ln.kernel_id].append((ev.profile.end - ev.profile.start) * 1e-9)
            info = cl.kernel_work_group_info
            kinfo = {ln.kernel_id: {
                "private_bytes": int(ln.kernel.get_work_group_info(info.PRIVATE_MEM_SIZE,
                                                                   self.device)),
                "local_bytes": int(ln.kernel.get_work_group_info(info.LOCAL_MEM_SIZE, self.device)),
                "work_items": ln.lsize, "groups": ln.gsize // ln.lsize} for ln in prep.launches}
            times = {"gpu_s": gpu, "stage_gpu_s": stages,
                     "b2b_s": self._back_to_back(prep, iters)} if self.profiling else {}
            return {**times, "wall_s": wall, "kernels": kinfo}

    def _back_to_back(self, prep: _Prepared, iters: int, bursts: int = 3) -> list[float]:
        """Seconds per launch with ``iters`` launches enqueued without waiting: the first
        kernel's start to the last kernel's end (profiling events) over ``iters``, once per
        burst. The gaps between launches count, as in a decode loop that never waits."""
        n, out = max(1, iters), []
        for _ in range(bursts):
            first = last = self._enqueue(prep)
            for _ in range(n - 1):
                last = self._enqueue(prep)
            self.queue.finish()
            out.append((last[-1].profile.end - first[0].profile.start) * 1e-9 / n)
        return out

    def close(self) -> None:
        with self._lock:
            self._preps.clear()
            self._layouts.clear()
            for _, made in self._lists.values():
                for buf in made.values():
                    buf.release()
            self._lists.clear()
            self.mem.close()
