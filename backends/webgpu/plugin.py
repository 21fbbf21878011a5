"""The WebGPU backend plugin: the backend as data and its hookimpls; the work lives in the
sibling modules."""

from __future__ import annotations

from attnreg.hookspecs import BackendInfo, registers

from . import interop, kernels, mma, probe, rules
from .runtime import WebGpuRuntime

INFO = BackendInfo(probe.NAME, 10, probe.probe, lambda caps, flags: WebGpuRuntime(caps))
attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(
    lambda: kernels.declare() + kernels.declare_block_skip() + mma.declare_matrix())
attnreg_register_rules = registers(lambda: rules.RULES)
attnreg_register_interop = registers(lambda: [interop.HOST.interop()])
