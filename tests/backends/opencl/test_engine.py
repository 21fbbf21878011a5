"""OpenCL backend engineering: probing, kernels as data, routing without sub-groups,
build-failure fallback, the shared program cache, buffer reuse, timings, interop."""

from __future__ import annotations

import types

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.backends.opencl import device as odevice
from attnreg.backends.opencl import mma_probe
from attnreg.backends.opencl import probe as oprobe
from attnreg.backends.opencl import program as oprogram
from attnreg.backends.opencl import tiles as otiles
from attnreg.kernel import TOLERANCE
from attnreg.tensors import check_tensors
from tests.support import check_close, make_tensors


def _spec(**kw) -> attnreg.AttentionSpec:
    base = dict(batch=1, seq_len=1, past_len=47, num_heads=8, kv_num_heads=2, head_size=64)
    return attnreg.AttentionSpec(**{**base, **kw})


# -- probing ---------------------------------------------------------------------------
def test_probe_fills_caps(dev):
    assert dev.id.startswith("opencl:") and dev.id.count(":") == 2
    assert dev.backend_type == "OpenCL" and dev.device_type in ("cpu", "gpu")
    for name in ("workgroup_storage", "invocations", "workgroup_size_x", "storage_binding",
                 "buffer_size", "workgroups_per_dim"):
        assert dev.limit(name), name
    assert dev.compute_units and dev.driver
    # sub-groups count where the extensions are there and run 32 lanes (probed; PoCL 5.0's do
    # not), or on NVIDIA's warps
    widths_ok = "not 32-wide" not in dev.extra.get("subgroup_widths", "") and \
        "failed" not in dev.extra.get("subgroup_widths", "")
    assert ("subgroups" in dev.features) == (oprobe.NV_SHUFFLE in dev.features or (bool(
        {"cl_khr_subgroups", "cl_intel_subgroups"} & dev.features) and widths_ok))
    if "pthread" in dev.name or "pocl" in dev.description.lower():
        assert dev.vendor == "pocl" and dev.device_type == "cpu"


class _Enum:
    GPU, CPU = 4, 2


class _FakeDev:
    def __init__(self, **kw):
        base = dict(name="Fake GPU", type=_Enum.GPU, vendor="NVIDIA Corporation", vendor_id=0x10DE,
                    extensions="cl_khr_fp64 cl_nv_device_attribute_query",
                    local_mem_size=49152, max_work_group_size=1024, max_work_item_sizes=[1024] * 3,
                    max_mem_alloc_size=1 << 32, driver_version="580.1", version="OpenCL 3.0 CUDA",
                    max_compute_units=132, warp_size_nv=32, compute_capability_major_nv=9,
                    compute_capability_minor_nv=0)
        self.__dict__.update({**base, **kw})


def _fake_cl():
    return types.SimpleNamespace(device_type=_Enum)


