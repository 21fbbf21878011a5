"""The two exceptions every rejection goes through."""

from __future__ import annotations

from typing import Any


def _short(value: Any) -> str:
    """repr() that stays readable for arrays and long values."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"<array shape={tuple(shape)} dtype={dtype}>"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class SpecError(ValueError):
    """A spec, tensor, flag or request that attnreg refuses.

    The message always names the field, the value that was given and what was expected,
    so the caller can fix the input without reading attnreg's source.
    """

    def __init__(self, field: str, value: Any, expected: str, *, detail: str = "") -> None:
        self.field = field
        self.value = value
        self.expected = expected
        msg = f"{field}={_short(value)}: expected {expected}"
        if detail:
            msg += f"\n{detail}"
        super().__init__(msg)


class NoKernelError(SpecError):
    """No registered kernel can run the request; the message lists every candidate's reasons."""

    def __init__(self, spec: Any, rejected: dict[str, list[str]], *, what: str = "kernel") -> None:
        self.spec = spec
        self.rejected = rejected
        lines = [f"no {what} can run this request.", f"spec: {spec!r}"]
        if not rejected:
            lines.append("  (no candidate kernels are registered for the selected backend/device)")
        for kernel_id, reasons in rejected.items():
            lines.append(f"  {kernel_id}:")
            lines.extend(f"    - {r}" for r in reasons)
        self.explanation = "\n".join(lines)
        ValueError.__init__(self, self.explanation)
        self.field = "spec"
        self.value = spec
        self.expected = "a request some registered kernel supports"


class KernelUnavailable(RuntimeError):
    """Raised by a Runtime when a planned kernel cannot run on its device after all
    (e.g. the driver's compiler rejected it). The session records the reason as a
    rejection and plans again, so the next candidate runs."""

    def __init__(self, kernel_id: str, reason: str) -> None:
        self.kernel_id = kernel_id
        self.reason = reason
        super().__init__(f"{kernel_id}: {reason}")


class ClosedError(SpecError):
    """A Session used after ``close()``, or a DeviceTensor / KVCache used after ``free()`` or
    after its Session closed. Its memory is gone, so the call is refused before it reaches a
    device (where it would crash the driver)."""

    def __init__(self, what: str, value: Any, expected: str) -> None:
        super().__init__(what, value, expected)
