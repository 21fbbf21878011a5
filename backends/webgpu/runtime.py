"""A Session's view of one WebGPU device: its buffers and bind groups (reused across calls),
and the encoding of a plan into one command encoder and one submit."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnreg.caps import DeviceCaps
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec
from backends import common

from . import device, kernels, source


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fold_grid(n: int, limit: int) -> tuple[int, int, int]:
    """n workgroups as (x, y, z) with each <= limit; kernels unfold x + nx*(y + ny*z) and
    skip ids >= n."""
    x = max(1, min(n, limit))
    rest = _cdiv(n, x)
    y = max(1, min(rest, limit))
    z = _cdiv(rest, y)
    if z > limit:
        raise ValueError(f"{n} workgroups exceed {limit}^3")
    return x, y, z


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


class WebGpuRuntime:
    """Implements attnreg.Runtime for one adapter; compiled pipelines live in the shared
    device (backends.webgpu.device), buffers and bind groups here."""

    def __init__(self, caps: DeviceCaps) -> None:
        self.caps = caps
        self.dev = device.get(caps)
        self.wgpu = self.dev.wgpu
        self._bufs: dict[str, tuple[Any, int]] = {}
        self._groups: dict[tuple[int, ...], Any] = {}
        self._limit = caps.limit("workgroups_per_dim") or 65535

    # -- buffers --------------------------------------------------------------------------
    def _buffer(self, name: str, nbytes: int, usage: int) -> Any:
        """A buffer of at least nbytes, reused while big enough (bind groups follow it)."""
        nbytes = max(16, _cdiv(nbytes, 16) * 16)
        got = self._bufs.get(name)
        if got is None or got[1] < nbytes:
            if got is not None:
                got[0].destroy()
                self._groups.clear()
            buf = self.dev.device.create_buffer(label=name, size=nbytes, usage=usage)
            self._bufs[name] = got = (buf, nbytes)
        return got[0]

    def _upload(self, name: str, arr: np.ndarray) -> Any:
        U = self.wgpu.BufferUsage
        data = np.ascontiguousarray(arr)
        buf = self._buffer(name, data.nbytes, U.STORAGE | U.COPY_DST)
        raw = data.view(np.uint8).reshape(-1)
        if raw.size % 4:
            raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
        self.dev.device.queue.write_buffer(buf, 0, raw)
        return buf

    def _storage(self, name: str, nbytes: int) -> Any:
        U = self.wgpu.BufferUsage
        return self._buffer(name, nbytes, U.STORAGE | U.COPY_SRC | U.COPY_DST)

    def _dummy(self, writable: bool) -> Any:
        # A read-only and a writable stand-in: one buffer may not be both in one dispatch.
        return self._storage("dummy_w" if writable else "dummy_r", 16)

    def _bind(self, family: str, pipeline: Any, buffers: list[Any]) -> Any:
        key = (id(pipeline), *map(id, buffers))
        group = self._groups.get(key)
        if group is None:
            bgl, _ = self.dev.layout(family)
            group = self.dev.device.create_bind_group(layout=bgl, entries=[
                {"binding": i, "resource": {"buffer": b}} for i, b in enumerate(buffers)])
            self._groups[key] = group
        return group

    # -- planning a run into dispatches ------------------------------------------------------
    def _pipeline(self, stage: Stage, spec: AttentionSpec) -> Any:
        p = stage.params
        sg = p.get("reduction") == "subgroup"
        if stage.family == "prefill":
            width = 1
            if sg:
                width = 1 << max(0, (self.caps.subgroup_min_size or 4).bit_length() - 1)
            consts = kernels.prefill_consts(spec, p, width)
        elif stage.family == "decode_partial":
            consts = kernels.decode_consts(spec, p)
        else:
            consts = kernels.reduce_consts(spec, p)
        wgsl = source.build(stage.family, spec.dtype, spec.head_size, consts, subgroups=sg)
        return self.dev.pipeline(stage.kernel, stage.family, wgsl), consts

    def _groups_of(self, stage: Stage, spec: AttentionSpec, consts: Mapping[str, int]) -> int:
        p = stage.params
        if stage.family == "prefill":
            return _cdiv(spec.seq_len, consts["BR"]) * spec.num_heads * spec.batch
        if stage.family == "decode_partial":
            return (_cdiv(spec.capacity, int(p["split_size"])) * _cdiv(spec.seq_len, consts["M"])
                    * _cdiv(spec.group_size, consts["GT"]) * spec.kv_num_heads * spec.batch)
        return spec.batch * spec.num_heads * spec.seq_len

    def _prepare(self, plan: Plan, inputs: Mapping[str, np.ndarray]
                 ) -> tuple[list[_Dispatch], list[_Output]]:
        """Upload inputs and the parameter block; return the dispatches and the outputs."""
        spec = plan.spec
        U = self.wgpu.BufferUsage
        stages = [plan.stage("reduce")] if plan.op == "reduce" else list(plan.stages)
        split = next((s for s in stages if s.family == "decode_partial"), stages[0])
        geometry = dict(split.params)
        if split.family == "decode_partial":
            # The contract fixes T = ceil(C / split_size); derive it rather than trust a caller
            # who passed split_size alone.
            geometry.setdefault("split_size", spec.capacity)
            geometry["n_splits"] = _cdiv(spec.capacity, int(geometry["split_size"]))
        elif plan.op == "reduce":
            geometry["n_splits"] = int(inputs["o_parts"].shape[3])
        n_splits = int(geometry.get("n_splits", 1))
        bias = inputs.get("bias")
        if bias is not None and bias.dtype != np.float32:
            bias = bias.astype(np.float32)        # float16 -> float32 is exact
        params = self._buffer("params", common.SIZE, U.UNIFORM | U.COPY_DST)
        self.dev.device.queue.write_buffer(
            params, 0, common.pack(spec, geometry, None if bias is None else bias.shape))

        rd, wr = self._dummy(False), self._dummy(True)
        b, nq, s, h = spec.batch, spec.num_heads, spec.seq_len, spec.head_size
        parts = b * nq * s * n_splits
        if plan.op == "reduce":
            o_parts = self._upload("o_parts", inputs["o_parts"])
            lse_parts = self._upload("lse_parts", inputs["lse_parts"])
        else:
            o_parts = self._storage("o_parts", parts * h * 4)
            lse_parts = self._storage("lse_parts", parts * 4)
            attn_in = [params, self._upload("q", inputs["q"]), self._upload("k", inputs["k"]),
                       self._upload("v", inputs["v"]),
                       rd if bias is None else self._upload("bias", bias),
                       rd if "seqlens_k" not in inputs else self._upload("seqlens", inputs["seqlens_k"]),
                       rd if "head_sink" not in inputs else self._upload("sink", inputs["head_sink"])]
        sink = rd if "head_sink" not in inputs else self._upload("sink", inputs["head_sink"])
        out = self._storage("out", b * nq * s * h * spec.itemsize)
        lse = self._storage("lse", b * nq * s * 4) if spec.return_lse else wr

        dispatches = []
        for st in stages:
            pipe, consts = self._pipeline(st, spec)
            if st.family == "prefill":
                bufs = [*attn_in, out, lse]
            elif st.family == "decode_partial":
                bufs = [*attn_in, o_parts, lse_parts]
            else:
                bufs = [params, o_parts, lse_parts, sink, out, lse]
            grid = fold_grid(self._groups_of(st, spec, consts), self._limit)
            dispatches.append(_Dispatch(pipe, self._bind(st.family, pipe, bufs), grid))

        if plan.op == "partial":
            outs = [_Output("o_parts", o_parts, parts * h * 4, "float32", (b, nq, s, n_splits, h)),
                    _Output("lse_parts", lse_parts, parts * 4, "float32", (b, nq, s, n_splits))]
        else:
            outs = [_Output("out", out, b * nq * s * h * spec.itemsize, spec.dtype, spec.out_shape)]
            if spec.return_lse:
                outs.append(_Output("lse", lse, b * nq * s * 4, "float32", spec.lse_shape))
        return dispatches, outs

    def _encode(self, dispatches: list[_Dispatch], timestamps: Any = None) -> Any:
        enc = self.dev.device.create_command_encoder()
        cp = enc.begin_compute_pass(timestamp_writes=timestamps) if timestamps else \
            enc.begin_compute_pass()
        for d in dispatches:      # one pass: wgpu orders the stages' storage accesses
            cp.set_pipeline(d.pipeline)
            cp.set_bind_group(0, d.bind_group)
            cp.dispatch_workgroups(*d.grid)
        cp.end()
        return enc

    # -- Runtime protocol ----------------------------------------------------------------
    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a plan: all its dispatches and the output copies in one encoder and one
        submit; only the outputs come back to the host."""
        dispatches, outs = self._prepare(plan, inputs)
        U = self.wgpu.BufferUsage
        enc = self._encode(dispatches)
        readback = []
        for o in outs:
            rb = self._buffer(f"rb_{o.name}", o.nbytes, U.MAP_READ | U.COPY_DST)
            enc.copy_buffer_to_buffer(o.buffer, 0, rb, 0, _cdiv(o.nbytes, 4) * 4)
            readback.append(rb)
        self.dev.device.queue.submit([enc.finish()])
        res: dict[str, np.ndarray] = {}
        for o, rb in zip(outs, readback):
            size = _cdiv(o.nbytes, 4) * 4
            rb.map_sync(self.wgpu.MapMode.READ, 0, size)
            try:
                raw = bytes(rb.read_mapped(0, size))
            finally:
                rb.unmap()
            res[o.name] = np.frombuffer(raw[:o.nbytes], dtype=o.dtype).reshape(o.shape).copy()
        return res

    def timings(self, plan: Plan, inputs: Mapping[str, np.ndarray], *, iters: int = 20,
                warmup: int = 3, warmup_s: float = 0.2) -> dict[str, list[float]]:
        """Per-launch times of a plan with inputs uploaded once and nothing read back.

        ``gpu_s`` (where the adapter has timestamp-query): timestamps around the run's one
        compute pass, with the iterations submitted back to back, so the GPU stays busy
        and clocked up as in a decode loop. ``wall_s``: host time of submit + wait, one
        launch at a time. ``warmup_s`` keeps launching for that long first: an idle H100
        sits at 345 MHz and short bursts of launches were timed 2-8x slow without it."""
        dispatches, _ = self._prepare(plan, inputs)
        queue = self.dev.device.queue
        t_end = time.perf_counter() + warmup_s
        n = 0
        while n < warmup or time.perf_counter() < t_end:
            queue.submit([self._encode(dispatches).finish()])
            n += 1
            if n % 64 == 0:
                self.dev.wait()
        self.dev.wait()
        res: dict[str, list[float]] = {}
        if self.dev.has_timestamps:
            res["gpu_s"] = self._gpu_times(dispatches, iters)
        wall = []
        for _ in range(iters):
            cmd = self._encode(dispatches).finish()
            t0 = time.perf_counter()
            queue.submit([cmd])
            self.dev.wait()
            wall.append(time.perf_counter() - t0)
        res["wall_s"] = wall
        return res

    def _gpu_times(self, dispatches: list[_Dispatch], iters: int) -> list[float]:
        U = self.wgpu.BufferUsage
        queue = self.dev.device.queue
        qs = self.dev.device.create_query_set(type=self.wgpu.QueryType.timestamp, count=2 * iters)
        cmds = [self._encode(dispatches, {"query_set": qs, "beginning_of_pass_write_index": 2 * i,
                                          "end_of_pass_write_index": 2 * i + 1}).finish()
                for i in range(iters)]
        for cmd in cmds:
            queue.submit([cmd])
        n = 16 * iters
        resolve = self._buffer("ts_resolve", n, U.QUERY_RESOLVE | U.COPY_SRC)
        rb = self._buffer("rb_ts", n, U.MAP_READ | U.COPY_DST)
        enc = self.dev.device.create_command_encoder()
        enc.resolve_query_set(qs, 0, 2 * iters, resolve, 0)
        enc.copy_buffer_to_buffer(resolve, 0, rb, 0, n)
        queue.submit([enc.finish()])
        rb.map_sync(self.wgpu.MapMode.READ, 0, n)
        try:
            ticks = np.frombuffer(bytes(rb.read_mapped(0, n)), dtype=np.uint64)
        finally:
            rb.unmap()
        qs.destroy()
        # WebGPU timestamps are nanoseconds.
        return [float(ticks[2 * i + 1] - ticks[2 * i]) * 1e-9 for i in range(iters)]

    def close(self) -> None:
        for buf, _ in self._bufs.values():
            buf.destroy()
        self._bufs.clear()
        self._groups.clear()
