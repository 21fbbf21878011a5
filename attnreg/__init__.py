"""attnreg: a registry of attention kernels for WebGPU and OpenCL, with explained dispatch.

>>> import attnreg
>>> spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=63, num_heads=4,
...                              kv_num_heads=2, head_size=16)
>>> plan = attnreg.explain(spec, backend="reference")
>>> plan.backend
'reference'
"""

from __future__ import annotations

from . import _checkout  # noqa: F401  (a plain checkout: map attnreg.backends & co.)
from .api import (
    default_session,
    devices,
    explain,
    kernels,
    merge_states,
    partial_states,
    reduce_states,
    register_plugin,
    run,
    unregister_plugin,
)
from .caps import DeviceCaps
from .device_tensor import DeviceTensor
from .errors import CacheWarning, ClosedError, KernelUnavailable, NoKernelError, SpecError
from .flags import Flag
from .hookspecs import Backend, Command, Runtime, hookimpl
from .kernel import KernelInfo, MatrixUnit
from .kv_cache import KVCache
from .plan import Plan, Stage
from .profiles import profile, profiles
from .quant import dequantize_kv, quantize_kv
from .rules import Rule
from .session import Session
from .spec import AttentionSpec

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "Backend",
    "CacheWarning",
    "ClosedError",
    "Command",
    "DeviceCaps",
    "DeviceTensor",
    "Flag",
    "KVCache",
    "KernelInfo",
    "KernelUnavailable",
    "MatrixUnit",
    "NoKernelError",
    "Plan",
    "Rule",
    "Runtime",
    "Session",
    "SpecError",
    "Stage",
    "default_session",
    "dequantize_kv",
    "devices",
    "explain",
    "hookimpl",
    "kernels",
    "merge_states",
    "partial_states",
    "profile",
    "profiles",
    "quantize_kv",
    "reduce_states",
    "register_plugin",
    "run",
    "unregister_plugin",
]
