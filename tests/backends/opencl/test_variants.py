"""OpenCL variants beyond the contract math the cases check: the one-launch decode's tickets
and ordering, the unfused decode's single submission, paged pools bound as device tensors,
masked-block skipping (rule, rejection, cached lists), and the NVIDIA-only knobs."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import probe as oprobe
from attnreg.backends.opencl import tiles as otiles
from attnreg.spec import AttentionSpec
from attnreg.testing import packed_docs
from tests.support import check_close, make_tensors


def _tickets(rt) -> np.ndarray:
    bufs = [buf for (role, _), buf in rt.mem._pool.items() if role == "tickets"]
    assert bufs
    return np.concatenate([np.frombuffer(rt.download(b, b.size), np.uint32) for b in bufs])


# -- decode_fused ----------------------------------------------------------------------
def test_fused_tickets_reset_and_reruns_identical(dev):
    spec = AttentionSpec(batch=2, seq_len=2, past_len=1023, num_heads=8, kv_num_heads=2,
                         head_size=64, dtype="float16", head_sink=True, return_lse=True,
                         local_window=300)
    t = make_tensors(spec, seed=1)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        kid = "opencl.decode_fused.f16.m2"
        first = s.run(spec, t, kernel=kid, params={"split_size": 32})   # 33 splits, most empty
        check_close(spec, first, t)
        for _ in range(4):
            again = s.run(spec, t, kernel=kid, params={"split_size": 32})
            assert again[0].tobytes() == first[0].tobytes()
            assert again[1].tobytes() == first[1].tobytes()
        # another split count over the same tickets buffer, then the first again
        check_close(spec, s.run(spec, t, kernel=kid, params={"split_size": 64}), t)
        check_close(spec, s.run(spec, t, kernel=kid, params={"split_size": 32}), t)
        assert not _tickets(s.runtime(s.plan(spec, kernel=kid))).any()


def test_fused_back_to_back_launches_without_waiting(dev):
    spec = AttentionSpec(batch=1, seq_len=1, past_len=700, num_heads=8, kv_num_heads=2,
                         head_size=32, dtype="float32")
    t = make_tensors(spec, seed=2)
    rng = np.random.default_rng(3)
    qs = [rng.standard_normal(spec.q_shape).astype(np.float32) for _ in range(8)]
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        k, v, qdev = s.tensor(t["k"]), s.tensor(t["v"]), s.tensor(qs[0])
        outs = [s.empty(spec.out_shape, "float32") for _ in qs]
        for q, out in zip(qs, outs):
            qdev.write(q)
            s.run(spec, {"q": qdev, "k": k, "v": v}, out=out, params={"split_size": 32})
        for q, out in zip(qs, outs):
            check_close(spec, out.numpy(), {**t, "q": q})
        assert s.plan(spec, params={"split_size": 32}).route == "split_kv_fused"


# -- unfused decode --------------------------------------------------------------------
def test_unfused_is_three_launches_in_one_submission(dev, monkeypatch):
    spec = AttentionSpec(batch=2, seq_len=1, past_len=300, num_heads=8, kv_num_heads=2,
                         head_size=64, dtype="float16", return_lse=True)
    t = make_tensors(spec, seed=4)
    with attnreg.Session(backend="opencl", device=dev.id, flags={"route": "split_kv_unfused"}) as s:
        plan = s.plan(spec)
        assert [st.family for st in plan.stages] == ["decode_qk", "decode_pv", "reduce"]
        rt = s.runtime(plan)
        syncs = [0]
        orig = rt.mem.sync
        monkeypatch.setattr(rt.mem, "sync", lambda events=None: (
            syncs.__setitem__(0, syncs[0] + 1), orig(events)))
        check_close(spec, s.run(spec, t), t)
        assert syncs[0] == 1
        prep = next(iter(rt._preps.values()))
        assert [ln.kernel_id for ln in prep.launches] == list(plan.kernels)


# -- paged pools as device tensors -----------------------------------------------------
@pytest.mark.parametrize("route", ["split_kv_fused", "split_kv_unfused", "prefill"])
def test_paged_device_tensors(dev, route):
    spec = AttentionSpec(batch=3, seq_len=2, past_len=60, num_heads=8, kv_num_heads=2,
                         head_size=32, dtype="float16", kv_layout="paged", page_size=8,
                         num_pages=40, kv_capacity=96, seqlens_k=True, causal=True)
    t = make_tensors(spec, seed=5, lengths=(96, 9, 40))     # unused pages NaN, -1 entries
    assert (t["block_table"] == -1).any()
    with attnreg.Session(backend="opencl", device=dev.id, flags={"route": route}) as s:
        dt = {n: s.tensor(x) for n, x in t.items()}
        check_close(spec, s.run(spec, dt), t, what=route)


# -- masked-block skipping -------------------------------------------------------------
def test_block_skip_flag_rule(dev):
    spec, _ = packed_docs(2, 64, 8, 2, 32, "float32")
    for flag, want in (("on", True), ("auto", True), ("off", False)):
        plan = attnreg.explain(spec, device=dev.id, backend="opencl", flags={"block_skip": flag})
        assert plan.params["block_skip"] is want, (flag, plan.kernels)
        assert plan.kernel.endswith(".bs") is want
    decode = spec.replace(seq_len=1, past_len=127)
    assert not attnreg.explain(decode, device=dev.id, backend="opencl").params["block_skip"]
    on = attnreg.explain(decode, device=dev.id, backend="opencl", flags={"block_skip": "on"})
    assert on.kernel.endswith(".bs") and any("opencl_block_skip" in r for r in on.rules)
    plain = attnreg.explain(spec.replace(bias=False), device=dev.id, backend="opencl",
                            flags={"block_skip": "on"})
    assert not plain.kernel.endswith(".bs")
    with pytest.raises(attnreg.NoKernelError, match=r"spec\.bias is False"):
        attnreg.explain(spec.replace(bias=False), device=dev.id, backend="opencl",
                        kernel="opencl.prefill.f32.wgmem.bs")


def test_block_skip_matches_dense_and_caches_lists(dev):
    spec, x = packed_docs(4, 40, 8, 2, 32, "float16")
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        bias = s.tensor(x["bias"])
        dense = s.run(spec, {**x, "bias": bias}, flags={"block_skip": "off"})
        check_close(spec, dense, x)
        rt = s.runtime(s.plan(spec))
        allocs = rt.counters["allocs"]
        for _ in range(3):
            got = s.run(spec, {**x, "bias": bias}, flags={"block_skip": "on"})
            check_close(spec, got, x)
        assert rt.counters["allocs"] - allocs == 3, "block lists of a device bias uploaded once"
        x2 = dict(x)
        x2["bias"] = x["bias"].copy()
        x2["bias"][..., :, :8] = 0.0                      # every row sees the first 8 keys
        bias.write(x2["bias"])
        check_close(spec, s.run(spec, {**x, "bias": bias}, flags={"block_skip": "on"}), x2)
        assert rt.counters["allocs"] - allocs == 6, "a new bias version rebuilds its lists"
        with pytest.raises(attnreg.SpecError, match="partial states"):
            s.partial_states(spec.replace(seq_len=1, past_len=159), {
                **make_tensors(spec.replace(seq_len=1, past_len=159)), "bias": x["bias"][..., -1:, :]},
                split_size=32, kernel="opencl.decode_partial.f16.m1.bs")


@pytest.mark.parametrize("kernel", ["opencl.prefill.f32.wgmem.bs", "opencl.decode_partial.f32.m2.bs"])
def test_block_skip_per_head_lists(dev, kernel):
    spec = AttentionSpec(batch=2, seq_len=6, past_len=90, num_heads=8, kv_num_heads=2,
                         head_size=32, bias=True, causal=True)
    t = make_tensors(spec, seed=6)
    keep = np.random.default_rng(0).random((2, 8, 1, 4)) < 0.4        # per-head block pattern
    mask = np.repeat(keep, 24, axis=3)[..., :96]
    t["bias"] = np.where(mask, t["bias"], -np.inf).astype(np.float32)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        check_close(spec, s.run(spec, t, kernel=kernel, params={"split_size": 32}
                                if "decode" in kernel else None), t, what=kernel)


# -- NVIDIA-only knobs -----------------------------------------------------------------
def test_ptx_knobs_only_on_nvidia(dev):
    spec = AttentionSpec(seq_len=1, past_len=63, head_size=64, dtype="float16")
    nv = dev.model_copy(update={"features": dev.features | {"subgroups", oprobe.NV_SHUFFLE},
                                "vendor": "nvidia"})
    g = otiles.geometry("decode_fused", "sg", spec, {}, nv)
    assert not g.cvt_ptx and not g.nv_fence          # "auto": the portable OpenCL C ...
    plan = attnreg.explain(spec, caps=nv, kernel="opencl.decode_fused.f16.sg.m1")
    assert plan.params["cvt"] == "ptx" and plan.params["fence"] == "ptx"   # ... the rules: PTX
    g = otiles.geometry("decode_fused", "sg", spec, plan.params, nv)
    assert g.cvt_ptx and g.nv_fence
    g = otiles.geometry("decode_fused", "sg", spec, {"cvt": "cl", "fence": "cl"}, nv)
    assert not g.cvt_ptx and not g.nv_fence
    f32 = attnreg.explain(spec.replace(dtype="float32"), caps=nv,
                          kernel="opencl.decode_fused.f32.sg.m1")
    assert "cvt" not in f32.params
    assert not otiles.geometry("decode_fused", "sg", f32.spec, f32.params, nv).cvt_ptx
    mine = otiles.geometry("decode_fused", "", spec, {"cvt": "ptx", "fence": "ptx"}, dev)
    assert not mine.cvt_ptx and not mine.nv_fence            # never inline PTX off NVIDIA
    with pytest.raises(attnreg.SpecError, match="cvt"):
        otiles.geometry("decode_fused", "", spec, {"cvt": "fast"}, dev)


def test_nvidia_rules_from_the_h100_measurements(dev):
    nv = dev.model_copy(update={"features": dev.features | {"subgroups", oprobe.NV_SHUFFLE},
                                "vendor": "nvidia", "device_type": "gpu", "compute_units": 132,
                                "limits": {**dev.limits, "workgroup_storage": 49152}})

    def decode(L: int, dtype: str = "float16", nq: int = 32, h: int = 128) -> AttentionSpec:
        return AttentionSpec(seq_len=1, past_len=L - 1, num_heads=nq, kv_num_heads=8,
                             head_size=h, dtype=dtype)

    target = attnreg.explain(decode(8192), caps=nv)          # the issue-4 decode
    assert target.kernels == ("opencl.decode_fused.f16.sg.m1",)
    assert target.params["fast_exp"] is True and target.params["n_splits"] == 64
    assert otiles.geometry("decode_fused", "sg", decode(8192), target.params, nv).cvt_ptx
    f32 = attnreg.explain(decode(8192, "float32"), caps=nv)
    assert f32.params["split_size"] == 256 and f32.params["n_splits"] == 32
    assert attnreg.explain(decode(2048, "float32"), caps=nv).params["n_splits"] == 16
    for spec in (decode(8192, nq=64), decode(32768, h=64)):
        plan = attnreg.explain(spec, caps=nv)
        assert plan.route == "split_kv" and "opencl_nvidia_two_launch" in " ".join(plan.rules)
    assert attnreg.explain(decode(4096, nq=64), caps=nv).route == "split_kv_fused"
    forced = attnreg.explain(decode(8192, nq=64), caps=nv, flags={"route": "split_kv_fused"})
    assert forced.route == "split_kv_fused"
