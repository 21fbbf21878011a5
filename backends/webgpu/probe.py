"""Adapter -> DeviceCaps. Probing never raises: a failure becomes an unavailable entry."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from attnreg.caps import DeviceCaps, normalize_vendor, unavailable

NAME = "webgpu"

# WebGPU feature names -> the normalized names kernels declare and rules check.
FEATURES = {"shader-f16": "shader-f16", "subgroup": "subgroups",
            "timestamp-query": "timestamp-query"}
# Features a kernel may need; requested on the device whenever the adapter has them.
# timestamp-query-inside-encoders (native) times a plain buffer copy (copy_bandwidth).
REQUEST = ("shader-f16", "subgroup", "timestamp-query", "timestamp-query-inside-encoders")

LIMITS = {
    "workgroup_storage": "max-compute-workgroup-storage-size",
    "invocations": "max-compute-invocations-per-workgroup",
    "workgroup_size_x": "max-compute-workgroup-size-x",
    "storage_binding": "max-storage-buffer-binding-size",
    "buffer_size": "max-buffer-size",
    "workgroups_per_dim": "max-compute-workgroups-per-dimension",
    "storage_buffers": "max-storage-buffers-per-shader-stage",
}
# OpenGL adapters duplicate the Vulkan ones on Linux and lack what the kernels need.
_SKIP_BACKENDS = ("opengl", "gl")
# SM counts of GPUs whose adapter name is all we know (WebGPU reports no unit count).
_UNITS_BY_NAME = {"h100": 132, "h200": 132}


def ensure_env() -> None:
    """wgpu-native on Linux wants XDG_RUNTIME_DIR; an unset one only costs a warning, but
    set it before wgpu loads so that headless CI logs stay clean."""
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")


_ADAPTERS: list[Any] | None = None


def adapters(refresh: bool = False) -> list[Any]:
    """Compute-capable adapters, in the order wgpu enumerates them (their index is the id).
    Cached, so that an id from a probe names the same adapter when a device is opened."""
    global _ADAPTERS
    if _ADAPTERS is not None and not refresh:
        return _ADAPTERS
    ensure_env()
    import wgpu

    found = []
    for a in wgpu.gpu.enumerate_adapters_sync():
        backend = str(a.info.get("backend_type", "")).lower()
        if backend in _SKIP_BACKENDS:
            continue
        found.append(a)
    _ADAPTERS = found
    return found


def _subgroup_sizes(info: Any) -> tuple[int, int]:
    """(min, max) subgroup size. wgpu-py 0.32 reports them under odd keys
    ('stackgroup_min_size'); take any key that ends in min_size / max_size."""
    lo = hi = 0
    for key in list(info.keys()):
        low = str(key).lower()
        try:
            val = int(info[key])
        except (TypeError, ValueError):
            continue
        if low.endswith("min_size") or low.endswith("min-size"):
            lo = val
        elif low.endswith("max_size") or low.endswith("max-size"):
            hi = val
    return lo, hi


def _device_type(adapter_type: str) -> str:
    low = adapter_type.lower()
    if "cpu" in low:
        return "cpu"
    if "gpu" in low:
        return "gpu"
    return "other"


def _compute_units(name: str, device_type: str) -> int | None:
    low = name.lower()
    if "llvmpipe" in low or "lavapipe" in low or "swiftshader" in low:
        return os.cpu_count()
    for key, units in _UNITS_BY_NAME.items():
        if key in low:
            return units
    return None


def caps_of(index: int, adapter: Any, backend: str = NAME,
            features: dict[str, str] | None = None) -> DeviceCaps:
    """One adapter's capabilities in attnreg's vocabulary. Hosts of the same WGSL with the
    wgpu-py API (dawn) pass their backend name and their own feature-name table."""
    info = adapter.info
    name = str(info.get("device") or info.get("description") or f"adapter {index}")
    dtype = _device_type(str(info.get("adapter_type", "")))
    limits_raw = adapter.limits
    limits = {ours: int(limits_raw[theirs]) for ours, theirs in LIMITS.items()
              if theirs in limits_raw and limits_raw[theirs] is not None}
    feats = frozenset(ours for theirs, ours in (features or FEATURES).items()
                      if theirs in adapter.features)
    lo, hi = _subgroup_sizes(info)
    if "subgroups" in feats and lo == 0:
        lo = 4        # the smallest subgroup size WebGPU allows
    return DeviceCaps(
        backend=backend, id=f"{backend}:{index}", name=name,
        vendor=normalize_vendor(info.get("vendor"), info.get("vendor_id"), name,
                                info.get("description")),
        architecture=str(info.get("architecture", "")),
        description=str(info.get("description", "")),
        driver=str(info.get("description", "")),
        backend_type=str(info.get("backend_type", "")),
        device_type=dtype,  # type: ignore[arg-type]
        features=feats, limits=limits, subgroup_min_size=lo, subgroup_max_size=hi,
        compute_units=_compute_units(name, dtype),
        extra={"adapter_type": str(info.get("adapter_type", "")),
               "vendor_id": info.get("vendor_id"), "device_id": info.get("device_id"),
               "adapter_features": sorted(str(f) for f in adapter.features)},
    )


def probe() -> list[DeviceCaps]:
    """Every usable adapter; never raises."""
    try:
        found = adapters()
    except Exception as exc:
        return [unavailable(NAME, f"wgpu could not enumerate adapters: {exc!r}")]
    return describe(NAME, found, caps_of, "wgpu found no Vulkan/Metal/D3D12 adapter")


def describe(backend: str, found: list[Any], caps_of: Callable[[int, Any], DeviceCaps],
             none_reason: str) -> list[DeviceCaps]:
    """Each adapter's caps (one that cannot be described becomes an unavailable entry with
    its id), or one unavailable entry saying why there is none. For every wgpu-py-API host."""
    out = []
    for i, a in enumerate(found):
        try:
            out.append(caps_of(i, a))
        except Exception as exc:
            out.append(unavailable(backend, f"adapter {i} could not be described: {exc!r}")
                       .model_copy(update={"id": f"{backend}:{i}"}))
    return out or [unavailable(backend, none_reason)]
