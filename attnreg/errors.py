"""The two exceptions every rejection goes through."""

from __future__ import annotations

import reprlib
from typing import Any

# Bounds on what a message repeats of the caller's input (docs/errors.md, "Bad input"): a 10 MB
# tensor name or a 5000-digit integer gives a message of a few hundred characters.
FIELD_CHARS = 200            # a field name (it may embed a caller's key: flags['...'])
VALUE_CHARS = 200            # the value's repr
TEXT_CHARS = 4000            # what was expected, and the detail


class _Repr(reprlib.Repr):
    """reprlib with integers of any size: repr() of an int past 4300 digits raises."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = VALUE_CHARS - 20
        self.maxlong = 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 8

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 192:                 # > 57 digits: never printed in full
            digits = int(x.bit_length() * 0.30103) + 1
            sign = "" if x > 0 else "negative "
            return f"<{sign}int of about {digits} digits>"
        return super().repr_int(x, level)


_REPR = _Repr()


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying so."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any) -> str:
    """repr() that stays readable and bounded for arrays, long strings, deep containers and
    integers too large to print; never raises."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return clip(f"<array shape={_REPR.repr(tuple(shape))} dtype={dtype}>", VALUE_CHARS)
    try:
        text = _REPR.repr(value)
    except Exception:                            # a __repr__ that raises
        text = f"<{type(value).__name__} object>"
    return clip(text, VALUE_CHARS)


class SpecError(ValueError):
    """A spec, tensor, flag or request that attnreg refuses.

    The message always names the field, the value that was given and what was expected,
    so the caller can fix the input without reading attnreg's source.
    """

    def __init__(self, field: str, value: Any, expected: str, *, detail: str = "") -> None:
        field = clip(str(field), FIELD_CHARS)
        expected = clip(str(expected), TEXT_CHARS)
        self.field = field
        self.value = value
        self.expected = expected
        msg = f"{field}={short(value)}: expected {expected}"
        if detail:
            msg += "\n" + clip(str(detail), TEXT_CHARS)
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


class CacheWarning(UserWarning):
    """A file of attnreg's cache directory was ignored (wrong shape, a symlink, another
    owner, writable by others); the message names it. What it held is measured again."""
