"""The browser's kernel variants: backends.webgpu's declarations, re-homed, plus host-cast
fallbacks for float16 on adapters without shader-f16.

Re-homed: same variants, parameters and support checks (so an f16 variant on an adapter
without shader-f16 is rejected with "device lacks feature(s) shader-f16"); only the id prefix
and the backend change: ``webgpu.prefill.f32.sg`` becomes ``browser.prefill.f32.sg``. Only
the families and layouts this backend's runtime binds are re-homed (prefill,
decode_partial, reduce; BSNH/BNSH KV).

Host-cast (``browser.prefill.f16.cast32.sg`` ...): each f32 variant also serves float16
tensors by widening them to float32 on the host (exact) and rounding the output back to
float16, for browsers whose adapter lacks shader-f16 (SwiftShader, many others). They rank
below the native f16 variants, which win wherever shader-f16 exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from attnreg.backends.webgpu import kernels as wkernels
from attnreg.backends.webgpu import mma as wmma
from attnreg.caps import DeviceCaps
from attnreg.kernel import KernelInfo, binding_bytes
from attnreg.spec import AttentionSpec

from .probe import NAME

FAMILIES = ("prefill", "decode_partial", "reduce")      # what runtime.py binds
KV_LAYOUTS = frozenset({"BSNH", "BNSH"})
CAST = "cast32"
COMPUTE_DTYPE = "compute_dtype"     # the param naming a host-cast variant's device dtype
_CAST_PRIORITY = -50

Storage = Callable[[AttentionSpec, Mapping[str, Any]], int]
Checks = Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]]


def browser_id(webgpu_id: str) -> str:
    """``webgpu.decode_partial.f32.m4`` -> ``browser.decode_partial.f32.m4``."""
    return wkernels.rehome_id(NAME, webgpu_id)


def device_spec(spec: AttentionSpec, params: Mapping[str, Any]) -> AttentionSpec:
    """The spec the device computes: float32 for a host-cast variant, else ``spec``."""
    want = params.get(COMPUTE_DTYPE)
    return spec if not want or want == spec.dtype else spec.replace(dtype=want)


def _widened_storage(fn: Storage | None) -> Storage | None:
    if fn is None:
        return None
    return lambda spec, p: fn(device_spec(spec, p), p)


def _widened_checks(family: str, fn: Checks | None) -> Checks:
    def check(spec: AttentionSpec, caps: DeviceCaps, p: Mapping[str, Any]) -> list[str]:
        wide = device_spec(spec, p)
        why = fn(wide, caps, p) if fn is not None else []
        cap = caps.limit("storage_binding")   # the registry checked the f16 sizes only
        if cap is not None:
            why += [f"tensor {n} widened to float32 needs {size} B in one storage binding, "
                    f"device limit storage_binding is {cap} B"
                    for n, size in binding_bytes(family, wide, p).items() if size > cap]
        return why
    return check


def cast_variant(k: KernelInfo) -> KernelInfo:
    """The float16-via-float32 variant of a browser f32 kernel."""
    parts = k.id.split(".")
    parts[2:3] = ["f16", CAST]
    return dataclasses.replace(
        k, id=".".join(parts), dtypes=frozenset({"float16"}),
        params={**k.params, COMPUTE_DTYPE: "float32"}, priority=k.priority + _CAST_PRIORITY,
        workgroup_storage=_widened_storage(k.workgroup_storage),
        extra_checks=_widened_checks(k.family, k.extra_checks),
        doc=f"{k.doc}; float16 tensors widened to float32 on the host, the output rounded "
            "back (for adapters without shader-f16)")


def declare() -> list[KernelInfo]:
    """The re-homed WebGPU variants, then the host-cast ones."""
    host = "in Chromium: WGSL compiled by Tint, run by Dawn"
    native = wkernels.rehomed(NAME, host, wkernels.declare(), FAMILIES, KV_LAYOUTS)
    # The matrix variants run where the browser exposes subgroup matrices (an exported
    # module for the browser-subgroup-matrix profile); no host-cast twins (f16 products).
    matrix = wkernels.rehomed(NAME, host, wmma.declare_matrix(), FAMILIES, KV_LAYOUTS)
    return native + [cast_variant(k) for k in native if k.dtypes == frozenset({"float32"})] \
        + matrix
