"""PreparedRun: a plan and its validated tensors, launched by calling it (Session.prepare)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .device_tensor import DeviceTensor
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

    def __call__(self) -> Any:
        with self.guard.held():
            for name, x in self.inputs.items():
                if isinstance(x, DeviceTensor):
                    x.check_live(f"tensors[{name!r}]")
            if self.out is not None:
                self.out.check_live("out")
            for name, (t, seen) in self.read_on_host.items():
                t.check_live(f"tensors[{name!r}]")
                if t.version != seen:
                    self.inputs[name] = host_sink(t)
                    self.read_on_host[name] = (t, t.version)
            res = self.launch(self.runtime, self.plan, self.inputs, self.outputs)
        return (res["out"], res["lse"]) if self.plan.spec.return_lse else res["out"]
