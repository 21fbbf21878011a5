"""PreparedRun: a plan and its validated tensors, launched by calling it (Session.prepare)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .device_tensor import DeviceTensor
from .hookspecs import Runtime
from .interrupts import deferred
from .plan import Plan
from .tensors import host_sink

if TYPE_CHECKING:
    from .session import Session


class PreparedRun:
    """A validated (plan, tensors, out) triple; calling it launches (see Session.prepare).
    Only liveness is checked per call: the session is open, no tensor was freed (and a
    float16 / bfloat16 head_sink DeviceTensor, which the checks widened on the host, is read
    and checked again once it has been written)."""

    def __init__(self, session: Session, plan: Plan, runtime: Runtime, inputs: dict[str, Any],
                 out: DeviceTensor | None, read_on_host: dict[str, DeviceTensor] | None = None
                 ) -> None:
        self.session, self.plan, self.runtime = session, plan, runtime
        self.inputs, self.out = inputs, out
        self.outputs = {"out": out} if out is not None else None
        # DeviceTensors the checks read into host arrays (a float16 / bfloat16 head_sink,
        # widened to the kernels' float32), with the version read: read again once written,
        # as a float32 one bound as it is would be
        self.read_on_host = {n: (t, t.version) for n, t in (read_on_host or {}).items()}

    def __call__(self) -> Any:
        s = self.session
        with s._lock, deferred():
            s._check_open()
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
            res = s._run_plan(self.runtime, self.plan, self.inputs, self.outputs)
        return (res["out"], res["lse"]) if self.plan.spec.return_lse else res["out"]
