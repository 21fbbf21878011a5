"""Reference backend plugin: runs attnreg.reference on the host CPU in float64."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any

import numpy as np

import attnreg
from attnreg import reference as ref
from attnreg.caps import DeviceCaps
from attnreg.hookspecs import BackendInfo, registers
from attnreg.hostmem import HostMemory, wall_timings
from attnreg.plan import Plan

NAME = "reference"
_DTYPES = frozenset({"float32", "float16", "bfloat16"})
KV_DTYPES = frozenset({"int8", "int4"})          # dequantized on the host, then the same math
# reference.kv_canonical gathers a paged pool through the block table, so every KV layout
# of the contract runs here, paged included.
_KV_LAYOUTS = frozenset({"BSNH", "BNSH", "paged"})
# every contract feature, the shapes real models need included
_ALL = attnreg.kernel.ALL_FEATURES


class ReferenceRuntime(HostMemory):
    """The runtime contract on the host: float64 numpy, DeviceTensors in host memory."""

    def __init__(self, caps: DeviceCaps) -> None:
        super().__init__()
        self.caps = caps

    def launch(self, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.counters["launches"] += 1
        return self.place_outputs(self._compute(plan, self.host_inputs(inputs)), outputs)

    def _compute(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
        spec = plan.spec
        if plan.op == "reduce":
            out, lse = ref.reduce(spec, inputs["o_parts"], inputs["lse_parts"],
                                  inputs.get("head_sink"), inputs.get("seqlens_q"))
        elif plan.op == "partial" or plan.route == "split_kv":
            assert plan.split is not None and plan.split.split_size is not None
            o_parts, lse_parts = ref.partial_states(spec, inputs, plan.split.split_size)
            if plan.op == "partial":
                return {"o_parts": o_parts.astype(np.float32), "lse_parts": lse_parts.astype(np.float32)}
            out, lse = ref.reduce(spec, o_parts, lse_parts, inputs.get("head_sink"),
                                  inputs.get("seqlens_q"))
        else:
            out, lse = ref.attention(spec, inputs)
        res = {"out": np.ascontiguousarray(ref.out_layout(spec, out).astype(spec.dtype))}
        if spec.return_lse:
            res["lse"] = lse.astype(np.float32)
        return res

    def matrix_peak(self) -> tuple[float | None, str]:
        return None, "the numpy reference has no matrix units"

    def timings(self, plan: Plan, inputs: Mapping[str, Any], *, iters: int = 20,
                warmup: int = 3) -> dict[str, list[float]]:
        return wall_timings(lambda: self.launch(plan, inputs), iters, warmup)

    def close(self) -> None:
        pass


def _probe() -> list[DeviceCaps]:
    return [DeviceCaps(backend=NAME, id="reference:0", name="numpy float64 reference",
                       vendor="numpy", description=f"numpy {np.__version__} on "
                       f"{platform.machine()}", driver=np.__version__, backend_type="numpy",
                       device_type="cpu", compute_units=os.cpu_count())]


def _kernels() -> list[attnreg.KernelInfo]:
    doc = "float64 numpy, vectorised over batch and heads"
    return [
        attnreg.KernelInfo(id="reference.prefill", backend=NAME, family="prefill",
                           dtypes=_DTYPES, kv_layouts=_KV_LAYOUTS, kv_dtypes=KV_DTYPES,
                           supports=_ALL, priority=-100, doc=doc),
        attnreg.KernelInfo(id="reference.decode_partial", backend=NAME,
                           family="decode_partial", dtypes=_DTYPES, kv_layouts=_KV_LAYOUTS,
                           kv_dtypes=KV_DTYPES, supports=_ALL,
                           priority=-100, defaults={"kv_tile": 64, "m_tile": 1}, doc=doc),
        attnreg.KernelInfo(id="reference.reduce", backend=NAME, family="reduce",
                           dtypes=_DTYPES, kv_layouts=_KV_LAYOUTS, supports=_ALL, priority=-100,
                           doc=doc)]


# priority -100: only when nothing else fits, or when asked for by name
INFO = BackendInfo(NAME, -100, _probe, lambda caps, flags: ReferenceRuntime(caps))
attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(_kernels)
