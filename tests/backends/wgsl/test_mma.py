"""Matrix-unit kernels on CI devices: the flag matrix_units, the emulated builds of the WGSL
flash prefill and split-KV decode on subgroup matrices (webgpu/lavapipe, dawn/lavapipe), and
the paths random inputs rarely take (the lazy max's rescale, a non-finite v). The hardware
builds run on the H100 (ci/results/h100_conformance_mma_dawn.md, h100_mma_wgsl.txt); CI has
no matrix units (ci/required_matrix.json says so)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import attnreg
from attnreg import registry, testing
from attnreg.backends.webgpu import mma as wmma
from attnreg.backends.webgpu import program
from attnreg.caps import DeviceCaps
from tests.support import require_devices

SPEC = attnreg.AttentionSpec(batch=1, seq_len=40, past_len=30, num_heads=4, kv_num_heads=2,
                             head_size=32, dtype="float16", causal=True, return_lse=True)


def _kernel(plan: attnreg.Plan) -> tuple[str, object]:
    st = plan.stages[0]
    return st.kernel, st.params.get("mma")


# the split-KV decode partials on subgroup matrices (shaders/decode_mma.wgsl)
DECODE = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=150, num_heads=8, kv_num_heads=2,
                               head_size=32, dtype="float16", causal=True, return_lse=True)
FAMILIES = {"prefill": SPEC, "decode_partial": DECODE}


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_flag_selects_the_build(backend: str, family: str) -> None:
    require_devices(backend)
    # the prefill's direct form where it applies (plain f16 K/V, heads up to 128)
    spec = FAMILIES[family]
    mma = f"{backend}.{family}.f16.mma" + ("_direct" if family == "prefill" else "")
    emu = attnreg.Session(backend=backend, flags={"matrix_units": "emulate"}).plan(spec)
    assert _kernel(emu) == (mma, "emulate")
    assert "matrix_units_emulate" in emu.explain()
    for mode, needle in (("auto", "matrix_units=auto: no rule measured"),
                         ("off", "matrix_units=off"),
                         ("on", "device lacks feature(s) subgroup-matrix")):
        plan = attnreg.Session(backend=backend, flags={"matrix_units": mode}).plan(spec)
        assert plan.stages[0].kernel != mma, mode
        assert needle in "\n".join(plan.rejected[mma]), (mode, plan.rejected[mma])
    # an f32 spec never gets a matrix variant (f16 products would break its tolerance)
    f32 = spec.replace(dtype="float32")
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


def _functions(text: str) -> dict[str, str]:
    """A WGSL file's functions by name, each its text up to the next function."""
    parts = re.split(r"^fn ", text, flags=re.M)[1:]
    return {part.split("(", 1)[0]: part for part in parts}


@pytest.mark.parametrize("form", ["", "_direct", "_staged"])
def test_emulated_twins_keep_the_hardware_barriers(form: str) -> None:
    """CI compiles only the emulated builds (no CI device has subgroup matrices), so WGSL's
    uniformity analysis sees a hardware function's barriers only where its emulated twin
    has them too: a twin with fewer let a call from non-uniform control flow compile in CI
    and fail on the GPU (as the direct prefill's edge Q load did, 0 of 35 cells on the
    H200)."""
    hw = _functions(program.load("mma_hw" + form))
    emu = _functions(program.load("mma_emu" + form))
    missing = {name: (body.count("workgroupBarrier("), emu[name].count("workgroupBarrier("))
               for name, body in hw.items()
               if name in emu and emu[name].count("workgroupBarrier(")
               < body.count("workgroupBarrier(")}
    assert not missing, f"mma_emu{form}: fewer barriers than the hardware twin {missing}"
    assert any("workgroupBarrier(" in body for body in hw.values()) or form != "_direct"


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
@pytest.mark.parametrize("form", ["", "_direct"])
def test_rare_paths_against_reference(backend: str, case: str, form: str) -> None:
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
    kernel = f"{backend}.prefill.f16.mma{form}"
    got, plan = s.run_with_plan(spec, t, kernel=kernel)
    assert _kernel(plan) == (kernel, "emulate")
    want = testing.expected(spec, t)
    _, problem = testing.compare(spec, got, want)
    assert not problem, problem
    if case == "rescale":
        # the ramp really moves the max by more than TAU over the keys
        s_max = float(np.max(want[1])) - float(np.min(want[1]))
        assert s_max > 8.0, s_max


