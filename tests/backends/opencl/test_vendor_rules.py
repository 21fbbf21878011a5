"""OpenCL's vendor settings are rules that explain shows: on NVIDIA's OpenCL the PTX
conversions (param cvt) and the one-launch decode's PTX fence (param fence) are chosen by
named rules; elsewhere, and with "auto" in a geometry no rule chose, the portable OpenCL C is
built. Plans only (caps as data), so no device is needed."""

from __future__ import annotations

import pytest

import attnreg
from attnreg.backends.opencl import mma_probe
from attnreg.backends.opencl import probe as oprobe
from attnreg.backends.opencl import tiles as otiles
from attnreg.spec import AttentionSpec

DECODE = AttentionSpec(seq_len=1, past_len=8191, num_heads=32, kv_num_heads=8, head_size=128,
                       dtype="float16")


def _nvidia() -> attnreg.DeviceCaps:
    """PoCL's stored profile made NVIDIA's OpenCL: what the probe reports there."""
    pocl = attnreg.profile("pocl")
    return pocl.model_copy(update={
        "features": pocl.features | {"subgroups", oprobe.NV_SHUFFLE}, "vendor": "nvidia",
        "device_type": "gpu", "compute_units": 132,
        "limits": {**pocl.limits, "workgroup_storage": 49152}})


def test_nvidia_settings_are_rules_in_explain() -> None:
    nv = _nvidia()
    plan = attnreg.explain(DECODE, caps=nv)
    assert plan.kernels == ("opencl.decode_fused.f16.sg.m1",)
    assert plan.params["cvt"] == "ptx" and plan.params["fence"] == "ptx"
    text = plan.explain()
    assert "opencl_nvidia_ptx_cvt: " in text and "-> cvt=ptx" in text
    assert "opencl_nvidia_ptx_fence: " in text and "-> fence=ptx" in text
    assert "(measured: ci/results/h100_decode_epilogue.txt)" in text
    g = otiles.geometry("decode_fused", "sg", DECODE, plan.params, nv)
    assert g.cvt_ptx and g.nv_fence
    # no rule, no PTX: "auto" is the portable OpenCL C
    bare = otiles.geometry("decode_fused", "sg", DECODE, {}, nv)
    assert not bare.cvt_ptx and not bare.nv_fence


@pytest.mark.parametrize("dtype, cvt", [("float32", False), ("bfloat16", False)])
def test_cvt_only_where_a_scalar_kernel_converts_f16(dtype: str, cvt: bool) -> None:
    plan = attnreg.explain(DECODE.replace(dtype=dtype), caps=_nvidia(),
                           flags={"matrix_units": "off"})
    assert ("cvt" in plan.params) is cvt and plan.params.get("fence") == "ptx"
    assert not any(r.startswith("opencl_nvidia_ptx_cvt") for r in plan.rules)


def test_tensor_core_builds_take_ptx_cvt_in_bf16() -> None:
    nv = _nvidia()
    mma = nv.model_copy(update={"features": nv.features | {mma_probe.FEATURE}})
    plan = attnreg.explain(DECODE.replace(dtype="bfloat16"), caps=mma)
    assert plan.kernel == "opencl.decode_fused.bf16.mma", plan.kernels
    assert plan.params["cvt"] == "ptx" and plan.params["mma"] == "hardware"
    emulated = attnreg.explain(DECODE.replace(dtype="bfloat16"), caps=nv,
                               flags={"matrix_units": "emulate"})
    assert emulated.kernel == "opencl.decode_fused.bf16.mma", emulated.kernels
    assert "cvt" not in emulated.params      # the emulation has no PTX


def test_not_on_other_vendors() -> None:
    plan = attnreg.explain(DECODE, caps=attnreg.profile("pocl"))
    assert "cvt" not in plan.params and "fence" not in plan.params
    assert not any(r.startswith("opencl_nvidia_ptx") for r in plan.rules)
