"""DeviceCaps: what a probed device can do, in one vocabulary for every backend."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Limit names every backend fills in where it knows them (bytes or counts).
LIMIT_DOCS: dict[str, str] = {
    "workgroup_storage": "bytes of workgroup (local) memory per workgroup",
    "invocations": "invocations (work-items) per workgroup",
    "workgroup_size_x": "largest workgroup size in x",
    "storage_binding": "bytes one storage binding (one kernel argument buffer) may span",
    "buffer_size": "bytes of the largest buffer",
    "workgroups_per_dim": "workgroups per dispatch dimension",
}

_VENDORS = (
    ("nvidia", ("nvidia", "0x10de", "4318")),
    ("apple", ("apple", "metal")),
    ("intel", ("intel", "0x8086", "32902")),
    ("qualcomm", ("qualcomm", "adreno", "0x5143", "20803")),
    ("amd", ("amd", "advanced micro devices", "radeon", "0x1002", "4098")),
    ("arm", ("arm", "mali")),
    ("mesa", ("llvmpipe", "lavapipe", "mesa")),
    ("pocl", ("pocl", "portable computing language")),
)


def normalize_vendor(*hints: Any) -> str:
    """Map whatever a driver reports (names, PCI ids) to one lower-case vendor word."""
    text = " ".join(str(h).lower() for h in hints if h not in (None, ""))
    for vendor, keys in _VENDORS:
        if any(k in text for k in keys):
            return vendor
    return "unknown"


class DeviceCaps(BaseModel):
    """A probed (or profiled) device. Routing reads only this, never the live device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str
    id: str = Field(description="stable key within the process, e.g. 'webgpu:0'")
    name: str
    vendor: str = "unknown"
    architecture: str = ""
    description: str = ""
    driver: str = ""
    backend_type: str = ""
    device_type: Literal["gpu", "cpu", "other"] = "other"
    features: frozenset[str] = frozenset()
    limits: dict[str, int] = Field(default_factory=dict)
    subgroup_min_size: int = 0
    subgroup_max_size: int = 0
    compute_units: int | None = None
    available: bool = True
    reason: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    settings: tuple[str, ...] = Field(
        default=(), description="how the backend set this device up (Dawn toggles, a Vulkan "
        "driver shim), one line each with why; shown by `attnreg devices` and explain")

    def __hash__(self) -> int:
        return hash((self.backend, self.id, self.name, self.driver))

    def has(self, feature: str) -> bool:
        return feature in self.features

    def limit(self, name: str) -> int | None:
        return self.limits.get(name)

    @property
    def label(self) -> str:
        """Short human name: 'llvmpipe (LLVM 15.0.6, 256 bits) [cpu, Vulkan]'."""
        kind = ", ".join(x for x in (self.device_type, self.backend_type) if x)
        return f"{self.name} [{kind}]" if kind else self.name

    @property
    def slug(self) -> str:
        """A short token for test ids: 'llvmpipe', 'pocl', 'h100'."""
        low = self.name.lower()
        for key in ("llvmpipe", "swiftshader", "pocl", "pthread", "h100", "h200"):
            if key in low:
                return "pocl" if key == "pthread" else key
        word = "".join(c if c.isalnum() else "-" for c in low).strip("-")
        return word.split("-")[0] or self.backend


def unavailable(backend: str, reason: str) -> DeviceCaps:
    """The placeholder a backend reports when its probe fails, so listing never crashes."""
    return DeviceCaps(backend=backend, id=f"{backend}:unavailable", name=f"{backend} (unavailable)",
                      available=False, reason=reason)
