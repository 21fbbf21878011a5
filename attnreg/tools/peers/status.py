"""Whether each peer can run here: a reason string, never an exception."""

from __future__ import annotations

import functools
import os

import numpy as np

from . import vulkan
from .models import ORT_PACKAGE, ORT_PROVIDER, _make_session, _probe_model
from .vulkan import _lavapipe_only, ensure_vulkan_env


# --------------------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    msg = text[-1] if text else type(exc).__name__
    if " was false. " in msg:          # ORT_ENFORCE: "<file:line> <lambda...> <cond> was false. <why>"
        msg = msg.split(" was false. ", 1)[1]
    return msg[-300:]


@functools.lru_cache(maxsize=1)
def ort_webgpu_status() -> str | None:
    """None when ONNX Runtime's WebGPU EP can run here, else the reason (never raises).

    Creates one tiny WebGPU session (CPU fallback disabled) to prove an adapter exists.
    Cached for the process: Dawn itself keeps its first adapter list.
    """
    try:
        import onnxruntime as ort
    except Exception as exc:   # ImportError, or a broken install raising something else
        return f"onnxruntime is not importable ({type(exc).__name__}: {exc}); " \
               f"pip install {ORT_PACKAGE}==1.27.0 onnx (or run ci/bench_peers.sh)"
    try:
        import onnx  # noqa: F401  (builds the model)
    except Exception as exc:
        return f"onnx is not importable ({type(exc).__name__}: {exc}); pip install onnx"
    providers = ort.get_available_providers()
    if ORT_PROVIDER not in providers:
        other = [d for d in ("onnxruntime", "onnxruntime-gpu") if _version(d)]
        return (f"onnxruntime {ort.__version__} has no {ORT_PROVIDER} (providers: {providers}); "
                f"install {ORT_PACKAGE}" + (f" and uninstall {', '.join(other)}" if other else ""))
    ensure_vulkan_env()
    try:
        sess = _make_session(_probe_model(), profile=False)
        x = np.arange(8, dtype=np.float32)
        y = sess.run(None, {"x": x})[0]
        if not np.array_equal(y, x + x):
            return f"{ORT_PROVIDER} computed a wrong probe result {y!r}"
    except Exception as exc:
        cause = _root_cause(exc)
        hint = ""
        if "adapter" in cause.lower() and vulkan.shim_in_use is None and _lavapipe_only():
            hint = (" (Dawn refuses Mesa 22.3 lavapipe: run `attnreg vk-shim` to build the shim"
                    + (", and unset ATTNREG_VK_SHIM=0" if os.environ.get("ATTNREG_VK_SHIM") == "0"
                       else "") + ")")
        return f"{ORT_PROVIDER} unusable: {cause}{hint}"
    return None


@functools.lru_cache(maxsize=1)
def torch_status() -> str | None:
    """None when torch (with scaled_dot_product_attention) is importable, else the reason."""
    try:
        import torch
    except Exception as exc:
        return f"torch is not importable ({type(exc).__name__}: {exc}); it is optional " \
               f"(pip install torch)"
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return f"torch {torch.__version__} has no scaled_dot_product_attention (needs >= 2.0)"
    return None


def statuses() -> dict[str, str | None]:
    """{peer name: None if usable else the reason}."""
    return {"onnxruntime-webgpu": ort_webgpu_status(), "torch-sdpa": torch_status()}