def test_probe_maps_vendor_extensions(monkeypatch, tmp_path):
    """Vendors and features from a driver's answers (the driver stood in for; the kernels the
    probe runs need a real device, so their answers are given: the compiler check's cached
    verdict, the sub-group width of an Intel GPU)."""
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(oprobe.compiler_check, "measure",
                        lambda cl, dev: oprobe.compiler_check.Measured(optimized=0.0))
    widths = {"Intel(R) OpenCL Graphics": [32, 32, 32], "Portable Computing Language": [64, 128, 256]}
    monkeypatch.setattr(oprobe, "subgroup_sizes",
                        lambda cl, dev, exts: oprobe.SubgroupSizes(sizes=widths[dev.platform_name]))
    nv = types.SimpleNamespace(name="NVIDIA CUDA", vendor="NVIDIA Corporation", version="OpenCL 3.0")
    caps = oprobe.device_caps(_fake_cl(), 1, 0, nv, _FakeDev())
    assert caps.id == "opencl:1:0" and caps.vendor == "nvidia" and caps.architecture == "sm_90"
    assert {"subgroups", oprobe.NV_SHUFFLE} <= caps.features and "cl_khr_fp16" not in caps.features
    assert caps.subgroup_max_size == 32 and caps.limit("workgroup_storage") == 49152
    intel = types.SimpleNamespace(name="Intel(R) OpenCL Graphics", vendor="Intel(R) Corporation",
                                  version="OpenCL 3.0")
    caps = oprobe.device_caps(_fake_cl(), 0, 2, intel, _FakeDev(
        vendor="Intel(R) Corporation", vendor_id=0x8086,
        extensions="cl_khr_fp16 cl_khr_subgroups cl_intel_subgroups", sub_group_sizes_intel=[8, 16, 32],
        platform_name=intel.name))
    assert caps.vendor == "intel" and {"cl_khr_fp16", "subgroups"} <= caps.features
    assert (caps.subgroup_min_size, caps.subgroup_max_size) == (8, 32)
    pocl = types.SimpleNamespace(name="Portable Computing Language", vendor="The pocl project",
                                 version="OpenCL 3.0 PoCL")
    caps = oprobe.device_caps(_fake_cl(), 0, 0, pocl, _FakeDev(
        type=_Enum.CPU, vendor="AuthenticAMD", vendor_id=0x8086, extensions="cl_khr_fp64"))
    assert caps.vendor == "pocl" and caps.device_type == "cpu" and "subgroups" not in caps.features
    # PoCL 5.0: sub-group extensions whose sub-groups are the whole work-group
    caps = oprobe.device_caps(_fake_cl(), 0, 0, pocl, _FakeDev(
        type=_Enum.CPU, vendor="GenuineIntel", vendor_id=0x8086, platform_name=pocl.name,
        extensions="cl_khr_subgroups cl_intel_subgroups cl_intel_required_subgroup_size"))
    assert {"cl_khr_subgroups", "cl_intel_subgroups"} <= caps.features
    assert "subgroups" not in caps.features and "not 32-wide" in caps.extra["subgroup_widths"]
    assert any("emulated" in line for line in caps.settings)


def test_probe_never_raises(monkeypatch):
    import pyopencl as cl

    def boom():
        raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(cl, "get_platforms", boom)
    got = oprobe.probe()
    assert len(got) == 1 and not got[0].available and "PLATFORM_NOT_FOUND" in got[0].reason


# -- kernels as data -------------------------------------------------------------------
def test_kernel_table():
    ids = {k.id for k in attnreg.kernels("opencl")}
    for dt in ("f32", "f16"):
        assert {f"opencl.prefill.{dt}.wgmem", f"opencl.prefill.{dt}.sg", f"opencl.reduce.{dt}",
                *(f"opencl.decode_partial.{dt}.m{m}" for m in (1, 2, 4))} <= ids
    for k in attnreg.kernels("opencl"):
        # the tensor-core decode loads 32-dim runs of K and 64-dim halves of V per lane
        sizes = (64, 128, 192, 256) if k.matrix and k.family != "prefill" else \
            (32, 64, 80, 96, 128, 256)
        assert all(k.head_size_ok(h) for h in sizes), k.id
        assert k.tolerance == TOLERANCE
        if k.family == "decode_partial" and not k.matrix:
            assert k.params["m_tile"] in (1, 2, 4) and "kv_tile" in k.defaults
        if k.id.endswith(".sg"):
            assert "subgroups" in k.features
    spec = _spec(head_size=128, seq_len=4, dtype="float16")
    need = attnreg.registry.get().kernel("opencl.decode_partial.f16.m4").storage_need(
        spec, {"m_tile": 4, "kv_tile": 32})
    g = otiles.geometry("decode_partial", "", spec, {"m_tile": 4, "kv_tile": 32})
    assert need == g.storage(128) > 0 and g.rows == 16


