"""PreparedRun: a plan and its validated tensors, launched by calling it (Session.prepare)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .device_tensor import DeviceTensor
from .errors import SpecError
from .guard import Guard
from .hookspecs import Runtime
from .plan import Plan
from .tensors import host_sink

# How the Session launches a plan on a runtime (Session._run_plan: as it is, or padded)
Launcher = Callable[[Runtime, Plan, Mapping[str, Any], Mapping[str, Any] | None], dict[str, Any]]


class PreparedRun:
    """A validated (plan, tensors, out) triple; calling it launches (see Session.prepare).
    Only liveness is checked per call: the session is open, no tensor was freed (and a
    float16 / bfloat16 head_sink DeviceTensor, which the checks widened on the host, is read
    and checked again once it has been written)."""

    def __init__(self, guard: Guard, launch: Launcher, plan: Plan, runtime: Runtime,
                 inputs: dict[str, Any], out: DeviceTensor | None,
                 read_on_host: dict[str, DeviceTensor] | None = None) -> None:
        self.guard, self.launch, self.plan, self.runtime = guard, launch, plan, runtime
        self.inputs, self.out = inputs, out
        self.outputs = {"out": out} if out is not None else None
        # DeviceTensors the checks read into host arrays (a float16 / bfloat16 head_sink,
        # widened to the kernels' float32), with the version read: read again once written,
        # as a float32 one bound as it is would be
        self.read_on_host = {n: (t, t.version) for n, t in (read_on_host or {}).items()}
        self._record_why: tuple[Any, ...] | None = None     # checked on the first encode

    def __call__(self) -> Any:
        with self.guard.held():
            self._check_live()
            for name, (t, seen) in self.read_on_host.items():
                t.check_live(f"tensors[{name!r}]")
                if t.version != seen:
                    self.inputs[name] = host_sink(t)
                    self.read_on_host[name] = (t, t.version)
            res = self.launch(self.runtime, self.plan, self.inputs, self.outputs)
        return (res["out"], res["lse"]) if self.plan.spec.return_lse else res["out"]

    def encode(self, stream: Any, *, wait_for: Any = None) -> Any:
        """Record this launch into the caller's command stream instead of running it: on
        WebGPU a ``GPUCommandEncoder`` (the dispatches go in a compute pass of their own) or a
        ``GPUComputePassEncoder`` (they go into the caller's pass, whose pipeline and bind
        groups the caller sets again afterwards), submitted by the caller; on OpenCL the
        ``CommandQueue`` the Session runs on, after the events ``wait_for``, returning the
        event of the last stage. Nothing is uploaded, read back or waited for, so the
        engine's kernels before and after run in the same submit.

        Needs a launch that leaves everything on the device: ``prepare(..., out=)`` with every
        input a DeviceTensor, no lse asked for, a head size the kernels take as it is; a
        SpecError says what is missing."""
        with self.guard.held():
            self._check_live()
            if self._record_why is None:
                self._record_why = self._recordable()
            if self._record_why:
                raise SpecError(*self._record_why)
            return self.runtime.record(self.plan, self.inputs, self.outputs or {}, stream, wait_for)

    def _recordable(self) -> tuple[str, Any, str] | tuple[()]:
        """Why this launch cannot be recorded, as a SpecError's (field, value, expected),
        or () when it can."""
        spec, plan = self.plan.spec, self.plan
        if self.out is None:
            return ("out", None, "a DeviceTensor given to prepare(out=...): a recorded launch "
                    "leaves its result on the device")
        host = next((n for n, x in self.inputs.items() if not isinstance(x, DeviceTensor)), None)
        if host is not None:
            return (f"tensors[{host!r}]", self.inputs[host], "a DeviceTensor (a float32 one for "
                    "a head_sink): a recorded launch reads nothing from the host")
        if spec.return_lse:
            return ("spec.return_lse", True, "False: a recorded launch cannot hand back an lse")
        if plan.request is not None:
            return ("spec.head_size", plan.request.head_size, f"a head size {plan.kernel} "
                    "takes as it is: this plan pads head sizes with copies of its own")
        why = self.runtime.record_refusal(plan, self.inputs)
        return ("tensors", sorted(self.inputs), f"a launch {plan.caps.backend} can record: "
                f"{why}") if why else ()

    def _check_live(self) -> None:
        for name, x in self.inputs.items():
            if isinstance(x, DeviceTensor):
                x.check_live(f"tensors[{name!r}]")
        if self.out is not None:
            self.out.check_live("out")
