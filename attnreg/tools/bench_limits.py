"""Each bench case's physical limit: the larger of its bytes over the device's measured copy
roof and its FLOPs over the device's peak (decodes land on the first, prefills on the
second), and the fraction of it a kernel time reaches.

The peak: for WGSL kernels on subgroup matrices, the subgroup-matrix GEMM probe's best rate
measured on the same device (Runtime.matrix_peak; backends/dawn/gemm_probe.py); otherwise
the vendor's datasheet figure, where this table knows the device: the tensor-core rate
(dense f16 x f16 -> f32) for the OpenCL PTX-mma kernels and for torch (cuDNN, flash and
efficient SDPA run on tensor cores), the vector rate (f16 packed, or f32) for the scalar
kernels. A device the table does not know (CPUs, other GPUs) has no peak: its cases are
measured against the copy roof alone, and the bench says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import AttentionSpec
from .bench_suites import traffic


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str          # what the figure is, e.g. "matrix: GEMM probe" / "tensor: datasheet"

    def text(self) -> str:
        return f"{self.source} {self.tflops:.1f} TFLOP/s"


# name fragment -> (tensor f16->f32 dense, vector f16, vector f32) TFLOP/s, first match wins:
# NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture whitepaper (H100 SXM5:
# 989.4 / 133.8 / 66.9; PCIe: 756.5 / 102.4 / 51.2); the H200 has the H100 SXM5's SMs and
# clocks. "NVIDIA H100 80GB HBM3" (the GPU machine's card, OpenCL's and Vulkan's name) is SXM5.
DATASHEET: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H100 PCIe", (756.5, 102.4, 51.2)),
    ("H100", (989.4, 133.8, 66.9)),
    ("H200", (989.4, 133.8, 66.9)),
)
SOURCE = "NVIDIA datasheet"


def datasheet(device_name: str) -> tuple[float, float, float] | None:
    return next((v for frag, v in DATASHEET if frag in device_name), None)


def peak(device_name: str, dtype: str, matrix: str | None, probe: float | None) -> Peak | None:
    """The peak a kernel is measured against: ``matrix`` is the API of its matrix units
    ("subgroup_matrix", "ptx_mma", "tensor" for torch) or None for scalar kernels;
    ``probe`` the device's GEMM-probe rate (TFLOP/s) where one was measured."""
    if matrix == "subgroup_matrix":
        return Peak(probe, "matrix: GEMM probe") if probe else None
    sheet = datasheet(device_name)
    if sheet is None:
        return None
    if matrix is not None:
        return Peak(sheet[0], f"tensor: {SOURCE}")
    if dtype == "float32":
        return Peak(sheet[2], f"vector f32: {SOURCE}")
    return Peak(sheet[1], f"vector f16: {SOURCE}")


def fraction(spec: AttentionSpec, seconds: float, roof_gbs: float | None,
             pk: Peak | None) -> tuple[float, str] | None:
    """(limit time / ``seconds``, what bounds it) for one call of ``spec``, or None where
    neither a roof nor a peak is known."""
    nbytes, flops = traffic(spec)
    bounds = []
    if roof_gbs:
        bounds.append((nbytes / (roof_gbs * 1e9), f"copy {roof_gbs:.0f} GB/s"))
    if pk is not None:
        bounds.append((flops / (pk.tflops * 1e12), pk.text()))
    if not bounds or not seconds > 0:
        return None
    t, what = max(bounds)
    return t / seconds, what