def test_direct_form_reads_q_from_storage_and_stages_k() -> None:
    """The direct prefill's hardware build binds q as an array of halves and loads its Q
    operands from it (no q_s), while K and V go through the workgroup's k_s / v_s in 16-byte
    granules; the emulated build compiles on the CI devices."""
    spec = SPEC.replace(head_size=128)
    plan = attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate"}).plan(spec)
    st = plan.stages[0]
    assert st.kernel == "webgpu.prefill.f16.mma_direct" and st.params["form"] == "direct"
    hw = attnreg.Stage(st.kernel, st.family, {**st.params, "mma": "hardware"})
    src = program.build(hw, spec, plan.caps, dialect=program.TINT).wgsl
    assert "var<storage, read> q: array<f16>;" in src
    assert "var<storage, read> k: array<mat2x4<f16>>;" in src
    assert "subgroupMatrixLoad<MLeft, row_major>(&q," in src and "col_major>(&k_s," in src
    assert "var<workgroup> q_s" not in src and "var<workgroup> k_s" in src
    # no spec feature needs the full logit here: the plain one is built in
    assert "const PLAIN_LOGITS: u32 = 1u;" in src
    biased = program.build(hw, spec.replace(softcap=30.0), plan.caps, dialect=program.TINT).wgsl
    assert "const PLAIN_LOGITS: u32 = 0u;" in biased


@pytest.mark.parametrize("change,words", [
    ({"kv_layout": "paged", "page_size": 16, "num_pages": 20}, "kv_layout"),
    ({"kv_dtype": "int8"}, "kv_dtype"),
    ({"head_size": 256}, "head_size"),
])
def test_direct_form_leaves_other_storage_to_the_staged_one(change: dict, words: str) -> None:
    """Paged or quantized K/V and heads past 128: the direct form says why, and the staged
    matrix prefill runs them."""
    spec = SPEC.replace(**change)
    s = attnreg.Session(backend="webgpu", flags={"matrix_units": "emulate"})
    plan = s.plan(spec)
    assert _kernel(plan) == ("webgpu.prefill.f16.mma", "emulate")
    why = "\n".join(plan.rejected["webgpu.prefill.f16.mma_direct"])
    assert words in why, why


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
    assert res.plan.kernels == ("browser.prefill.f16.mma_direct",)
    js = (tmp_path / "attention.js").read_text()
    assert '"chromium-experimental-subgroup-matrix"' in js and "SUBGROUP_MIN_SIZE = 32;" in js
    assert "enable chromium_experimental_subgroup_matrix;" in (tmp_path / "0_prefill.wgsl").read_text()
    readme = (tmp_path / "README.md").read_text()
    assert "--enable-unsafe-webgpu" in readme and "allow_unsafe_apis" in readme
    plain = export.export(spec, str(tmp_path / "plain"), "browser-profile")
    assert all(".mma" not in k for k in plain.plan.kernels)


# -- the split-KV decode partials on subgroup matrices (shaders/decode_mma.wgsl) -------------
@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_decode_rows_fill_the_m_tile(backend: str) -> None:
    require_devices(backend)
    emu = attnreg.Session(backend=backend, flags={"matrix_units": "emulate"}).plan(DECODE)
    # the query heads x rows fill the M tile: 4 heads x 4 rows
    assert emu.stages[0].params["m_tile"] == 4


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
@pytest.mark.parametrize("case", ["rescale", "nonfinite_v", "window_softcap_alibi"])
def test_decode_against_reference(backend: str, case: str) -> None:
    """Several splits (partial states and the reduced output), rows of an M tile at different
    positions, the lazy max's rescale and a non-finite v some rows see and others do not."""
    require_devices(backend)
    spec = DECODE.replace(head_size=48, kv_layout="BSNH")
    if case == "window_softcap_alibi":
        spec = spec.replace(local_window=40, softcap=20.0, alibi_max_bias=8.0, seqlens_k=True)
    t = _growing_logits(spec, 5) if case == "rescale" else testing.make_tensors(spec, 6)
    if case == "nonfinite_v":
        t["v"] = t["v"].copy()
        t["v"][0, 151, 1, 7] = np.inf      # only the last row (position 152) sees key 151
        t["v"][1, 90, 0, 30] = np.nan      # every row sees key 90
    s = attnreg.Session(backend=backend, flags={"matrix_units": "emulate", "split_size": 64})
    got, plan = s.run_with_plan(spec, t)
    assert _kernel(plan) == (f"{backend}.decode_partial.f16.mma", "emulate")
    assert plan.stages[0].params["n_splits"] == 3
    _, problem = testing.compare(spec, got, testing.expected(spec, t))
    assert not problem, problem
    parts = s.partial_states(spec, t, split_size=64)
    want = attnreg.reference.partial_states(spec, t, 64)
    _, problem = testing.compare_partials(spec, parts, want, testing.TOLERANCE[spec.dtype])
    assert not problem, problem


