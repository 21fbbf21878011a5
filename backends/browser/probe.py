"""The browser's WebGPU adapter -> DeviceCaps, from navigator.gpu in a briefly started
headless Chromium. Cached per process; never raises (failures become an unavailable entry
with the reason)."""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from attnreg import env
from attnreg.caps import DeviceCaps, normalize_vendor, unavailable
from attnreg.errors import SpecError

from . import chromium

NAME = "browser"
DISABLE_ENV = "ATTNREG_BROWSER"        # "0"/"off"/"no": report the backend unavailable
PROBE_TIMEOUT_S = 45.0

# navigator.gpu feature names -> the normalized names kernels declare (as backends.webgpu).
FEATURES = {"shader-f16": "shader-f16", "subgroups": "subgroups",
            "timestamp-query": "timestamp-query"}
LIMITS = {
    "workgroup_storage": "maxComputeWorkgroupStorageSize",
    "invocations": "maxComputeInvocationsPerWorkgroup",
    "workgroup_size_x": "maxComputeWorkgroupSizeX",
    "storage_binding": "maxStorageBufferBindingSize",
    "buffer_size": "maxBufferSize",
    "workgroups_per_dim": "maxComputeWorkgroupsPerDimension",
    "storage_buffers": "maxStorageBuffersPerShaderStage",
}
_CPU_ARCHS = ("swiftshader", "llvmpipe", "lavapipe", "warp")

_CACHE: list[DeviceCaps] | None = None
_LOCK = threading.Lock()


def _browser_version(user_agent: str) -> str:
    m = re.search(r"(?:HeadlessChrome|Chrome|Chromium)/([\d.]+)", user_agent)
    # Chromium reduces its user agent to MAJOR.0.0.0: keep the major version only.
    return m.group(1).split(".")[0] if m else ""


def caps_of(hello: dict[str, Any], index: int = 0) -> DeviceCaps:
    """DeviceCaps from the page's report (adapter.info, features, limits, user agent)."""
    info: dict[str, Any] = hello.get("info", {})
    arch = str(info.get("architecture", ""))
    vendor_raw = str(info.get("vendor", ""))
    core = str(info.get("description") or info.get("device") or "")
    if arch.lower() == "swiftshader" and "swiftshader" not in core.lower():
        core = f"SwiftShader {core}".strip()         # so DeviceCaps.slug says 'swiftshader'
    core = core or " ".join(x for x in (vendor_raw, arch) if x) or "WebGPU adapter"
    version = _browser_version(str(hello.get("userAgent", "")))
    browser = f"Chromium {version}".strip()
    raw_limits = hello.get("limits", {})
    limits = {ours: int(raw_limits[theirs]) for ours, theirs in LIMITS.items()
              if isinstance(raw_limits.get(theirs), (int, float))}
    have = set(hello.get("deviceFeatures") or hello.get("features", []))
    feats = frozenset(ours for theirs, ours in FEATURES.items() if theirs in have)
    lo = int(info.get("subgroupMinSize") or 0)
    hi = int(info.get("subgroupMaxSize") or 0)
    if "subgroups" in feats and lo == 0:
        lo = 4                                        # the smallest size WebGPU allows
    cpu = bool(info.get("isFallbackAdapter")) or arch.lower() in _CPU_ARCHS
    return DeviceCaps(
        backend=NAME, id=f"{NAME}:{index}", name=f"{core} ({browser})",
        vendor=normalize_vendor(vendor_raw, core, arch), architecture=arch,
        description=str(info.get("description", "")), driver=browser,
        backend_type="Dawn", device_type="cpu" if cpu else "gpu",
        features=feats, limits=limits, subgroup_min_size=lo, subgroup_max_size=hi,
        compute_units=os.cpu_count() if cpu else None,
        extra={"user_agent": hello.get("userAgent", ""), "adapter_info": info,
               "adapter_features": sorted(hello.get("features", [])),
               "adapter_limits": raw_limits})


def disabled() -> str | None:
    """Why the backend is off ($ATTNREG_BROWSER=0), or None."""
    return f"disabled by {DISABLE_ENV}={env.text(DISABLE_ENV)}" \
        if env.switch(DISABLE_ENV) is False else None


def probe(refresh: bool = False) -> list[DeviceCaps]:
    """The browser's adapter (starting Chromium once per process); never raises."""
    global _CACHE
    with _LOCK:
        if _CACHE is None or refresh:
            _CACHE = _probe()
        return list(_CACHE)


def _probe() -> list[DeviceCaps]:
    try:
        why = disabled()
        binary = chromium.find()
    except SpecError as exc:                 # a malformed variable: its message is the reason
        return [unavailable(NAME, str(exc))]
    if why:
        return [unavailable(NAME, why)]
    if binary is None:
        given = env.text(chromium.BINARY_ENV)
        if given:
            return [unavailable(NAME, f"{chromium.BINARY_ENV}={given} is not an executable file")]
        return [unavailable(NAME, "Chromium is not installed: `apt-get install chromium` "
                            f"(ci/setup.sh does), or set {chromium.BINARY_ENV} to a Chrome/Chromium "
                            "binary")]
    from .host import BrowserHost
    try:
        with BrowserHost("probe", start_timeout=PROBE_TIMEOUT_S) as host:
            hello = host.hello
    except Exception as exc:
        return [unavailable(NAME, f"headless Chromium gave no WebGPU report: {exc}")]
    if hello.get("error"):
        return [unavailable(NAME, f"WebGPU in headless Chromium: {hello['error']}")]
    try:
        return [caps_of(hello)]
    except Exception as exc:
        return [unavailable(NAME, f"the browser adapter could not be described: {exc!r}")]