def test_sg_variant_rejected_with_reason_without_subgroups(dev):
    if "subgroups" in dev.features:
        pytest.skip("this device has sub-groups: the sg variant runs in test_opencl_cells.py")
    with pytest.raises(attnreg.NoKernelError, match=r"lacks feature.*subgroups"):
        attnreg.explain(_spec(seq_len=64, past_len=0), backend="opencl",
                        kernel="opencl.prefill.f32.sg", device=dev.id)


def test_storage_limit_halves_m_tile_or_rejects(dev):
    small = dev.model_copy(update={"limits": {**dev.limits, "workgroup_storage": 24 * 1024}})
    plan = attnreg.explain(_spec(seq_len=4, head_size=128, num_heads=16, kv_num_heads=4),
                           caps=small)
    assert plan.route == "split_kv_fused" and plan.params["m_tile"] < 4
    tiny = dev.model_copy(update={"limits": {**dev.limits, "workgroup_storage": 1024}})
    with pytest.raises(attnreg.NoKernelError, match="workgroup storage"):
        attnreg.explain(_spec(head_size=128), caps=tiny)


def test_bad_params_name_the_parameter(dev):
    spec = _spec()
    with attnreg.Session(backend="opencl", device=dev.id) as s, \
            pytest.raises(attnreg.SpecError, match="wg"):
        s.run(spec, make_tensors(spec), kernel="opencl.decode_partial.f32.m1", params={"wg": 48})


# -- routing ---------------------------------------------------------------------------
def test_routes_follow_subgroups(dev):
    # without the tensor-core feature (the probe adds it on sm_80+: then the mma prefill wins)
    nv = dev.model_copy(update={"features": (dev.features | {"subgroups", oprobe.NV_SHUFFLE})
                                - {mma_probe.FEATURE},
                                "device_type": "gpu", "vendor": "nvidia"})
    plain = dev.model_copy(update={"features": dev.features - {"subgroups"}})
    spec = _spec(seq_len=512, past_len=0, dtype="float16", head_size=128)
    assert attnreg.explain(spec, caps=nv).kernel == "opencl.prefill.f16.sg"
    plan = attnreg.explain(spec, caps=plain)
    assert plan.route == "split_kv_fused" and plan.kernel == "opencl.decode_fused.f16.m4"
    decode = _spec(past_len=8191, num_heads=32, kv_num_heads=8, head_size=128, dtype="float16")
    assert attnreg.explain(decode, caps=nv).kernel == "opencl.decode_fused.f16.sg.m1"
    gpu = plain.model_copy(update={"device_type": "gpu"})
    assert attnreg.explain(decode, caps=gpu).kernel == "opencl.decode_fused.f16.m1"
    cpu = plain.model_copy(update={"device_type": "cpu"})      # the measured crossover
    assert attnreg.explain(decode, caps=cpu).kernels == (
        "opencl.decode_qk.f16.m1", "opencl.decode_pv.f16", "opencl.reduce.f16")
    short = decode.replace(past_len=1023, num_heads=8, kv_num_heads=2)
    assert attnreg.explain(short, caps=cpu).kernel == "opencl.decode_fused.f16.m1"
    two = attnreg.explain(decode, caps=nv, flags={"route": "split_kv"})
    assert two.kernels == ("opencl.decode_partial.f16.sg.m1", "opencl.reduce.f16")


def test_prefill_without_subgroups_runs_split_kv(dev):
    spec = _spec(seq_len=64, past_len=0, num_heads=4, kv_num_heads=4, head_size=32)
    t = make_tensors(spec, seed=2)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        out, plan = s.run_with_plan(spec, t)
    if "subgroups" not in dev.features:
        assert plan.route == "split_kv_fused"
    check_close(spec, out, t, what=str(plan.kernels))


