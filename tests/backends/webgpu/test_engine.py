"""WebGPU backend on the local adapter (lavapipe in CI): the engineering promises (routing
without subgroups, compile-failure fallback, caches, grid folding, limits), against the
float64 reference. Its conformance cells run in tests/conformance/test_webgpu_cells.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg import testing
from attnreg.backends.webgpu import device as wdevice
from attnreg.backends.webgpu import probe as wprobe
from attnreg.backends.webgpu import program as wprogram
from tests.support import check_close, make_tensors, require_devices


def _slug() -> str:
    try:
        devs = [d for d in attnreg.devices("webgpu") if d.available]
    except Exception:
        devs = []
    return devs[0].slug if devs else "nodevice"


SLUG = _slug()


@pytest.fixture(scope="module")
def session():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


def test_probe_caps():
    devs = require_devices("webgpu")
    d = devs[0]
    assert d.backend == "webgpu" and d.id.startswith("webgpu:")
    for name in ("workgroup_storage", "invocations", "storage_binding", "buffer_size",
                 "workgroups_per_dim", "workgroup_size_x"):
        assert d.limits.get(name, 0) > 0, name
    adapter = wprobe.adapters()[int(d.id.split(":")[1])]
    assert ("subgroups" in d.features) == ("subgroup" in adapter.features)
    assert ("shader-f16" in d.features) == ("shader-f16" in adapter.features)
    if "subgroups" in d.features:
        assert 4 <= d.subgroup_min_size <= max(d.subgroup_max_size, 4)
    if "llvmpipe" in d.name:
        assert d.compute_units == os.cpu_count() and d.device_type == "cpu"


def test_probe_never_raises(monkeypatch):
    def boom(refresh: bool = False):
        raise RuntimeError("no vulkan")
    monkeypatch.setattr(wprobe, "adapters", boom)
    got = wprobe.probe()
    assert len(got) == 1 and not got[0].available and "no vulkan" in got[0].reason


def test_default_routes(session):
    require_devices("webgpu")
    dec = attnreg.AttentionSpec(seq_len=1, past_len=200, num_heads=8, kv_num_heads=2,
                                head_size=64, dtype="float16")
    plan = session.plan(dec)
    assert plan.route == "split_kv"
    assert plan.kernels == ("webgpu.decode_partial.f16.m1", "webgpu.reduce.f16")
    pre = dec.replace(seq_len=64, past_len=0)
    plan = session.plan(pre)
    if "subgroups" in plan.caps.features:
        assert plan.kernels == ("webgpu.prefill.f16.sg",)
    t = make_tensors(pre, 3)
    check_close(pre, session.run(pre, t), t)


@pytest.fixture
def no_subgroups(monkeypatch):
    """The local adapter as if it had no subgroups (probe patched, devices re-probed)."""
    require_devices("webgpu")
    real = wprobe.probe

    def probe():
        return [c.model_copy(update={"features": c.features - {"subgroups"}}) for c in real()]
    # the registered backend holds the probe function it was given (hookspecs.BackendInfo)
    reg = attnreg.registry.get()
    monkeypatch.setitem(reg._backends, "webgpu",
                        dataclasses.replace(reg.backend("webgpu"), probe=probe))
    attnreg.devices("webgpu", refresh=True)
    yield
    monkeypatch.undo()
    attnreg.devices("webgpu", refresh=True)


def test_without_subgroups_everything_runs_split_kv(no_subgroups):
    spec = attnreg.AttentionSpec(seq_len=512, past_len=0, num_heads=4, kv_num_heads=1,
                                 head_size=32, dtype="float16", return_lse=True)
    t = make_tensors(spec, 5)
    with attnreg.Session(backend="webgpu") as s:
        got, plan = s.run_with_plan(spec, t)
        assert plan.route == "split_kv" and plan.kernel == "webgpu.decode_partial.f16.m4"
        assert any(r.startswith("split_kv_no_subgroups") for r in plan.rules)
        with pytest.raises(attnreg.NoKernelError, match=r"device lacks feature\(s\) subgroups"):
            s.plan(spec, kernel="webgpu.prefill.f16.sg")
        check_close(spec, got, t)
        wg = s.run(spec, t, kernel="webgpu.prefill.f16.wgmem")
        check_close(spec, wg, t)


def test_compile_failure_falls_back_to_next_kernel(monkeypatch):
    require_devices("webgpu")
    real = wprogram.source

    def source(family, spec, consts, *, subgroups=False, **kw):
        text = real(family, spec, consts, subgroups=subgroups, **kw)
        return text + "\nfn broken( {\n" if subgroups else text
    monkeypatch.setattr(wprogram, "source", source)
    spec = attnreg.AttentionSpec(seq_len=40, past_len=3, num_heads=2, kv_num_heads=1,
                                 head_size=32)
    t = make_tensors(spec, 7)
    with attnreg.Session(backend="webgpu") as s:
        got, plan = s.run_with_plan(spec, t)
        check_close(spec, got, t)
        if "subgroups" not in plan.caps.features:
            pytest.skip("the subgroup variant is not a candidate on this adapter")
        assert plan.kernel == "webgpu.prefill.f32.wgmem"
        why = " ".join(plan.rejected["webgpu.prefill.f32.sg"])
        assert "WGSL compile failed" in why and "broken" in why      # the compiler's message
        with pytest.raises(attnreg.KernelUnavailable, match="WGSL compile failed"):
            sg = attnreg.Stage("webgpu.prefill.f32.sg", "prefill",
                               {**plan.params, "reduction": "subgroup"})
            s.runtime(plan).launch(dataclasses.replace(plan, stages=(sg,)), t)


def test_pipelines_shared_across_sessions_buffers_reused():
    require_devices("webgpu")
    spec = attnreg.AttentionSpec(seq_len=1, past_len=70, num_heads=4, kv_num_heads=1,
                                 head_size=64, dtype="float16", bias=True)
    t = make_tensors(spec, 11)
    with attnreg.Session(backend="webgpu") as s1:
        check_close(spec, s1.run(spec, t), t)
        rt = s1.runtime(s1.plan(spec))
        dev = wdevice.get(rt.caps)
        compiled = dev.compiles
        bufs = {n: id(b) for n, (b, _) in rt.memory._bufs.items()}
        made = rt.counters["bind_groups"]
        check_close(spec, s1.run(spec, t), t)
        assert {n: id(b) for n, (b, _) in rt.memory._bufs.items()} == bufs
        assert rt.counters["bind_groups"] == made
    with attnreg.Session(backend="webgpu") as s2:
        check_close(spec, s2.run(spec, t), t)
    assert dev.compiles == compiled


def test_fold_grid():
    assert wprogram.fold_grid(10, 65535) == (10, 1, 1)
    x, y, z = wprogram.fold_grid(70000, 65535)
    assert x <= 65535 and y <= 65535 and x * y * z >= 70000
    x, y, z = wprogram.fold_grid(300, 7)
    assert max(x, y, z) <= 7 and x * y * z >= 300
    with pytest.raises(ValueError):
        wprogram.fold_grid(400, 7)


@pytest.mark.parametrize("kernel", ["webgpu.prefill.f32.wgmem", "webgpu.decode_partial.f32.m2"])
def test_folded_grids_run(session, kernel):
    spec = attnreg.AttentionSpec(batch=2, seq_len=9, past_len=40, num_heads=6, kv_num_heads=2,
                                 head_size=32, return_lse=True)
    t = make_tensors(spec, 13)
    plan = session.plan(spec, kernel=kernel, flags={"split_size": 16})
    rt = session.runtime(plan)
    rt._limit = 5                      # every dispatch folds into 3 dimensions
    try:
        res = rt.launch(plan, t)
    finally:
        rt._limit = plan.caps.limit("workgroups_per_dim") or 65535
    check_close(spec, (res["out"], res["lse"]), t)


def test_reduce_past_65535_workgroups(session):
    spec = attnreg.AttentionSpec(seq_len=8200, past_len=0, num_heads=8, kv_num_heads=8,
                                 head_size=8, causal=False)
    rng = np.random.default_rng(0)
    o = rng.standard_normal((1, 8, 8200, 2, 8)).astype(np.float32)
    lse = rng.standard_normal((1, 8, 8200, 2)).astype(np.float32)
    got = session.reduce_states(spec, o, lse, kernel="webgpu.reduce.f32")
    want, _ = ref.reduce(spec, o, lse)
    np.testing.assert_allclose(got, ref.out_layout(spec, want), atol=2e-5, rtol=1e-4)


def test_storage_binding_limit_is_a_named_rejection():
    """A tensor past one storage binding is a SpecError naming it, its size and the limit
    (issue [trust]: it was a NoKernelError, the reason repeated in every kernel's list);
    the NoKernelError, every kernel's rejection, is its cause."""
    devs = require_devices("webgpu")
    cap = devs[0].limit("storage_binding")
    assert cap is not None
    spec = attnreg.AttentionSpec(seq_len=1, past_len=cap // (8 * 128 * 4), num_heads=8,
                                 kv_num_heads=8, head_size=128)
    with pytest.raises(attnreg.SpecError, match="storage_binding") as err:
        attnreg.explain(spec, backend="webgpu")
    assert err.value.field == "tensors['k']" and err.value.value == 8 * 128 * 4 * spec.capacity
    assert str(cap) in str(err.value)
    assert isinstance(err.value.__cause__, attnreg.NoKernelError)
    assert "webgpu.decode_partial.f32.m1" in str(err.value.__cause__)


def test_timings(session):
    spec = attnreg.AttentionSpec(seq_len=1, past_len=300, num_heads=4, kv_num_heads=2,
                                 head_size=64, dtype="float16")
    t = testing.make_tensors(spec, 1, poison=False)
    plan = session.plan(spec)
    times = session.runtime(plan).timings(plan, t, iters=4, warmup=1)
    assert len(times["wall_s"]) == 4 and all(x > 0 for x in times["wall_s"])
    if "timestamp-query" in plan.caps.features:
        assert len(times["gpu_s"]) == 4 and all(0 < x < 10 for x in times["gpu_s"])


def test_reduce_many_splits_with_empty_ones(session):
    # more splits than the reduce's lanes and its weight chunk; empty splits hold NaN
    spec = attnreg.AttentionSpec(batch=1, seq_len=2, past_len=0, num_heads=2, kv_num_heads=1,
                                 head_size=16, causal=False, head_sink=True, return_lse=True)
    rng = np.random.default_rng(1)
    t = 1100
    o = rng.standard_normal((1, 2, 2, t, 16)).astype(np.float32)
    lse = (rng.standard_normal((1, 2, 2, t)) * 3).astype(np.float32)
    lse[..., ::3] = -np.inf
    o[..., ::3, :] = np.nan
    sink = np.array([0.5, -80.0], np.float32)        # head_sink must be finite (docs/contract.md)
    out, l_out = session.reduce_states(spec, o, lse, sink, kernel="webgpu.reduce.f32")
    want, want_lse = ref.reduce(spec, np.nan_to_num(o), lse, sink)
    np.testing.assert_allclose(out, ref.out_layout(spec, want), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(l_out, want_lse, atol=2e-4)


GEOMETRIES = [
    ("webgpu.decode_partial.f16.m4", {"prefetch": 0}),
    ("webgpu.decode_partial.f32.m2", {"kv_tile": 8, "threads": 64}),       # 8 lanes per key
    ("webgpu.decode_partial.f16.m1", {"kv_tile": 32, "threads": 16}),      # 2 keys, 2+ cols a lane
    ("webgpu.decode_partial.f32.m1", {"kv_tile": 16, "threads": 256}),
    ("webgpu.prefill.f16.sg", {"prefetch": 0, "q_tile": 8}),
    ("webgpu.prefill.f32.wgmem", {"q_tile": 16, "kv_tile": 16, "rows_per_thread": 1}),
    ("webgpu.prefill.f16.wgmem", {"q_tile": 8, "kv_tile": 8, "row_lanes": 4}),
]


@pytest.mark.parametrize("kernel,params", GEOMETRIES,
                         ids=[f"webgpu-{SLUG}-{k.split('.', 1)[1]}-" + "-".join(
                             f"{n}{v}" for n, v in p.items()) for k, p in GEOMETRIES])
@pytest.mark.parametrize("head_size", [80, 128])
def test_tile_geometries(session, kernel, params, head_size):
    """Non-default tile shapes and the unpipelined loop, on odd lengths and head sizes."""
    dtype = "float16" if ".f16." in kernel else "float32"
    spec = attnreg.AttentionSpec(batch=2, seq_len=5, past_len=70, num_heads=7, kv_num_heads=1,
                                 head_size=head_size, dtype=dtype, seqlens_k=True,
                                 kv_capacity=90, local_window=50, head_sink=True,
                                 return_lse=True, softcap=2.0)
    t = make_tensors(spec, 17, lengths=[75, 60])
    got = session.run(spec, t, kernel=kernel, params=params, flags={"split_size": 24})
    check_close(spec, got, t)


@pytest.mark.parametrize("kv_tile", [16, 32])
def test_direct_decode_with_one_lane_a_key(session, kv_tile):
    """kv_staging direct with as many lanes as keys (threads == kv_tile): each lane's logits go
    straight to p_s, which other lanes may still be reading the previous tile's weights from
    (PV); without a barrier first the output was wrong (max error 1.3-3.5 on lavapipe). Head
    size 64: larger heads' register tiles are refused at one lane a key."""
    spec = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=200, num_heads=4, kv_num_heads=1,
                                 head_size=64, dtype="float16", seqlens_k=True, head_sink=True,
                                 return_lse=True)
    t = make_tensors(spec, 5, lengths=[201, 150])
    params = {"kv_tile": kv_tile, "threads": kv_tile, "kv_staging": "direct"}
    plan = session.plan(spec, kernel="webgpu.decode_partial.f16.m1", params=params,
                        flags={"split_size": 4 * kv_tile})
    assert {k: plan.stages[0].params[k] for k in params} == params
    got = session.run(spec, t, kernel="webgpu.decode_partial.f16.m1", params=params,
                      flags={"split_size": 4 * kv_tile})
    check_close(spec, got, t)


@pytest.mark.parametrize("head_size", [12, 512])
def test_merge_states_through_the_reduce(session, head_size):
    """attnreg.merge_states(backend='webgpu') runs webgpu.reduce (any multiple of 4 to 1024)."""
    rng = np.random.default_rng(head_size)
    states = [(rng.standard_normal((2, 3, head_size)).astype(np.float32),
               (rng.standard_normal((2, 3)) * 2).astype(np.float32)) for _ in range(5)]
    states[1][1][0, 0] = -np.inf
    o, lse = attnreg.merge_states(states, backend="webgpu")
    want_o, want_lse = ref.merge(states)
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, want_lse, atol=2e-4)