def test_decode_subgroups_divide_the_tiles() -> None:
    """wg is the most lanes: the kernel takes the most subgroups that divide the head's and
    the key tile's 16-wide tiles (QK and PV deal those out evenly)."""
    for h, bc, wg, nsg in ((128, 64, 128, 4), (32, 64, 128, 2), (48, 64, 128, 1),
                           (128, 32, 128, 2), (64, 16, 64, 1)):
        c = wmma.mma_decode_consts(DECODE.replace(head_size=h), {"kv_tile": bc, "wg": wg})
        assert (c["SUBGROUPS"], c["THREADS"]) == (nsg, 32 * nsg), (h, bc, wg, c)
        assert c["OUT_TILES"] % c["SUBGROUPS"] == 0 and c["KEY_TILES"] % c["SUBGROUPS"] == 0
        assert c["LANE_KEYS"] * c["ROW_LANES"] == bc


def test_decode_hardware_build_needs_64_key_tiles() -> None:
    """kv_tile 32 gave wrong products on the H100's driver: the hardware build refuses it."""
    from attnreg.backends.browser import export

    caps = export.SUBGROUP_MATRIX_PROFILE.model_copy(
        update={"backend": "webgpu",
                "limits": {**export.SUBGROUP_MATRIX_PROFILE.limits, "workgroup_storage": 65536}})
    k = next(k for k in wmma.declare_matrix() if k.family == "decode_partial")
    spec = DECODE.replace(head_size=128)
    assert not k.not_supported_reasons(spec, caps, {"mma": "hardware"})
    why = k.not_supported_reasons(spec, caps, {"mma": "hardware", "kv_tile": 32})
    assert any("kv_tile >= 64" in w for w in why), why
    assert not k.not_supported_reasons(spec, caps, {"mma": "emulate", "kv_tile": 32})


@pytest.mark.parametrize("name,fits", [("nvidia-h100", True), ("apple-m4-max", False),
                                       ("apple-m1-pro", False), ("intel-meteor-lake", False)])
def test_profiles_carry_their_subgroup_matrix_shapes(name: str, fits: bool) -> None:
    """The stored profiles hold the shapes Dawn reports (Apple 8x8x8, none on Xe-LPG); on a
    Dawn adapter with the feature, the matrix kernels run only where 16x16x16 f16->f32 on
    32-lane subgroups is among them, and say which shape is missing elsewhere."""
    from attnreg.profiles import profile

    caps = profile(name)
    assert "subgroup_matrix_configs" in caps.extra
    # the profiles are wgpu-native's view (no subgroup matrices): as a Dawn adapter with them
    dawn_like = caps.model_copy(update={"features": caps.features | {"subgroup-matrix"},
                                        "backend": "webgpu"})
    for k in wmma.declare_matrix():
        # prefill tiles small enough for every profile's workgroup storage, so the shape
        # check is what speaks
        tiles = {"q_tile": 32} if k.family == "prefill" else {}
        why = k.not_supported_reasons(DECODE.replace(head_size=64), dawn_like,
                                      {"mma": "hardware", **tiles})
        missing = [w for w in why if "subgroup-matrix configs lack subgroup_matrix f16 16x16x16"
                   in w]
        assert (not missing) == fits, (k.id, why)


def _nvidia_dawn() -> tuple[registry.Registry, DeviceCaps, attnreg.AttentionSpec]:
    """The registry (its plugins' flags declared), the H100's profile as a Dawn adapter with
    subgroup matrices, and the bench's S=512 prefill."""
    from attnreg.profiles import profile

    h100 = profile("nvidia-h100")
    caps = h100.model_copy(update={"features": h100.features | {"subgroup-matrix"},
                                   "backend": "dawn", "id": "dawn:0"})
    spec = attnreg.AttentionSpec(batch=1, seq_len=512, num_heads=32, kv_num_heads=8,
                                 head_size=128, dtype="float16", causal=True)
    reg = registry.get()
    reg.kernels()
    return reg, caps, spec


