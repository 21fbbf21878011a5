"""Vulkan set-up so Dawn (inside onnxruntime-webgpu) can use Debian 12's lavapipe: attnreg's
own pass-through ICD (attnreg/vkshim.py, `attnreg vk-shim`), swapped in for lavapipe in the
loader's driver list before the first ORT WebGPU session (Dawn keeps the adapters it found
first for the life of the process)."""

from __future__ import annotations

import glob
import os

from attnreg import vkshim

ORT_PACKAGE = "onnxruntime-webgpu"
ORT_PROVIDER = "WebGpuExecutionProvider"
_HW_NODES = ("/dev/dri/renderD*", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")

# The driver list this module put in force in this process (for reports): None = untouched.
shim_in_use: str | None = None


def shim_path() -> str | None:
    """The shim's ICD manifest ($ATTNREG_VK_SHIM, else the one built for this lavapipe)."""
    return vkshim.manifest()


def _lavapipe_only() -> bool:
    """True when lavapipe is the only Vulkan driver that can find a device here: no
    hardware GPU device node exists and lavapipe's ICD is installed (or is the one named)."""
    if any(glob.glob(p) for p in _HW_NODES):
        return False
    named = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    if named:
        return all(vkshim.is_lavapipe(p) for p in named.split(os.pathsep) if p)
    return vkshim.lavapipe_manifest() is not None


def ensure_vulkan_env() -> str | None:
    """Swap the shim in for lavapipe in the loader's driver list, for good, when lavapipe is
    what Dawn would use here. Leaves the environment alone when a hardware GPU exists or a
    user named only other drivers (the NVIDIA ICD on the GPU machine), when the shim is not
    built, or with ``ATTNREG_VK_SHIM=0``. Returns the driver list it put in force, or None."""
    global shim_in_use
    if shim_in_use is not None:
        return shim_in_use
    if not _lavapipe_only():
        return None
    files = vkshim.driver_files()
    if files is None:
        return None
    for var in vkshim.LOADER_VARS:
        os.environ[var] = files
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Dawn's Vulkan loader wants one
    shim_in_use = files
    return files
