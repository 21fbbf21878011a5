"""Matrix-unit kernels on CI devices: the flag matrix_units, the emulated builds of the WGSL
flash prefill on subgroup matrices (webgpu/lavapipe, dawn/lavapipe), and the paths random
inputs rarely take (the lazy max's rescale, a non-finite v). The hardware builds run on the
H100 (ci/results/h100_mma.md); CI has no matrix units (ci/required_matrix.json says so)."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.backends.webgpu import mma as wmma
from attnreg.backends.webgpu import program
from attnreg.tools import testing
from tests.support import require_devices

SPEC = attnreg.AttentionSpec(batch=1, seq_len=40, past_len=30, num_heads=4, kv_num_heads=2,
                             head_size=32, dtype="float16", causal=True, return_lse=True)


def _kernel(plan: attnreg.Plan) -> tuple[str, object]:
    st = plan.stages[0]
    return st.kernel, st.params.get("mma")


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_flag_selects_the_build(backend: str) -> None:
    require_devices(backend)
    mma = f"{backend}.prefill.f16.mma"
    emu = attnreg.Session(backend=backend, flags={"matrix_units": "emulate"}).plan(SPEC)
    assert _kernel(emu) == (mma, "emulate")
    assert "matrix_units_emulate" in emu.explain()
    for mode, needle in (("auto", "matrix_units=auto: no rule measured"),
                         ("off", "matrix_units=off"),
                         ("on", "device lacks feature(s) subgroup-matrix")):
        plan = attnreg.Session(backend=backend, flags={"matrix_units": mode}).plan(SPEC)
        assert plan.stages[0].kernel != mma, mode
        assert needle in "\n".join(plan.rejected[mma]), (mode, plan.rejected[mma])
    # an f32 spec never gets a matrix variant (f16 products would break its tolerance)
    f32 = SPEC.replace(dtype="float32")
    plan = attnreg.Session(backend=backend, flags={"matrix_units": "emulate"}).plan(f32)
    assert plan.stages[0].params.get("mma") is None


def test_bad_flag_and_param() -> None:
    with pytest.raises(attnreg.SpecError, match="matrix_units"):
        attnreg.Session(backend="reference", flags={"matrix_units": "yes"})
    s = attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate"})
    with pytest.raises(attnreg.SpecError, match=r"params\['mma'\]"):
        s.plan(SPEC, params={"mma": "fast"})


def test_dawn_hardware_build_needs_the_experimental_flag() -> None:
    """The hardware build is rejected without experimental_features, forced or not."""
    require_devices("dawn")
    s = attnreg.Session(backend="dawn", flags={"matrix_units": "on"})
    with pytest.raises(attnreg.NoKernelError, match="experimental_features"):
        s.plan(SPEC, kernel="dawn.prefill.f16.mma", params={"mma": "hardware"})


def test_hardware_module_requests_subgroup_matrices() -> None:
    """The hardware build's WGSL enables the extension and takes the subgroup from the
    builtin; the emulated build mentions neither (naga compiles it)."""
    plan = attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate"}).plan(SPEC)
    st = plan.stages[0]
    hw = attnreg.Stage(st.kernel, st.family, {**st.params, "mma": "hardware"})
    hw_src = program.build(hw, SPEC, plan.caps, dialect=program.TINT).wgsl
    emu_src = program.build(st, SPEC, plan.caps).wgsl
    assert hw_src.startswith("enable subgroups;\nenable chromium_experimental_subgroup_matrix;")
    assert "@builtin(subgroup_id)" in hw_src and "subgroupMatrixMultiplyAccumulate" in hw_src
    assert "subgroupMatrix" not in emu_src and "subgroup_id" not in emu_src


def _growing_logits(spec: attnreg.AttentionSpec, seed: int) -> dict[str, np.ndarray]:
    """Keys whose logits grow by far more than the lazy max's TAU (8) from tile to tile, so
    every row's reference max moves and O is rescaled through workgroup memory."""
    t = testing.make_tensors(spec, seed)
    q = np.abs(t["q"].astype(np.float32)) + 0.5
    t["q"] = q.astype(spec.dtype)
    c = t["k"].shape[1]
    ramp = np.linspace(0.0, 6.0, c, dtype=np.float32)[None, :, None, None]
    t["k"] = (np.abs(t["k"].astype(np.float32)) * 0.2 + ramp).astype(spec.dtype)
    return t


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
@pytest.mark.parametrize("case", ["rescale", "nonfinite_v"])
def test_rare_paths_against_reference(backend: str, case: str) -> None:
    require_devices(backend)
    spec = attnreg.AttentionSpec(batch=2, seq_len=35, past_len=60, num_heads=4, kv_num_heads=2,
                                 head_size=48, dtype="float16", causal=True, return_lse=True,
                                 kv_layout="BSNH")
    t = _growing_logits(spec, 5) if case == "rescale" else testing.make_tensors(spec, 6)
    if case == "nonfinite_v":
        t["v"] = t["v"].copy()
        t["v"][0, 50, 1, 7] = np.inf       # seen by the rows at or after position 50 only
        t["v"][1, 70, 0, 3] = np.nan
        t["v"][1, 94, 1, 40] = -np.inf     # the last key: only the last row sees it
    s = attnreg.Session(backend=backend, flags={"matrix_units": "emulate"})
    got, plan = s.run_with_plan(spec, t)
    assert _kernel(plan) == (f"{backend}.prefill.f16.mma", "emulate")
    want = testing.expected(spec, t)
    _, problem = testing.compare(spec, got, want)
    assert not problem, problem
    if case == "rescale":
        # the ramp really moves the max by more than TAU over the keys
        s_max = float(np.max(want[1])) - float(np.min(want[1]))
        assert s_max > 8.0, s_max


def test_fit_keeps_the_hardware_key_tile() -> None:
    """Tiles shrink q_tile first: the hardware build needs kv_tile >= 32."""
    big = attnreg.AttentionSpec(batch=1, seq_len=64, num_heads=2, kv_num_heads=1,
                                head_size=256, dtype="float16")
    k = next(k for k in wmma.declare_matrix())
    assert wmma.fit_tiles(k, big, {}, 49152) == {"q_tile": 16}


def test_export_for_the_subgroup_matrix_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """export-wgsl --backend-caps browser-subgroup-matrix: the matrix prefill's hardware
    build, a module that requests the feature, and a README that says how to get it."""
    from attnreg.backends.browser import export

    spec = attnreg.AttentionSpec(batch=1, seq_len=128, num_heads=8, kv_num_heads=2,
                                 head_size=64, dtype="float16", causal=True)
    res = export.export(spec, str(tmp_path), "browser-subgroup-matrix")
    assert res.plan.kernels == ("browser.prefill.f16.mma",)
    js = (tmp_path / "attention.js").read_text()
    assert '"chromium-experimental-subgroup-matrix"' in js and "SUBGROUP_MIN_SIZE = 32;" in js
    assert "enable chromium_experimental_subgroup_matrix;" in (tmp_path / "0_prefill.wgsl").read_text()
    readme = (tmp_path / "README.md").read_text()
    assert "--enable-unsafe-webgpu" in readme and "allow_unsafe_apis" in readme
    plain = export.export(spec, str(tmp_path / "plain"), "browser-profile")
    assert all(".mma" not in k for k in plain.plan.kernels)
