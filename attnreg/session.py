"""Session: a chosen backend/device, its plans, and the runtimes that hold buffers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import flags as flagmod
from . import params as paramsmod
from . import registry as regmod
from .device_tensor import DeviceTensor
from .errors import KernelUnavailable, SpecError
from .guard import Guard
from .headpad import HeadPadder
from .hookspecs import Runtime
from .plan import Plan
from .prepared import PreparedRun
from .session_memory import SessionMemory, serialized
from .spec import AttentionSpec
from .states import check_partials, merge_as_reduce, restore_lse, states_layout
from .tensors import check_tensors, read_on_host


def _freeze(m: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((m or {}).items()))


class Session(SessionMemory):
    """Holds plans, compiled kernels and buffers across calls; use as a context manager.

    Threads: a Session may be shared; its operations (and those of its tensors and KV
    caches) run one at a time under its lock. Separate Sessions run concurrently.

    >>> import attnreg, numpy as np
    >>> spec = attnreg.AttentionSpec(seq_len=1, past_len=7, head_size=8)
    >>> rng = np.random.default_rng(0)
    >>> t = {n: rng.standard_normal(s).astype("float32")
    ...      for n, s in (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    >>> with attnreg.Session(backend="reference") as s:
    ...     out = s.run(spec, t)
    >>> out.shape
    (1, 1, 1, 8)
    """

    def __init__(self, backend: str | None = None, device: Any = None,
                 flags: Mapping[str, Any] | None = None) -> None:
        """``device``: an id, index or part of a name of a probed device (None: the best
        one), or a device the caller opened -- a ``wgpu.GPUDevice`` (webgpu), a wgpudawn
        device (dawn), a ``pyopencl.CommandQueue`` (opencl) -- which the Session then runs
        on as the caller opened it (its features and limits) and never destroys or waits
        for (docs/interop.md)."""
        self.registry = regmod.get()
        if backend is not None:
            self.registry.backend(backend)          # unknown backend -> SpecError now
        self.backend = backend
        self.device = device
        self.flags = dict(flags or {})
        flagmod.resolve(self.flags)                 # unknown or ill-typed flags -> SpecError now
        self._plans: dict[Any, Plan] = {}
        self._plans_made = 0
        self._runtimes: dict[str, Runtime] = {}    # device id -> the runtime opened on it
        # the runtime on the caller's device object, whose caps every plan is made for
        self._adopted: Runtime | None = None
        if device is not None and not isinstance(device, (str, int)):
            self._adopted = self.registry.adopt(backend, device, flagmod.resolve(self.flags))
            self._runtimes[self._adopted.caps.id] = self._adopted
        elif device is not None:
            self.registry.find_device(backend, device)
        self._failed: dict[tuple[str, str], str] = {}
        self._home: str | None = None
        # the lock and open state its tensors, KV caches and prepared runs share
        self._guard = Guard()
        # padded twins of DeviceTensors for plans that pad head sizes (headpad.py)
        self._padder = HeadPadder(lambda shape, dtype, dev: self.empty(shape, dtype, device=dev))

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._guard.closed

    @property
    def plans_made(self) -> int:
        """How many plans the session has made (a plan served from its cache is not counted):
        a prepared decode loop that re-plans shows here."""
        return self._plans_made

    def close(self) -> None:
        """Release every device buffer and compiled program; later calls on the session, its
        tensors or KV caches raise ClosedError. Closing twice is harmless."""
        with self._guard.held(check_open=False):
            self._guard.closed = True
            runtimes = list(self._runtimes.values())
            self._runtimes.clear()
            self._plans.clear()
            self._padder.clear()
            for rt in runtimes:
                rt.close()

    # -- planning ----------------------------------------------------------------------
    def plan(self, spec: AttentionSpec, *, op: str = "attention", kernel: str | None = None,
             params: Mapping[str, Any] | None = None,
             flags: Mapping[str, Any] | None = None) -> Plan:
        """The plan for ``spec`` (cached: a decode loop plans once)."""
        if flags is not None:
            flagmod.resolve(flags, use_env=False)       # names, types, choices: SpecError
        if kernel is not None and not isinstance(kernel, str):
            raise SpecError("kernel", kernel, "None or a registered kernel id (a str)")
        params = paramsmod.check(params, self.registry.kernels()) if params else None
        key = (spec, op, kernel, _freeze(params), _freeze(flags))
        with self._guard.lock:
            self._guard.check_open()
            plan = self._plans.get(key)
            if plan is None:
                merged = flagmod.resolve(self.flags, flags)
                where = {"caps": self._adopted.caps} if self._adopted is not None \
                    else {"device": self.device}
                plan = self.registry.plan(spec, op=op, backend=self.backend, flags=merged,
                                          kernel=kernel, params=params, exclude=self._failed,
                                          **where)
                self._plans[key] = plan
                self._plans_made += 1
            return plan

    explain = plan

    def runtime(self, plan: Plan) -> Runtime:
        """The runtime of the plan's device, opened once per Session."""
        return self._runtime(plan.caps)

    def _launch(self, spec: AttentionSpec, op: str, inputs: Mapping[str, Any],
                kernel: str | None, params: Mapping[str, Any] | None,
                flags: Mapping[str, Any] | None,
                out: DeviceTensor | None = None) -> tuple[Plan, dict[str, Any]]:
        resident = any(isinstance(x, DeviceTensor) for x in inputs.values()) or out is not None
        if resident and self.device is None:
            # Device tensors pin the plan to their device.
            self.device = self.home_device()
            self._plans.clear()
        outputs = {"out": out} if out is not None else None
        while True:
            plan = self.plan(spec, op=op, kernel=kernel, params=params, flags=flags)
            try:
                rt = self.runtime(plan)
                self._check_resident(plan, inputs)
                return plan, self._run_plan(rt, plan, inputs, outputs)
            except MemoryError:
                # Host memory (the reference's float64 copies, host-staged inputs): a
                # request too big for this machine, refused like any other.
                raise SpecError("spec", spec, f"a request whose host-side buffers fit in "
                                f"memory on {plan.caps.name} ({plan.kernel})") from None
            except KernelUnavailable as exc:
                # Remember the failure for this device and plan again without that kernel.
                with self._guard.lock:
                    self._failed[(plan.caps.id, exc.kernel_id)] = f"failed on this device: {exc.reason}"
                    self._plans.clear()

    def _run_plan(self, rt: Runtime, plan: Plan, inputs: Mapping[str, Any],
                  outputs: Mapping[str, Any] | None) -> dict[str, Any]:
        """Launch a plan on the caller's tensors: as they are, or, where the plan pads head
        sizes (plan.request), through their zero-padded twins (headpad.py)."""
        if plan.request is None:
            return rt.launch(plan, inputs, outputs)
        return self._padder.launch(rt, plan, inputs, outputs)

    # -- ops ---------------------------------------------------------------------------
    @serialized
    def run(self, spec: AttentionSpec, tensors: Mapping[str, Any], *, kernel: str | None = None,
            params: Mapping[str, Any] | None = None, flags: Mapping[str, Any] | None = None,
            out: DeviceTensor | None = None) -> Any:
        """Attention: returns out, or (out, lse) when spec.return_lse.

        Inputs may be numpy arrays or DeviceTensors of this session; with ``out=`` (a
        DeviceTensor) the result stays on the device and ``out`` is returned.
        """
        _check_spec(spec)
        inputs = check_tensors(spec, tensors)
        if out is not None:
            _check_out(spec, out)
        _, res = self._launch(spec, "attention", inputs, kernel, params, flags, out)
        return (res["out"], res["lse"]) if spec.return_lse else res["out"]

    @serialized
    def prepare(self, spec: AttentionSpec, tensors: Mapping[str, Any], *,
                out: DeviceTensor | None = None, kernel: str | None = None,
                params: Mapping[str, Any] | None = None,
                flags: Mapping[str, Any] | None = None) -> PreparedRun:
        """Plan and validate once; the returned callable launches with no per-call checks.

        For decode loops over DeviceTensors (a KV cache): the tensors' shapes and dtypes
        cannot change, so validating them once is enough; the lengths of a KVCache are
        range-checked by its ``append``. Calling runs the plan and returns what
        :meth:`run` would.
        """
        _check_spec(spec)
        inputs = check_tensors(spec, tensors)
        if out is not None:
            _check_out(spec, out)
        self._launch(spec, "attention", inputs, kernel, params, flags, out)   # compile, warm
        plan = self.plan(spec, kernel=kernel, params=params, flags=flags)
        self._check_resident(plan, inputs)                 # ownership/device checks, once
        return PreparedRun(self._guard, self._run_plan, plan, self.runtime(plan), dict(inputs),
                           out, read_on_host(tensors, inputs))

    @serialized
    def run_with_plan(self, spec: AttentionSpec, tensors: Mapping[str, Any], **kw: Any
                      ) -> tuple[Any, Plan]:
        """Like run(), also returning the plan that actually ran."""
        _check_spec(spec)
        inputs = check_tensors(spec, tensors)
        plan, res = self._launch(spec, "attention", inputs, kw.get("kernel"), kw.get("params"),
                                 kw.get("flags"))
        return ((res["out"], res["lse"]) if spec.return_lse else res["out"]), plan

    @serialized
    def partial_states(self, spec: AttentionSpec, tensors: Mapping[str, Any], *,
                       split_size: int | None = None, kernel: str | None = None,
                       params: Mapping[str, Any] | None = None,
                       flags: Mapping[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Split-KV partial states (o_parts [B,Nq,S,T,H], lse_parts [B,Nq,S,T]) float32."""
        _check_spec(spec)
        inputs = check_tensors(spec, tensors)
        p = dict(params or {})
        if split_size is not None:
            if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < 1:
                raise SpecError("split_size", split_size, "an integer >= 1")
            p["split_size"] = split_size          # the planner derives the split count
        _, res = self._launch(spec, "partial", inputs, kernel, p, flags)
        return res["o_parts"], res["lse_parts"]

    @serialized
    def reduce_states(self, spec: AttentionSpec, o_parts: Any, lse_parts: Any,
                      head_sink: Any = None, *, seqlens_q: Any = None,
                      kernel: str | None = None,
                      flags: Mapping[str, Any] | None = None) -> Any:
        """Reduce partial states (from any backend) into out, or (out, lse); a spec with
        seqlens_q takes the row counts too (padding rows: out 0, lse -inf)."""
        _check_spec(spec)
        inputs = check_partials(spec, o_parts, lse_parts, head_sink, seqlens_q)
        t = inputs["o_parts"].shape[3]
        _, res = self._launch(spec, "reduce", inputs, kernel, {"n_splits": t}, flags)
        return (res["out"], res["lse"]) if spec.return_lse else res["out"]

    @serialized
    def merge_states(self, states: Sequence[tuple[Any, Any]], *, layout: str | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """merge_states on this session's device: the states become the splits of one reduce.

        Any leading shape works: (o [..., H], lse [...]) is flattened to R rows, and the reduce
        runs for a spec of batch 1, one head, R query rows. run's own (out, lse) merge in
        either q_layout (see attnreg.merge_states for ``layout``).
        """
        how = states_layout(states, layout)
        spec, o_parts, lse_parts, lead = merge_as_reduce(states, how)
        out, lse = self.reduce_states(spec, o_parts, lse_parts)
        return out.reshape(*lead, spec.head_size), restore_lse(lse.reshape(lead), how)


def _check_out(spec: AttentionSpec, out: Any) -> None:
    if isinstance(out, DeviceTensor):
        out.check_live("out")
    if not isinstance(out, DeviceTensor) or out.shape != spec.out_shape \
            or out.dtype != np.dtype(spec.dtype):
        raise SpecError("out", out, f"a {spec.dtype} DeviceTensor of shape {spec.out_shape}")


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, AttentionSpec):
        raise SpecError("spec", spec, "an attnreg.AttentionSpec")
