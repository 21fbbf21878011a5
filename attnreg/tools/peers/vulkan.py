"""Vulkan set-up so Dawn (inside onnxruntime-webgpu) can use Debian 12's lavapipe."""

from __future__ import annotations

import glob
import os
from pathlib import Path

ORT_PACKAGE = "onnxruntime-webgpu"
ORT_PROVIDER = "WebGpuExecutionProvider"
_REPO = Path(__file__).resolve().parents[2]
_SHIM_JSON = _REPO / ".peers" / "lvp-dawn-shim" / "lvp_shim_icd.json"
_LVP_JSON_NAMES = ("lvp_icd.x86_64.json", "lvp_icd.aarch64.json", "lvp_icd.json")
_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/etc/vulkan/icd.d")
_HW_NODES = ("/dev/dri/renderD*", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")

# What happened to VK_ICD_FILENAMES in this process (for reports): None = untouched.
shim_in_use: str | None = None



# --------------------------------------------------------------------------------------
# Vulkan set-up for Dawn on lavapipe
# --------------------------------------------------------------------------------------
def _is_lavapipe_json(path: str) -> bool:
    return os.path.basename(path) in _LVP_JSON_NAMES or "lvp_icd" in os.path.basename(path)


def shim_path() -> str | None:
    """The built lavapipe shim's ICD json, or None ($ATTNREG_PEERS_SHIM, else .peers/)."""
    env = os.environ.get("ATTNREG_PEERS_SHIM", "")
    if env == "0":
        return None
    if env:
        return env if os.path.isfile(env) else None
    return str(_SHIM_JSON) if _SHIM_JSON.is_file() else None


def _lavapipe_only() -> bool:
    """True when lavapipe is the only Vulkan driver that can find a device here: no
    hardware GPU device node exists and lavapipe's ICD is installed (or is the one named)."""
    if any(glob.glob(p) for p in _HW_NODES):
        return False
    named = os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    if named:
        return all(_is_lavapipe_json(p) for p in named.split(os.pathsep) if p)
    return any(os.path.isfile(os.path.join(d, n)) for d in _ICD_DIRS for n in _LVP_JSON_NAMES)


def ensure_vulkan_env() -> str | None:
    """Point the Vulkan loader at the lavapipe shim when that is what Dawn needs here.

    Called before every ORT WebGPU session. Leaves the environment alone when a user named
    a non-lavapipe driver (e.g. the NVIDIA ICD on the GPU machine), when a hardware GPU node
    exists, when the shim is not built, or when ``ATTNREG_PEERS_SHIM=0``. Returns the ICD
    json now in force because of this module, or None.
    """
    global shim_in_use
    if shim_in_use is not None:
        return shim_in_use
    shim = shim_path()
    if shim is None:
        return None
    forced = bool(os.environ.get("ATTNREG_PEERS_SHIM"))
    if not forced and not _lavapipe_only():
        return None
    os.environ["VK_ICD_FILENAMES"] = shim
    os.environ.pop("VK_DRIVER_FILES", None)           # it would take precedence over ours
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Dawn's Vulkan loader wants one
    shim_in_use = shim
    return shim