# -- build cache and failure -----------------------------------------------------------
def test_build_failure_replans_to_next_candidate(dev, monkeypatch):
    orig = oprogram.load_source

    def broken(family: str) -> str:
        src = orig(family)
        broken = family in ("decode_partial", "decode_fused")
        return src + "\n#error injected by the test\n" if broken else src

    monkeypatch.setattr(oprogram, "load_source", broken)
    spec = _spec(seq_len=4, past_len=36, return_lse=True)
    t = make_tensors(spec, seed=3)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        got, plan = s.run_with_plan(spec, t)
    check_close(spec, got, t, what=str(plan.kernels))
    assert plan.kernel.startswith("opencl.prefill.")
    for kid in ("opencl.decode_partial.f32.m4", "opencl.decode_fused.f32.m4"):
        reasons = " ".join(plan.rejected[kid])
        assert "OpenCL build failed" in reasons and "injected by the test" in reasons, kid


def test_programs_shared_across_sessions(dev):
    spec = _spec(head_size=96, past_len=70)
    t = make_tensors(spec, seed=4)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        s.run(spec, t)
    before = odevice.BUILDS["count"]
    with attnreg.Session(backend="opencl", device=dev.id) as s2:
        check_close(spec, s2.run(spec, t), t)
    assert odevice.BUILDS["count"] == before


def test_buffers_reused_within_session(dev):
    spec = _spec(seq_len=2, past_len=100, return_lse=True)
    t = make_tensors(spec, seed=5)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        s.run(spec, t)
        plan = s.plan(spec)
        rt = s.runtime(plan)
        pool = rt.mem.pool_ids()
        prepared = rt.counters["prepares"]
        for seed in (6, 7):
            t2 = make_tensors(spec, seed=seed)
            check_close(spec, s.run(spec, t2), t2)
        assert rt.mem.pool_ids() == pool
        assert rt.counters["prepares"] == prepared, "same plan and buffers: the launch is reused"


def test_timings_shape(dev):
    spec = _spec(past_len=300)
    t = check_tensors(spec, make_tensors(spec, seed=8, poison=False))
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        plan = s.plan(spec)
        tm = s.runtime(plan).timings(plan, t, iters=4, warmup=1)
    assert len(tm["gpu_s"]) == len(tm["wall_s"]) == 4
    assert all(x > 0 for x in tm["gpu_s"] + tm["wall_s"])
    assert set(tm["stage_gpu_s"]) == set(plan.kernels)


# -- interop -----------------------------------------------------------------------------
@pytest.mark.parametrize("split", [16, 40, 64, 200])
def test_partials_reduce_on_reference(dev, split):
    spec = _spec(seq_len=3, past_len=140, num_heads=7, kv_num_heads=1, head_size=80,
                 local_window=50, head_sink=True, return_lse=True, dtype="float16")
    t = make_tensors(spec, seed=9)
    o, lse = attnreg.partial_states(spec, t, split_size=split, backend="opencl", device=dev.id)
    assert o.shape[3] == -(-spec.capacity // split)
    assert np.isneginf(lse).any() == (split < 90)      # the window leaves early splits empty
    got = attnreg.reduce_states(spec, o, lse, t["head_sink"], backend="reference")
    check_close(spec, got, t, what=f"opencl partials split {split} + reference reduce")
    # and the reverse: reference partials through the OpenCL reduce
    wo, wl = ref.partial_states(spec, check_tensors(spec, t), split)
    got = attnreg.reduce_states(spec, wo.astype(np.float32), wl.astype(np.float32),
                                t["head_sink"], backend="opencl", device=dev.id)
    check_close(spec, got, t, what="reference partials + opencl reduce")


@pytest.mark.parametrize("head_size", [20, 512, 1024])
def test_merge_states_any_head_size(dev, head_size):
    rng = np.random.default_rng(head_size)
    states = [(rng.standard_normal((2, 3, head_size)).astype(np.float32),
               rng.standard_normal((2, 3)).astype(np.float32)) for _ in range(3)]
    states[1][1][0, 0] = -np.inf                        # an empty state adds nothing
    states[1][0][0, 0] = np.nan
    o, lse = attnreg.merge_states(states, backend="opencl", device=dev.id)
    wo, wl = ref.merge(states)
    np.testing.assert_allclose(o, wo, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, wl, atol=2e-4)