def test_auto_takes_the_direct_prefill_on_nvidia_dawn() -> None:
    """matrix_units=auto on a Dawn NVIDIA adapter with subgroup matrices (the H100's
    profile): prompts of 256 rows or more get the direct matrix prefill's hardware build,
    where it measured faster than the scalar prefill; shorter ones, other vendors and
    matrix_units=off keep the scalar plan."""
    reg, caps, spec = _nvidia_dawn()
    plan = reg.plan(spec, backend="dawn", caps=caps, flags={"experimental_features": True})
    assert _kernel(plan) == ("dawn.prefill.f16.mma_direct", "hardware")
    assert "dawn_matrix_prefill_nvidia" in plan.explain()
    xp = {"experimental_features": True}
    short = reg.plan(spec.replace(seq_len=128), backend="dawn", caps=caps, flags=xp)
    assert _kernel(reg.plan(spec.replace(seq_len=256), backend="dawn", caps=caps,
                            flags=xp)) == ("dawn.prefill.f16.mma_direct", "hardware")
    off = reg.plan(spec, backend="dawn", caps=caps, flags={**xp, "matrix_units": "off"})
    other = reg.plan(spec, backend="dawn", caps=caps.model_copy(update={"vendor": "amd"}),
                     flags=xp)
    for p in (short, off, other):
        assert p.stages[0].kernel == "dawn.prefill.f16.sg", p.explain()


def test_direct_prefill_takes_128_rows_on_nvidia_where_they_fit() -> None:
    """Rule dawn_matrix_prefill_rows_nvidia: 128 query rows a workgroup on an NVIDIA Dawn
    adapter whose workgroup storage holds them (48 KiB at H=128); the default 64 on a
    device granting 32 KiB and on other vendors; a q_tile the caller sets stays."""
    from attnreg.backends.webgpu import rules as wrules

    reg, caps, spec = _nvidia_dawn()
    xp = {"experimental_features": True}
    kid = "dawn.prefill.f16.mma_direct"

    def q_tile(c: object, **kw: object) -> int:
        plan = reg.plan(spec, backend="dawn", caps=c, flags=xp, kernel=kid, **kw)
        return int(plan.stages[0].params["q_tile"])

    assert q_tile(caps) == wrules.MATRIX_PREFILL_ROWS
    assert "dawn_matrix_prefill_rows_nvidia" in reg.plan(spec, backend="dawn", caps=caps,
                                                         flags=xp).explain()
    small = caps.model_copy(update={"limits": {**caps.limits, "workgroup_storage": 32768}})
    assert q_tile(small) < wrules.MATRIX_PREFILL_ROWS
    assert q_tile(caps.model_copy(update={"vendor": "amd"})) == 64
    assert q_tile(caps, params={"q_tile": 32}) == 32
    # 128 rows at H=128 fit 48 KiB only with the O scratch in s_s: a separate 16 x 16 f32
    # scratch for each of the 8 subgroups would not
    need = wmma.mma_prefill_storage(spec, {"form": "direct", "q_tile": 128, "kv_tile": 32})
    assert need <= 49152 < need + 8 * 256 * 4


@pytest.mark.parametrize("form", ["staged", "direct"])
@pytest.mark.parametrize("kv_tile", wmma.MMA_CHOICES["kv_tile"])
def test_softmax_lanes_rotation_spreads_banks(form: str, kv_tile: int) -> None:
    """The softmax lanes walk their scores rotated (mma_prefill_common.wgsl's lane_place):
    the rotation the builder picks puts the 32 lanes' reads of s_s at one step in no more
    banks' rows than the plain walk, and none at all for the direct form's 32-key tiles
    (S_STRIDE 36: 4-way without; H200 S=2048 612 against 627 us)."""
    spec = SPEC.replace(head_size=64)
    params = {"form": form, "kv_tile": kv_tile} if form == "direct" else {"kv_tile": kv_tile}
    c = wmma.mma_prefill_consts(spec, params)
    s_stride, p_stride, keys = c["S_STRIDE"], c["P_STRIDE"], c["LANE_KEYS"]
    plain = wmma._bank_ways(s_stride, keys, 16, 0, 4), wmma._bank_ways(p_stride, keys, 16, 0, 2)
    rot = (c["ROT_DIV"], c["ROT_HF"])
    got = (wmma._bank_ways(s_stride, keys, rot[0], rot[1], 4),
           wmma._bank_ways(p_stride, keys, rot[0], rot[1], 2))
    assert got <= plain, (rot, got, plain)
    if form == "direct" and kv_tile == 32:
        assert plain == (4, 4) and got[0] == 1, (rot, got)
