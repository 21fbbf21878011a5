"""A Session's view of one WebGPU device: a plan encoded into dispatches once per set of
buffers (plan once, run many), launched with one encoder and one submit.

``launch`` takes numpy arrays (copied into the runtime's staging buffers) or DeviceTensors
(their buffers are bound as they are), and with ``outputs={"out": DeviceTensor}`` writes the
result there and returns without reading back or waiting. What a launch binds -- pipelines,
bind groups, the parameter block, the grids -- is prepared once per (plan, buffers) and
reused; freeing or growing a buffer forgets what was prepared with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnreg import blocks as blockmod
from attnreg import ports
from attnreg.backends import common
from attnreg.backends.launch_cache import LaunchCache, buffers_key
from attnreg.caps import DeviceCaps
from attnreg.device_tensor import DeviceTensor
from attnreg.errors import SpecError
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec

from . import copy_probe, device, program, quantize, timing
from .memory import DeviceMemory, resource, span


@dataclass
class _Dispatch:
    pipeline: Any
    bind_group: Any
    grid: tuple[int, int, int]


@dataclass
class _Output:
    name: str
    buffer: Any
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class _Prepared:
    plan: Plan                        # held: its id keys the cache
    dispatches: list[_Dispatch]
    outs: list[_Output]
    bound: tuple[Any, ...]            # every buffer the bind groups hold


class WebGpuRuntime:
    """Implements attnreg.Runtime for one adapter: memory in memory.py, programs from
    program.py, compiled pipelines in the shared device (device.py). Any host with the
    wgpu-py API runs through this class: it brings its own ``dev`` (a GpuDevice whose
    ``dialect`` names its WGSL compiler)."""

    def __init__(self, caps: DeviceCaps, dev: device.GpuDevice | None = None) -> None:
        self.caps = caps
        self.dev = dev if dev is not None else device.get(caps)
        self.wgpu = self.dev.wgpu
        self.memory = DeviceMemory(self.dev, caps, self._forget)
        self.counters = self.memory.counters
        self._prepared: LaunchCache[_Prepared] = LaunchCache()
        # Buffers derived from a DeviceTensor (f32 copy of an f16 / bf16 bias, block lists):
        # key -> (tensor, version, buffer); rebuilt when the tensor is written.
        self._derived: dict[tuple[Any, ...], tuple[Any, int, Any]] = {}

    def _forget(self, buf: Any) -> None:
        self._prepared.drop(lambda p: any(b is buf for b in p.bound))
        for key in [k for k, (t, _, b) in self._derived.items()
                    if b is buf or getattr(t, "handle", None) is buf]:
            self._derived.pop(key)

    # -- memory (the Runtime contract; memory.py does the work) ---------------------------
    def alloc(self, nbytes: int) -> Any:
        return self.memory.alloc(nbytes)

    def wrap(self, buffer: Any, offset_bytes: int, nbytes: int, dtype: np.dtype) -> Any:
        return self.memory.wrap(buffer, offset_bytes, nbytes, dtype)

    def write_refusal(self, itemsize: int, offset_bytes: int, nbytes: int,
                      tensor_bytes: int) -> str | None:
        return self.memory.write_refusal(itemsize, offset_bytes, nbytes, tensor_bytes)

    def upload(self, handle: Any, array: np.ndarray, offset_bytes: int = 0) -> None:
        self.memory.upload(handle, array, offset_bytes)

    def download(self, handle: Any, nbytes: int) -> bytes:
        return self.memory.download(handle, nbytes)

    def free(self, handle: Any) -> None:
        self.memory.free(handle)

    def copy_bandwidth(self, nbytes: int = 256 << 20, repeats: int = 5) -> float:
        """Device-to-device copy bandwidth in GB/s, bytes read plus bytes written (the
        bench's accounting): the better of a copy command and the shader cores' copy."""
        return max(copy_probe.copy_bandwidths(self.memory, nbytes, repeats).values())

    def matrix_peak(self) -> tuple[float | None, str]:
        return self.dev.matrix_peak()

    def copy_rows(self, src: Any, dst: Any, rows: int, row_bytes: int, src_pitch: int,
                  dst_pitch: int) -> None:
        self.memory.copy_rows(src, dst, rows, row_bytes, src_pitch, dst_pitch)

    # -- quantized KV caches (the Runtime contract's quantize methods; quantize.py) ----------
    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        return quantize.refusal(kv_dtype, dtype, head_size)

    def quantize_into(self, kv_dtype: str, rows: np.ndarray,
                      jobs: list[tuple[np.ndarray, Any, Any]]) -> None:
        quantize.quantize_into(self.dev, self.memory, kv_dtype, rows, jobs)

    # -- inputs ------------------------------------------------------------------------------
    def _input(self, name: str, value: Any) -> Any:
        """The buffer to bind for one input: a DeviceTensor's own buffer, or a staging buffer
        holding a host array. A bias reaches the WGSL kernels as float32 whatever dtype the
        checks accepted (float32 or the spec's): float16 / bfloat16 -> float32 is exact, and
        one f32 binding keeps the kernels free of a per-bias-dtype variant."""
        if isinstance(value, DeviceTensor):
            if name == "bias" and value.dtype != np.float32:
                return self._derive(("bias32", id(value)), value,
                                    lambda: value.numpy().astype(np.float32))
            return value.handle
        arr = np.asarray(value)
        if name == "bias" and arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        return self.memory.stage(name, arr)

    def _derive(self, key: tuple[Any, ...], tensor: Any, make: Any) -> Any:
        hit = self._derived.get(key)
        if hit is not None and hit[0] is tensor and hit[1] == tensor.version:
            return hit[2]
        if hit is not None:
            # let go of the old copy without destroying it: a command buffer recorded with it
            # may not be submitted yet (wgpu frees it once nothing uses it)
            self.memory.drop(hit[2])
        data = np.ascontiguousarray(make())
        buf = self.memory.alloc(data.nbytes)
        self.memory.upload(buf, data, 0)
        self._derived[key] = (tensor, tensor.version, buf)
        return buf

    def _block_list(self, spec: AttentionSpec, stage: Stage, consts: Mapping[str, int],
                    bias: Any) -> Any:
        """The masked-block list of the bias for this stage's tiles, packed for the kernel:
        [entries base, CSR offsets, block id | all-zero flag << 31]. Lists of a DeviceTensor
        bias are built once per written version; host biases are rebuilt per call."""
        q_tile = consts["Q_TILE"] if stage.family == "prefill" else consts["M_TILE"]
        kv_tile = consts["KV_TILE"]

        def packed() -> np.ndarray:
            bl = blockmod.cached(spec, bias, q_tile, kv_tile)
            head = np.array([1 + len(bl.offsets)], np.uint32)
            ids = bl.blocks.astype(np.uint32) | (bl.zero.astype(np.uint32) << np.uint32(31))
            return np.concatenate([head, bl.offsets.astype(np.uint32), ids, np.zeros(1, np.uint32)])
        if isinstance(bias, DeviceTensor):
            return self._derive(("blocks", id(bias), q_tile, kv_tile), bias, packed)
        return self.memory.stage(f"blocks_{stage.family}", packed())

    # -- preparing a launch -----------------------------------------------------------------
    def _prepare(self, plan: Plan, inputs: Mapping[str, Any],
                 outputs: Mapping[str, Any] | None = None) -> _Prepared:
        """Bind the inputs (uploading host arrays) and return the launch prepared for this
        plan and these buffers, building it on first use."""
        spec = plan.spec
        bias = inputs.get("bias")
        bias_shape = None if bias is None else tuple(int(n) for n in bias.shape)
        progs = program.programs(plan, self.caps, bias_shape=bias_shape, dialect=self.dev.dialect)
        bound = {name: self._input(name, x) for name, x in inputs.items()}
        for st, prog in zip(program.launch_stages(plan), progs):
            if "block_list" in program.stage_aux(st, spec):
                bound[f"block_list_{st.family}"] = self._block_list(spec, st, prog.consts, bias)
        if outputs and outputs.get("out") is not None:
            bound["out"] = outputs["out"].handle
            _check_out_alone(bound)
        key = (bias_shape, buffers_key(bound))
        got = self._prepared.get(plan, key)
        if got is not None:
            self.counters["prepared_hits"] += 1
            return got
        return self._prepared.put(plan, key, self._build(plan, progs, bound, bias_shape))

    def _build(self, plan: Plan, progs: list[program.Program], bound: dict[str, Any],
               bias_shape: tuple[int, ...] | None) -> _Prepared:
        spec, mem = plan.spec, self.memory
        U = self.wgpu.BufferUsage
        self.counters["prepares"] += 1
        n_splits = program.n_splits(plan)
        params = self.dev.device.create_buffer(label="params", size=common.SIZE,
                                               usage=U.UNIFORM | U.COPY_DST)
        self.dev.device.queue.write_buffer(params, 0, program.param_block(plan, bias_shape))
        bound["params"] = params
        # the scratch one stage hands the next and the outputs (out= brings its own)
        written = ports.written([p.family for p in progs], spec, ports.WGSL)
        for port in written:
            if port.name not in bound:
                bound[port.name] = mem.storage(port.name, port.nbytes(spec, n_splits))
        # Absent inputs bind a read-only stand-in, absent outputs a writable one: one buffer
        # may not be both in one dispatch.
        stand_in = {"uniform": None, "read": mem.dummy(False), "rw": mem.dummy(True)}
        dispatches = []
        for prog in progs:
            def buffer(name: str, access: str, family: str = prog.family) -> Any:
                got = bound.get(f"{name}_{family}") if name == "block_list" else bound.get(name)
                return got if got is not None else stand_in[access]
            group = self.dev.device.create_bind_group(
                layout=self.dev.layout(prog.layout)[0],
                entries=[{"binding": bd.index, "resource": resource(buffer(bd.name, bd.access))}
                         for bd in prog.bindings])
            self.counters["bind_groups"] += 1
            dispatches.append(_Dispatch(self.dev.pipeline(prog), group, prog.grid))

        outs = [_Output(p.name, bound[p.name], p.nbytes(spec, n_splits), p.dtype(spec),
                        p.shape_for(spec, n_splits)) for p in ports.results(plan.op, written)]
        held = (*bound.values(), *(x for x in stand_in.values() if x is not None))
        return _Prepared(plan, dispatches, outs, held)

    def _encode(self, dispatches: list[_Dispatch], timestamps: Any = None) -> Any:
        enc = self.dev.device.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes=timestamps) if timestamps else \
            enc.begin_compute_pass()
        _dispatch(cp, dispatches)
        cp.end()
        return enc

    # -- recording into the caller's encoder ---------------------------------------------------
    def record_refusal(self, plan: Plan, inputs: Mapping[str, Any]) -> str | None:
        """A caller's bias that this runtime would derive data from on the host (widened to
        float32, or its block lists): the derivation would read it before the caller's
        commands in the same encoder write it."""
        bias = inputs.get("bias")
        if not isinstance(bias, DeviceTensor) or bias.owned:
            return None
        if bias.dtype != np.float32:
            return "a float32 bias when it is the caller's buffer (another is widened on the host)"
        if any("block_list" in program.stage_aux(st, plan.spec) for st in program.launch_stages(plan)):
            return ("a plan without block skipping when the bias is the caller's buffer (its "
                    "block lists are built on the host)")
        return None

    def record(self, plan: Plan, inputs: Mapping[str, Any], outputs: Mapping[str, Any],
               stream: Any, wait_for: Any = None) -> None:
        """The plan's dispatches in the caller's encoder (one compute pass of their own) or
        compute pass, bound as a launch binds them; the caller submits."""
        api = self.wgpu
        if wait_for is not None:
            raise SpecError("wait_for", wait_for, "None: a WebGPU queue runs command buffers in "
                            "the order they are submitted, and commands in encoding order")
        if not isinstance(stream, (api.GPUCommandEncoder, api.GPUComputePassEncoder)) or \
                getattr(stream, "_device", None) is not self.dev.device:
            raise SpecError("stream", stream, f"a {api.__name__}.GPUCommandEncoder or "
                            "GPUComputePassEncoder of this Session's device")
        prep = self._prepare(plan, inputs, outputs)
        if isinstance(stream, api.GPUComputePassEncoder):
            _dispatch(stream, prep.dispatches)
        else:
            cp = stream.begin_compute_pass()
            _dispatch(cp, prep.dispatches)
            cp.end()
        self.counters["recorded"] += 1

    # -- Runtime protocol ----------------------------------------------------------------
    def launch(self, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run a plan: all its dispatches and the output copies in one encoder and one
        submit. Outputs given as DeviceTensors (``outputs={"out": t}``) are written in place
        and returned as they are, with no read-back and no wait; the others come back to
        the host."""
        prep = self._prepare(plan, inputs, outputs)
        given = {n: t for n, t in (outputs or {}).items() if t is not None}
        U = self.wgpu.BufferUsage
        enc = self._encode(prep.dispatches)
        readback = []
        for o in prep.outs:
            if o.name in given:
                continue
            rb = self.memory.buffer(f"rb_{o.name}", o.nbytes, U.MAP_READ | U.COPY_DST)
            enc.copy_buffer_to_buffer(o.buffer, 0, rb, 0, -(-o.nbytes // 4) * 4)
            readback.append((o, rb))
        try:
            self.dev.submit([enc.finish()])
        except self.wgpu.GPUValidationError as exc:
            # Dawn refuses a submit that uses a destroyed buffer (wgpu-native aborts instead:
            # nothing to catch there): a caller destroyed a buffer it had wrapped.
            theirs = sorted(n for n, x in {**inputs, **given}.items()
                            if isinstance(x, DeviceTensor) and not x.owned)
            if "destroyed" not in str(exc) or not theirs:
                raise
            raise SpecError(f"tensors{theirs}", str(exc).splitlines()[0], "buffers their owner "
                            "has not destroyed (free() a wrapped tensor before destroying its "
                            "buffer)") from None
        self.counters["submits"] += 1
        self.counters["launches"] += 1
        res: dict[str, Any] = dict(given)
        for o, rb in readback:
            raw = self.memory.map_read(rb, o.nbytes)
            res[o.name] = np.frombuffer(raw, dtype=o.dtype).reshape(o.shape).copy()
        return res

    def timings(self, plan: Plan, inputs: Mapping[str, Any], *, iters: int = 20,
                warmup: int = 3, warmup_s: float = 0.6) -> dict[str, list[float]]:
        """Per-launch times of a plan with inputs bound once and nothing read back
        (backends/webgpu/timing.py says how each figure is taken)."""
        dispatches = self._prepare(plan, inputs).dispatches
        return timing.timings(self.dev, self.memory,
                              lambda ts=None: self._encode(dispatches, ts),
                              lambda cp: _dispatch(cp, dispatches),
                              iters=iters, warmup=warmup, warmup_s=warmup_s)

    def close(self) -> None:
        self._prepared.clear()
        self._derived.clear()
        self.memory.close()


def _dispatch(cp: Any, dispatches: list[_Dispatch]) -> None:
    """The dispatches in one compute pass: wgpu orders the stages' storage accesses."""
    for d in dispatches:
        cp.set_pipeline(d.pipeline)
        cp.set_bind_group(0, d.bind_group)
        cp.dispatch_workgroups(*d.grid)


def _check_out_alone(bound: Mapping[str, Any]) -> None:
    """out= in a buffer no input is in: WebGPU lets no dispatch bind a buffer as writable
    storage and as another binding (even of other bytes of it)."""
    written = span(bound["out"])[0]
    shared = sorted(n for n, h in bound.items()
                    if n != "out" and h is not None and span(h)[0] is written)
    if shared:
        raise SpecError("out", bound["out"], f"a buffer none of the inputs is in ({shared} "
                        "share it): a WebGPU dispatch may not bind a buffer it writes twice")
