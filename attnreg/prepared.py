"""PreparedRun: a plan and its validated tensors, launched by calling it (Session.prepare)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .device_tensor import DeviceTensor
from .hookspecs import Runtime
from .interrupts import deferred
from .plan import Plan

if TYPE_CHECKING:
    from .session import Session


class PreparedRun:
    """A validated (plan, tensors, out) triple; calling it launches (see Session.prepare).
    Only liveness is checked per call: the session is open, no tensor was freed."""

    def __init__(self, session: Session, plan: Plan, runtime: Runtime, inputs: dict[str, Any],
                 out: DeviceTensor | None) -> None:
        self.session, self.plan, self.runtime = session, plan, runtime
        self.inputs, self.out = inputs, out
        self.outputs = {"out": out} if out is not None else None

    def __call__(self) -> Any:
        s = self.session
        with s._lock, deferred():
            s._check_open()
            for name, x in self.inputs.items():
                if isinstance(x, DeviceTensor):
                    x.check_live(f"tensors[{name!r}]")
            if self.out is not None:
                self.out.check_live("out")
            res = s._run_plan(self.runtime, self.plan, self.inputs, self.outputs)
        return (res["out"], res["lse"]) if self.plan.spec.return_lse else res["out"]
