"""The conformance matrix: the registry-generated cells (attnreg.tools.cases) run against the
float64 reference with the contract's tolerances, and the report (JSON rows, a kernels x
devices table).

Every registered kernel variant x every available device of its backend x its declared
dtypes, head sizes and contract features becomes cells with readable ids such as
``webgpu-llvmpipe-decode_partial-f16-m4-gqa4-h32-causal``; see attnreg.tools.cases.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference as ref
from .. import registry as regmod
from ..caps import DeviceCaps
from ..errors import NoKernelError
from ..kernel import KernelInfo
from ..session import Session
from ..tensors import check_tensors
from ..testing import compare, compare_partials, expected, make_tensors, plant_nonfinite
from .cases import cases, uncovered
from .cells import Case
from .interop_cells import run_interop
from .interop_cells import session_for as interop_session
from .profile_cells import PROFILE_SPECS, profile_cases
from .recipes import doc_mask

__all__ = ["PROFILE_SPECS", "Case", "Result", "cases", "inputs_for", "load_required",
           "markdown", "missing_required", "profile_cases", "run_case", "run_matrix",
           "uncovered"]


@dataclass
class Result:
    case: Case
    status: str                 # pass | fail | skip
    max_abs_err: float
    atol: float
    rtol: float
    seconds: float
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        c = self.case
        return {"backend": c.backend, "device": c.device, "kernel": c.kernel, "case": c.id,
                "dtype": c.spec.dtype, "status": self.status,
                "max_abs_err": None if not np.isfinite(self.max_abs_err) else self.max_abs_err,
                "atol": self.atol, "rtol": self.rtol, "seconds": round(self.seconds, 4),
                "message": self.message}


# -- running -----------------------------------------------------------------------------
def inputs_for(case: Case) -> dict[str, np.ndarray]:
    """The cell's tensors: random, tails past each valid length poisoned, the bias shaped,
    masked, made a document mask, tensors stored in the dtypes the recipe says, and NaN / inf
    planted for non-finite cells (testing.plant_nonfinite)."""
    spec = case.spec
    t = make_tensors(spec, seed=case.seed, lengths=case.lengths, bias_shape=case.bias_shape,
                     mask_frac=case.mask_frac)
    if case.docs:
        t["bias"] = doc_mask(spec, t["bias"], case.docs, case.doc_values)
    if case.mask_rows == "corners":
        t["bias"][0, :, 0, :] = -np.inf          # batch 0, row 0: every key masked
        if t["bias"].shape[2] > 1:
            t["bias"][-1, -1, -1, :] = -np.inf
    elif case.mask_rows == "first":
        t["bias"][:, :, 0, :] = -np.inf          # row 0 of every batch and head
    for name, dtype in case.stored:          # bias / head_sink in another accepted dtype
        t[name] = t[name].astype(np.dtype(dtype))
    if case.nonfinite and case.check != "reduce":
        plant_nonfinite(spec, t)
    return t


def nonfinite_partials(o_p: np.ndarray, l_p: np.ndarray) -> None:
    """Non-finite values in (reference) partial states, in place, for a reduce to handle:
    garbage (NaN, inf) in the o of empty splits, to ignore; NaN and inf in the o of
    non-empty splits, one of them with a weight that underflows to 0, to propagate as NaN."""
    o_p[np.isneginf(l_p)] = np.nan
    if o_p.shape[-2] > 1:
        o_p[..., 1, :][np.isneginf(l_p[..., 1])] = np.inf
    rows = np.argwhere(np.isfinite(l_p))                  # [b, h, i, t] of non-empty splits
    if len(rows):
        b, h, i, t = rows[0]
        o_p[b, h, i, t, 0] = np.nan
        b, h, i, t = rows[len(rows) // 2]
        o_p[b, h, i, t, 1 % o_p.shape[-1]] = np.inf
        b, h, i, t = rows[-1]
        if np.isfinite(l_p[b, h, i]).sum() > 1:          # another split keeps the row going
            l_p[b, h, i, t] -= 200.0                      # its weight underflows to 0
            o_p[b, h, i, t, o_p.shape[-1] - 1] = np.nan


def run_case(case: Case, session: Session) -> Result:
    """Run one cell; never raises (errors become failing results)."""
    k = regmod.get().kernel(case.kernel)
    atol, rtol = k.tolerance.get(case.spec.dtype, (0.0, 0.0))
    t0 = time.perf_counter()
    try:
        err, problem = _execute(case, session, k, (atol, rtol))
        status = "fail" if problem else "pass"
    except NoKernelError as exc:
        err, problem, status = float("inf"), f"could not be forced: {exc}", "fail"
    except Exception as exc:   # a crash is a failing cell, not a crashed matrix
        err, problem, status = float("inf"), f"{type(exc).__name__}: {exc}", "fail"
    return Result(case, status, err, atol, rtol, time.perf_counter() - t0, problem)


def _execute(case: Case, s: Session, k: KernelInfo, tol: tuple[float, float]) -> tuple[float, str]:
    spec, params = case.spec, dict(case.params)
    t = inputs_for(case)
    if case.interop:
        return run_interop(case, s, k, t, tol)
    want = expected(spec, t)
    split = int(params.pop("split_size", 16))
    if case.check == "reduce":
        # The reference's partial states, reduced by the kernel; an empty split's o may hold
        # anything (NaN here) and must not reach the output.
        o_p, l_p = ref.partial_states(spec, check_tensors(spec, t), split)
        o_p, l_p = o_p.astype(np.float32), l_p.astype(np.float32)
        o_p[np.isneginf(l_p)] = np.nan
        if case.nonfinite:
            nonfinite_partials(o_p, l_p)
            out, lse = ref.reduce(spec, o_p, l_p, t.get("head_sink"), t.get("seqlens_q"))
            want = ref.out_layout(spec, out), lse
        got = s.reduce_states(spec, o_p, l_p, t.get("head_sink"), seqlens_q=t.get("seqlens_q"),
                              kernel=k.id)
        return compare(spec, got, want, tol)
    if case.check == "partial":
        # The kernel's partial states against the reference's, then reduced in float64.
        o, lse = s.partial_states(spec, t, split_size=split, kernel=k.id, params=params or None)
        err, problem = compare_partials(
            spec, (o, lse), ref.partial_states(spec, check_tensors(spec, t), split), tol)
        if problem:
            return err, problem
        out, lse_red = ref.reduce(spec, o, lse, t.get("head_sink"), t.get("seqlens_q"))
        got = ref.out_layout(spec, out).astype(spec.dtype)
        red_err, problem = compare(
            spec, (got, lse_red.astype(np.float32)) if spec.return_lse else got, want, tol)
        return max(err, red_err), problem
    if "split_size" in case.params:
        params["split_size"] = split
    got = s.run(spec, t, kernel=k.id, params=params)
    err, problem = compare(spec, got, want, tol)
    if not problem and case.rerun:
        again = s.run(spec, t, kernel=k.id, params=params)
        a = got if not spec.return_lse else got[0]
        b = again if not spec.return_lse else again[0]
        if a.tobytes() != b.tobytes():
            problem = "a rerun gave different bits"
    return err, problem


def session_for(case: Case) -> Session:
    """The Session a device's cells run in: with the flags its matrix kernels' hardware
    builds need to open the device (Dawn's experimental_features), so those cells run."""
    flags = {k.flag: True for k in regmod.get().kernels(case.backend)
             if k.matrix is not None and k.flag}
    if case.interop:
        return interop_session(case, flags or None)
    return Session(backend=case.backend, device=case.device, flags=flags or None)


def session_key(case: Case) -> tuple[str, bool]:
    """Cells share a Session per device, and the interop ones one on its device object."""
    return case.device, case.interop


def run_matrix(all_cases: Sequence[Case], progress: Callable[[Sequence[Case]], Iterable[Case]]
               | None = None) -> list[Result]:
    """Run cases, one Session per device (so compiled kernels are reused)."""
    sessions: dict[tuple[str, bool], Session] = {}
    results = []
    try:
        for case in (progress(all_cases) if progress else all_cases):
            s = sessions.get(session_key(case))
            if s is None:
                s = sessions[session_key(case)] = session_for(case)
            results.append(run_case(case, s))
    finally:
        for s in sessions.values():
            s.close()
    return results


def load_required(path: str) -> dict[str, Any]:
    import json
    with open(path) as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def missing_required(required: dict[str, Any], devices: Iterable[DeviceCaps]) -> list[str]:
    """Required (backend, slug) pairs with no available device."""
    have = {(d.backend, d.slug) for d in devices if d.available}
    return [f"{r['backend']}/{r['slug']}" for r in required.get("devices", [])
            if (r["backend"], r["slug"]) not in have]


def markdown(results: Sequence[Result]) -> str:
    """Kernels x devices table of pass counts."""
    devices = sorted({f"{r.case.backend}/{r.case.slug}" for r in results})
    kernels = sorted({r.case.kernel for r in results})
    cell: dict[tuple[str, str], list[int]] = {}
    for r in results:
        c = cell.setdefault((r.case.kernel, f"{r.case.backend}/{r.case.slug}"), [0, 0])
        c[0] += r.status == "pass"
        c[1] += 1
    lines = ["| kernel | " + " | ".join(devices) + " |", "|---" * (len(devices) + 1) + "|"]
    for k in kernels:
        row = []
        for d in devices:
            p = cell.get((k, d))
            row.append("" if p is None else f"{p[0]}/{p[1]}" + ("" if p[0] == p[1] else " ❌"))
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    total = sum(r.status == "pass" for r in results)
    lines.append(f"\n{total}/{len(results)} cells pass.")
    return "\n".join(lines)
