"""The dawn kernel variants: every backends.webgpu declaration re-homed (same WGSL, params
and support checks; id prefix and backend ``dawn``): the dawn backend runs WebGpuRuntime, so
it binds every family and layout the webgpu backend does."""

from __future__ import annotations

import dataclasses

from attnreg.backends.webgpu import kernels as wkernels
from attnreg.backends.webgpu import mma as wmma
from attnreg.kernel import KernelInfo

from .probe import NAME


def declare() -> list[KernelInfo]:
    host = "in-process Dawn: WGSL compiled by Tint"
    # Dawn's subgroup matrices are experimental: the hardware builds run on the device that
    # flag experimental_features opens (the emulated builds need nothing).
    matrix = [dataclasses.replace(k, flag="experimental_features")
              for k in wkernels.rehomed(NAME, host, wmma.declare_matrix())]
    return wkernels.rehomed(NAME, host, wkernels.declare() + wkernels.declare_block_skip()) + matrix
