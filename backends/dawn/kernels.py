"""The dawn kernel variants: every backends.webgpu declaration re-homed (same WGSL, params
and support checks; id prefix and backend ``dawn``): the dawn backend runs WebGpuRuntime, so
it binds every family and layout the webgpu backend does."""

from __future__ import annotations

from attnreg.backends.webgpu import kernels as wkernels
from attnreg.kernel import KernelInfo

from .probe import NAME


def declare() -> list[KernelInfo]:
    return wkernels.rehomed(NAME, "in-process Dawn: WGSL compiled by Tint",
                            wkernels.declare() + wkernels.declare_block_skip())
