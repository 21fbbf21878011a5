"""A third-party-style plugin used by the registry tests: a 'toy' backend whose GPU-like
device has a feature called 'magic'. Its kernels compute with the reference (the point is
the registry, not the math); one kernel always fails at launch, like a driver compile error."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attnreg
from attnreg.backends.reference.plugin import ReferenceRuntime
from attnreg.caps import DeviceCaps

NAME = "toy"
F32 = frozenset({"float32"})


class ToyRuntime(ReferenceRuntime):
    def __init__(self, caps: DeviceCaps, backend: ToyBackend) -> None:
        super().__init__(caps)
        self.backend = backend

    def launch(self, plan: attnreg.Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.backend.launched.append(plan.kernels)
        if "toy.prefill.f32.broken" in plan.kernels:
            raise attnreg.KernelUnavailable("toy.prefill.f32.broken",
                                            "toy compiler: error at 1:1: unknown token")
        if "toy.prefill.f32.nvidia_skip16" in plan.kernels:
            # Emulates a vendor path that drops keys 16-31 (the bug class conformance exists
            # to catch): their values never reach the output.
            inputs = self.host_inputs(inputs)
            v = inputs["v"].copy()
            if plan.spec.kv_layout == "BSNH":
                v[:, 16:32] = 0
            else:
                v[:, :, 16:32] = 0
            inputs["v"] = v
        return super().launch(plan, inputs, outputs)


class ToyBackend:
    name = NAME
    priority = 50

    def __init__(self) -> None:
        self.opened = 0
        self.probed = 0
        self.launched: list[tuple[str, ...]] = []

    def probe(self) -> list[DeviceCaps]:
        self.probed += 1
        return [DeviceCaps(backend=NAME, id="toy:0", name="Toy GPU 9000", vendor="toyco",
                           device_type="gpu", features=frozenset({"magic", "subgroups"}),
                           limits={"workgroup_storage": 16384}, compute_units=4)]

    def open(self, caps: DeviceCaps, flags: Mapping[str, Any]) -> ToyRuntime:
        self.opened += 1
        return ToyRuntime(caps, self)


class ToyPlugin:
    def __init__(self) -> None:
        self.backend = ToyBackend()

    @attnreg.hookimpl
    def attnreg_register_backends(self, register: Callable[[attnreg.Backend], None]) -> None:
        register(self.backend)

    @attnreg.hookimpl
    def attnreg_register_kernels(self, register: Callable[[attnreg.KernelInfo], None]) -> None:
        register(attnreg.KernelInfo(
            id="toy.prefill.f32.broken", backend=NAME, family="prefill", dtypes=F32,
            head_sizes=(8, 64, 8), priority=10, doc="always fails to compile"))
        register(attnreg.KernelInfo(
            id="toy.prefill.f32", backend=NAME, family="prefill", dtypes=F32,
            head_sizes=(8, 64, 8), features=frozenset({"magic"}),
            supports=attnreg.kernel.ALL_FEATURES - {"softcap"},
            workgroup_storage=lambda spec, p: spec.head_size * 256))
        register(attnreg.KernelInfo(
            id="toy.prefill.f32.needs_unobtainium", backend=NAME, family="prefill", dtypes=F32,
            features=frozenset({"unobtainium"})))
        register(attnreg.KernelInfo(
            id="toy.prefill.f32.toyco_tuned", backend=NAME, family="prefill", dtypes=F32,
            vendor="otherco", priority=20))
        register(attnreg.KernelInfo(
            id="toy.decode_partial.f32.m4", backend=NAME, family="decode_partial", dtypes=F32,
            head_sizes=(8, 64, 8), params={"m_tile": 4}, defaults={"kv_tile": 16}))
        register(attnreg.KernelInfo(
            id="toy.decode_partial.f32.m1", backend=NAME, family="decode_partial", dtypes=F32,
            head_sizes=(8, 64, 8), params={"m_tile": 1}, defaults={"kv_tile": 16}))
        register(attnreg.KernelInfo(
            id="toy.prefill.f32.nvidia_skip16", backend=NAME, family="prefill", dtypes=F32,
            head_sizes=(8, 64, 8), vendor="nvidia", priority=30))
        register(attnreg.KernelInfo(id="toy.reduce.f32", backend=NAME, family="reduce", dtypes=F32))
