"""The ONNX Runtime WebGPU peer: a decode-loop call with inputs and KV cache bound on the device."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...spec import AttentionSpec
from . import vulkan
from .models import (
    ORT_PROVIDER,
    _bsnh_flat,
    _make_session,
    _node_providers,
    _to_device,
    build_gqa_model,
    build_mha_model,
    ort_webgpu_supports,
)
from .status import ort_webgpu_status


class OrtWebGPUAttention:
    """ONNX Runtime WebGPU EP running the spec as one com.microsoft attention node.

    ``run(tensors)`` uploads the contract's tensors (q, k, v with the new tokens' K/V as the
    last S valid positions of k/v, seqlens_k when the spec has it) to the device, runs one
    bound call and returns the output in the spec's q layout. ``timings(iters, warmup)``
    repeats the bound call on the device-resident tensors. The KV cache is ORT's shared
    past/present buffer: each call writes the new K/V into it in place (the same values
    every time, so repeated calls compute the same result).
    """

    name = "onnxruntime-webgpu"

    def __init__(self, spec: AttentionSpec, *, provider_options: Mapping[str, str] | None = None,
                 verify_placement: bool = True) -> None:
        why = ort_webgpu_supports(spec)
        if why:
            raise ValueError(f"{self.name} cannot run {spec.short()}: {why}")
        status = ort_webgpu_status()
        if status:
            raise RuntimeError(f"{self.name} unavailable: {status}")
        import onnxruntime as ort

        self.spec = spec
        self.op = "GroupQueryAttention" if spec.causal else "MultiHeadAttention"
        self.version = ort.__version__
        self.vulkan_icd = os.environ.get("VK_ICD_FILENAMES")
        model = build_gqa_model(spec) if spec.causal else build_mha_model(spec)
        self._verify = verify_placement
        prefix = None
        if verify_placement:
            import tempfile

            self._profile_dir = tempfile.mkdtemp(prefix="attnreg-ort-")
            prefix = os.path.join(self._profile_dir, "ort")
        self.session = _make_session(model, profile=verify_placement,
                                     provider_options=provider_options, prefix=prefix)
        self.providers: list[str] = list(self.session.get_providers())
        if not self.providers or self.providers[0] != ORT_PROVIDER:
            raise RuntimeError(f"{self.name}: session providers are {self.providers}")
        # Static placement check: inputs the node reads on the device must live in WebGPU
        # memory (a CPU-placed node would ask for CPU memory).
        mem = {i.name: m.name for i, m in zip(self.session.get_inputs(),
                                              self.session.get_input_memory_infos())}
        cpu_side = [n for n, m in mem.items() if "webgpu" not in m.lower()
                    and n != "total_sequence_length"]
        if cpu_side:
            raise RuntimeError(f"{self.name}: inputs {cpu_side} are expected in CPU memory "
                               f"({mem}): the node did not land on {ORT_PROVIDER}")
        self.input_memory = mem
        self.node_providers: dict[str, str] = {}
        self.gpu_kernels: list[str] = []
        self._binding: Any = None
        self._dev: dict[str, Any] = {}
        self._out: Any = None
        self._sync: Any = None

    # -- inputs ------------------------------------------------------------------------
    def _host_inputs(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        from ...tensors import check_tensors, valid_lengths

        spec = self.spec
        t = check_tensors(spec, tensors)
        dt = np.dtype(spec.dtype)
        q = t["q"] if spec.q_layout == "BSNH" else t["q"].transpose(0, 2, 1, 3)    # [B,S,N,H]
        k = t["k"] if spec.kv_layout == "BNSH" else t["k"].transpose(0, 2, 1, 3)   # [B,Nkv,C,H]
        v = t["v"] if spec.kv_layout == "BNSH" else t["v"].transpose(0, 2, 1, 3)
        lengths = valid_lengths(spec, t)
        out: dict[str, np.ndarray] = {"query": _bsnh_flat(q.astype(dt, copy=False))}
        if not spec.causal:            # MHA: the whole valid K/V, BNSH
            L = spec.total_len
            out["key"] = np.ascontiguousarray(k[:, :, :L])
            out["value"] = np.ascontiguousarray(v[:, :, :L])
            return out
        s = spec.seq_len
        new_k = np.stack([k[b, :, int(L) - s:int(L)] for b, L in enumerate(lengths)])  # [B,Nkv,S,H]
        new_v = np.stack([v[b, :, int(L) - s:int(L)] for b, L in enumerate(lengths)])
        out["key"] = _bsnh_flat(new_k.transpose(0, 2, 1, 3))
        out["value"] = _bsnh_flat(new_v.transpose(0, 2, 1, 3))
        out["past_key"] = np.ascontiguousarray(k)
        out["past_value"] = np.ascontiguousarray(v)
        out["seqlens_k"] = (lengths - 1).astype(np.int32)
        out["total_sequence_length"] = np.array(int(lengths.max()), dtype=np.int32)
        return out

    def load(self, tensors: Mapping[str, Any]) -> None:
        """Upload the tensors to the device and bind them (not timed)."""
        import onnxruntime as ort

        host = self._host_inputs(tensors)
        binding = self.session.io_binding()
        binding.bind_output("output", "webgpu")
        dev: dict[str, Any] = {}
        for name, arr in host.items():
            if name == "total_sequence_length":       # ORT reads this one on the host
                dev[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            else:
                dev[name] = _to_device(arr)
            binding.bind_ortvalue_input(name, dev[name])
        if self.spec.causal:   # shared past/present buffer: the cache is updated in place
            binding.bind_ortvalue_output("present_key", dev["past_key"])
            binding.bind_ortvalue_output("present_value", dev["past_value"])
        self._binding, self._dev = binding, dev
        # The smallest device tensor: reading it back waits for all queued GPU work.
        self._sync = dev["seqlens_k"] if "seqlens_k" in dev else dev["query"]
        self.session.run_with_iobinding(binding)     # first call allocates the output...
        self._out = binding.get_outputs()[0]
        binding.bind_ortvalue_output("output", self._out)   # ...which later calls reuse
        if self._verify and not self.node_providers:
            path = self.session.end_profiling()
            try:
                self.node_providers = _node_providers(path)
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)
                    os.rmdir(self._profile_dir)
            bad = {n: p for n, p in self.node_providers.items() if p != ORT_PROVIDER}
            if bad or self.op not in self.node_providers:
                raise RuntimeError(f"{self.name}: node placement {self.node_providers}, "
                                   f"expected {self.op} on {ORT_PROVIDER}")

    def _call(self) -> None:
        self.session.run_with_iobinding(self._binding)

    def _wait(self) -> None:
        self._sync.numpy()

    # -- public ------------------------------------------------------------------------
    def run(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """The output for ``tensors`` (numpy, spec dtype, spec q layout)."""
        self.load(tensors)
        self._call()
        return self.output()

    def output(self) -> np.ndarray:
        """Read the last call's output back, in the spec's q layout."""
        spec = self.spec
        out = np.asarray(self._out.numpy()).reshape(spec.batch, spec.seq_len, spec.num_heads,
                                                    spec.head_size)
        return np.ascontiguousarray(out if spec.q_layout == "BSNH" else out.transpose(0, 2, 1, 3))

    def timings(self, iters: int = 50, warmup: int = 5, *, gpu: bool = True) -> dict[str, list[float]]:
        """Per-call times of the bound call, in seconds.

        wall_s: ``run_with_iobinding`` + a 4-byte read-back that waits for the GPU (what a
        decode step costs end to end). submit_s: the host time of ``run_with_iobinding``
        alone in a back-to-back loop (ORT's per-call host overhead; the GPU work is async).
        loop_s: that loop's total time to the final sync, divided by the call count.
        gpu_s (``gpu=True``, when ORT reports kernel times): the sum of the call's GPU kernel
        durations from ORT's own WebGPU profiler (timestamp queries), taken in a second,
        profiled session on the same device tensors, so the other numbers pay no
        profiling cost.
        """
        if self._binding is None:
            from attnreg.testing import make_tensors

            self.load(make_tensors(self.spec, seed=0, poison=False))
        for _ in range(warmup):
            self._call()
            self._wait()
        wall: list[float] = []
        for _ in range(iters):
            t0 = time.perf_counter()
            self._call()
            self._wait()
            wall.append(time.perf_counter() - t0)
        submit: list[float] = []
        t_loop = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            self._call()
            submit.append(time.perf_counter() - t0)
        self._wait()
        loop = (time.perf_counter() - t_loop) / max(iters, 1)
        out = {"wall_s": wall, "submit_s": submit, "loop_s": [loop]}
        if gpu:
            gpu_s = self._gpu_times(iters, warmup)
            if gpu_s:
                out["gpu_s"] = gpu_s
        return out

    def _gpu_times(self, iters: int, warmup: int) -> list[float]:
        """Per-call GPU time from ORT's WebGPU profiler ("Api" events, one per kernel)."""
        import tempfile

        model = build_gqa_model(self.spec) if self.spec.causal else build_mha_model(self.spec)
        with tempfile.TemporaryDirectory(prefix="attnreg-ort-gpu-") as tmp:
            sess = _make_session(model, profile=True, prefix=os.path.join(tmp, "ort"))
            binding = sess.io_binding()
            for name, val in self._dev.items():
                binding.bind_ortvalue_input(name, val)
            binding.bind_ortvalue_output("output", self._out)
            if self.spec.causal:
                binding.bind_ortvalue_output("present_key", self._dev["past_key"])
                binding.bind_ortvalue_output("present_value", self._dev["past_value"])
            n = warmup + iters
            for _ in range(n):
                sess.run_with_iobinding(binding)
                self._wait()
            path = sess.end_profiling()
            with open(path) as fh:
                events = json.load(fh)
        runs = sum(1 for e in events if e.get("cat") == "Node")
        kernels = sorted((e for e in events if e.get("cat") == "Api"), key=lambda e: e.get("ts", 0))
        if runs != n or not kernels or len(kernels) % n:
            self.gpu_kernels = [f"unparsed: {len(kernels)} kernel events for {runs} runs"]
            return []
        per = len(kernels) // n
        self.gpu_kernels = [str(e.get("name", "?")).split("&")[-1] for e in kernels[:per]]
        return [sum(float(e.get("dur", 0)) for e in kernels[r * per:(r + 1) * per]) * 1e-6
                for r in range(warmup, n)]

    def describe(self) -> dict[str, Any]:
        return {"peer": self.name, "version": self.version, "op": self.op,
                "providers": self.providers, "node_providers": self.node_providers,
                "gpu_kernels": self.gpu_kernels, "vulkan_icd": self.vulkan_icd, "shim": vulkan.shim_in_use}

    def close(self) -> None:
        if self.session is not None and self._verify and not self.node_providers:
            # Profiling never ended (no load): end it now so ORT writes no file at exit.
            with contextlib.suppress(Exception):
                path = self.session.end_profiling()
                os.remove(path)
                os.rmdir(self._profile_dir)
        self._binding = None
        self._dev = {}
        self._out = self._sync = None
        self.session = None

    def __enter__(self) -> OrtWebGPUAttention:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# torch SDPA
# --------------------------------------------------------------------------------------
