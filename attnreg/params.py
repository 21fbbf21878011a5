"""Checks for the ``params`` a caller passes to plan/run: kernel parameters by name.

A parameter is known when some registered kernel declares it (fixed value, default, tunable
choices or emulation) or the planner derives it (split_size, n_splits). Its value must have
the kind the kernels declare: integers in [1, 2**31 - 1] (kernels index with int32), bools,
or one of the declared strings. Anything else is a SpecError naming ``params[name]``, before
the value reaches a cache key, a division or a struct.pack.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .errors import SpecError
from .kernel import KernelInfo

INT_MAX = 2**31 - 1
# Derived by the planner from split_size; a caller may also fix them.
PLANNER_PARAMS: dict[str, tuple[Any, ...]] = {"split_size": (1,), "n_splits": (1,)}


def declared(kernels: Iterable[KernelInfo]) -> dict[str, set[Any]]:
    """Every parameter name the kernels declare, with the values they declare for it."""
    out: dict[str, set[Any]] = {n: set(v) for n, v in PLANNER_PARAMS.items()}
    for k in kernels:
        for src in (k.params, k.defaults, k.emulation):
            for name, value in src.items():
                out.setdefault(name, set()).add(value)
        for declared_values in (k.choices, k.options):
            for name, values in declared_values.items():
                out.setdefault(name, set()).update(values)
    return out


def check(params: Any, kernels: Iterable[KernelInfo]) -> dict[str, Any]:
    """``params`` validated against what the kernels declare (a new dict)."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise SpecError("params", params, "None or a mapping of parameter name -> value")
    known = declared(kernels)
    out: dict[str, Any] = {}
    for name, value in params.items():
        if not isinstance(name, str) or name not in known:
            raise SpecError("params", name, f"a kernel parameter name; known: {sorted(known)}")
        kinds = {type(v) for v in known[name]}
        field = f"params[{name!r}]"
        if kinds == {bool}:
            if not isinstance(value, bool):
                raise SpecError(field, value, "a bool")
        elif kinds <= {int}:
            # A parameter declared only as 0/1 is a switch (prefetch); the others are sizes or
            # counts, from 0 where a kernel declares 0 (l2_prefetch: off) and from 1 otherwise.
            own = name not in PLANNER_PARAMS
            lo = 0 if own and 0 in known[name] else 1
            hi = 1 if own and known[name] <= {0, 1} else INT_MAX
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise SpecError(field, value, f"an integer in [{lo}, {hi}]")
            value = int(value)
        else:
            choices = sorted(map(str, known[name]))
            if not isinstance(value, str) or value not in known[name]:
                raise SpecError(field, value, f"one of {choices}")
        out[name] = value
    return out
