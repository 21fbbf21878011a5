"""The interop conformance cells (docs/interop.md), for attnreg.tools.cases and .conformance:
a kernel run on the caller's device object, on inputs in the caller's buffers, recorded into
the caller's command stream, against the float64 reference.

Per device of a backend that runs on device objects, one cell per kernel family: a copy of
the family's first covering cell (of a float16 kernel, which the quick matrix keeps
everywhere) that such a launch can take -- the attention check, no lse, no bias or head sink
-- so it adds no program: the caller's device is the one attnreg opened, whose compiled
programs the Session on it shares. Nothing here names a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .. import registry as regmod
from ..kernel import KernelInfo
from ..session import Session
from ..testing import compare, expected
from .cells import FIRST_FAMILIES, Case

# The covering cells' dtype an interop cell copies (the quick matrix keeps them on every host).
DTYPE = "float16"


def recordable(c: Case) -> bool:
    """A covering cell whose launch a caller could record as it is: everything on the device
    (out, no lse; no bias or head sink, which runtimes derive data from on the host), its
    inputs as make_tensors gives them."""
    spec = c.spec
    return (c.kind == "covering" and c.check == "attention" and spec.dtype == DTYPE
            and not (spec.return_lse or spec.bias or spec.head_sink)
            and not (c.stored or c.mask_rows or c.docs or c.nonfinite or c.rerun))


def interop_cells(cells: Sequence[Case]) -> list[Case]:
    """One interop cell per (device, family that starts a route) of the devices whose backend
    runs on device objects: the family's first recordable covering cell, one that wraps the
    caller's int32 tensors too (lengths, a paged pool's block table) where there is one."""
    reg = regmod.get()
    found: dict[tuple[str, str], list[Case]] = {}
    for c in cells:
        if recordable(c) and c.family in FIRST_FAMILIES and reg.interop(c.backend):
            found.setdefault((c.device, c.family), []).append(c)
    picked = [next((c for c in mine if c.spec.seqlens_k or c.spec.kv_layout == "paged"), mine[0])
              for mine in found.values()]
    return [replace(c, label=f"{c.label}-interop", interop=True, kind="interop") for c in picked]


def session_for(case: Case, flags: dict[str, bool] | None) -> Session:
    """A Session on the device object an engine holds for the cell's device."""
    reg = regmod.get()
    interop = reg.interop(case.backend)
    assert interop is not None, case.backend
    caps = next(d for d in reg.devices(case.backend) if d.id == case.device)
    return Session(backend=case.backend, device=interop.device(caps, flags or {}), flags=flags)


def run_interop(case: Case, s: Session, k: KernelInfo, t: dict[str, np.ndarray],
                tol: tuple[float, float]) -> tuple[float, str]:
    """The cell's tensors in buffers of the caller's, wrapped; its launch prepared with out=
    (also a caller's buffer, then poisoned), recorded into a stream of the caller's and
    submitted by it; no host transfer while recording; out read back and compared."""
    interop = regmod.get().interop(case.backend)
    assert interop is not None, case.backend
    spec, obj = case.spec, s.device
    wrapped = {n: s.wrap(interop.buffer(obj, a), a.shape, a.dtype.name) for n, a in t.items()}
    out = s.wrap(interop.buffer(obj, np.zeros(spec.out_shape, spec.dtype)), spec.out_shape,
                 spec.dtype)
    run = s.prepare(spec, wrapped, out=out, kernel=k.id, params=dict(case.params) or None)
    out.write(np.full(spec.out_shape, np.nan, spec.dtype))   # what prepare's own run wrote
    counters = run.runtime.counters
    before = dict(counters)
    interop.submit(obj, run.encode)
    moved = {n: counters[n] - before.get(n, 0) for n in ("host_uploads", "readbacks")}
    if any(moved.values()):
        return float("inf"), f"recording moved data between host and device: {moved}"
    return compare(spec, out.numpy(), expected(spec, t), tol)
