"""Head sizes that no kernel of a backend takes as they are run with zero columns added.

Kernels load q, k and v in whole vectors (WGSL: 16-byte granules of 4 or 8 values; OpenCL:
float4s; matrix units: 16-wide tiles), so they declare head sizes in steps. A request whose
head size (or v's) is off those steps runs as a request of the next size a kernel takes
(``rules.head_padding`` chooses it, explain names it), with q, k and v padded by zero
columns: a zero column adds 0 to every dot product and gives an output column of 0, so the
padded request's first Hv output columns are exactly the asked request's output. The default
scale stays that of the asked head size (the padded spec carries it explicitly).

Only the last axis changes, so every layout (BSNH, BNSH, paged pools) and every quantized
storage pads the same way (int8 codes of 0 are values of 0; int4 needs head sizes in blocks
of 32, which every kernel step divides, so it never pads). Host arrays are padded on the
host as they are staged; DeviceTensors are copied on the device (``Runtime.copy_rows``) into
padded twins kept per tensor and version, so a decode loop over a KV cache moves nothing
through the host. Results come back cut to the asked head size, on the host or on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .device_tensor import DeviceTensor
from .hookspecs import Runtime
from .plan import Plan
from .spec import AttentionSpec

# Tensors whose last axis is k's head size (H) or v's (Hv), by op.
_QK_AXIS = ("q", "k")
_V_AXIS = ("v", "o_parts")
# Results with v's head size as their last axis.
_RESULTS = ("out", "o_parts")


def padded_spec(spec: AttentionSpec, head_size: int, head_size_v: int) -> AttentionSpec:
    """``spec`` with head sizes ``head_size`` / ``head_size_v`` and its own scale."""
    return spec.replace(head_size=head_size,
                        v_head_size=None if head_size_v == head_size else head_size_v,
                        scale=spec.effective_scale)


def describe(asked: AttentionSpec, run: AttentionSpec) -> str:
    """One line for explain: what was padded to what."""
    parts = [f"head_size {asked.head_size} -> {run.head_size}"]
    if asked.head_size_v != run.head_size_v or asked.head_size_v != asked.head_size:
        parts.append(f"v_head_size {asked.head_size_v} -> {run.head_size_v}")
    return ", ".join(parts)


def _width(name: str, spec: AttentionSpec) -> int | None:
    if name in _QK_AXIS:
        # int4 K/V are byte pairs (H/2 per vector); int4 head sizes never pad (blocks of 32)
        return spec.head_size
    if name in _V_AXIS:
        return spec.head_size_v
    return None


def grown(name: str, plan: Plan) -> int | None:
    """The width input ``name``'s last axis grows to under ``plan``, or None if it stays."""
    if plan.request is None:
        return None
    w = _width(name, plan.spec)
    return None if w is None or w == _width(name, plan.request) else w


def host_inputs(plan: Plan, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host inputs as ``plan``'s kernels take them (padded where it pads head sizes): for
    tools that launch a plan on a runtime themselves (bench timings)."""
    return {n: x if (w := grown(n, plan)) is None else pad_array(x, w) for n, x in inputs.items()}


def pad_array(arr: Any, width: int) -> np.ndarray:
    """A host array with its last axis widened to ``width`` by zeros."""
    a = np.asarray(arr)
    out = np.zeros((*a.shape[:-1], width), a.dtype)
    out[..., :a.shape[-1]] = a
    return out


class HeadPadder:
    """A Session's padded twins of its DeviceTensors, and the launch of a padded plan."""

    MAX_TWINS = 32

    def __init__(self, empty: Callable[[tuple[int, ...], str, str], DeviceTensor]) -> None:
        # empty(shape, dtype, device_id): a new DeviceTensor of the session
        self._empty = empty
        # (id(tensor), width) -> (tensor, version copied, twin)
        self._twins: OrderedDict[tuple[int, int], tuple[DeviceTensor, int, DeviceTensor]] = \
            OrderedDict()
        # (id(out), width) -> (out, scratch) for results kept on the device
        self._scratch: OrderedDict[tuple[int, int], tuple[DeviceTensor, DeviceTensor]] = \
            OrderedDict()

    def launch(self, rt: Runtime, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None) -> dict[str, Any]:
        """Run a padded plan (``plan.request`` is the asked spec) on the asked tensors."""
        asked, run = plan.request, plan.spec
        assert asked is not None
        padded: dict[str, Any] = {}
        for name, x in inputs.items():
            w = grown(name, plan)
            if w is None:
                padded[name] = x
            elif isinstance(x, DeviceTensor):
                padded[name] = self._twin(rt, x, w)
            else:
                padded[name] = pad_array(x, w)
        given = {n: t for n, t in (outputs or {}).items() if t is not None}
        scratch = {n: self._scratch_for(t, run.head_size_v) for n, t in given.items()}
        res = rt.launch(plan, padded, scratch or None)
        hv, hvp = asked.head_size_v, run.head_size_v
        for name in _RESULTS:
            if name in given:
                t = given[name]
                rows = t.nbytes // (hv * t.dtype.itemsize)
                rt.copy_rows(scratch[name].handle, t.handle, rows, hv * t.dtype.itemsize,
                             hvp * t.dtype.itemsize, hv * t.dtype.itemsize)
                res[name] = t
            elif name in res:
                res[name] = np.ascontiguousarray(res[name][..., :hv])
        return res

    def _twin(self, rt: Runtime, t: DeviceTensor, width: int) -> DeviceTensor:
        """t with its last axis widened to ``width``, copied again when t was written."""
        key = (id(t), width)
        hit = self._twins.get(key)
        if hit is not None and hit[0] is t and not hit[2].freed:
            self._twins.move_to_end(key)
            if hit[1] == t.version:
                return hit[2]
            twin = hit[2]
        else:
            twin = self._empty((*t.shape[:-1], width), t.dtype.name, t.device_id)
        e = t.dtype.itemsize
        rows = t.nbytes // (t.shape[-1] * e)
        rt.copy_rows(t.handle, twin.handle, rows, t.shape[-1] * e, t.shape[-1] * e, width * e)
        self._twins[key] = (t, t.version, twin)
        self._evict(self._twins)
        return twin

    def _scratch_for(self, out: DeviceTensor, width: int) -> DeviceTensor:
        key = (id(out), width)
        hit = self._scratch.get(key)
        if hit is not None and hit[0] is out and not hit[1].freed:
            self._scratch.move_to_end(key)
            return hit[1]
        tmp = self._empty((*out.shape[:-1], width), out.dtype.name, out.device_id)
        self._scratch[key] = (out, tmp)
        self._evict(self._scratch)
        return tmp

    def _evict(self, table: OrderedDict[Any, Any]) -> None:
        while len(table) > self.MAX_TWINS:
            _, entry = table.popitem(last=False)
            entry[-1].free()

    def clear(self) -> None:
        """Forget every twin (the session frees their memory when it closes)."""
        self._twins.clear()
        self._scratch.clear()
