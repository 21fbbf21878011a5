"""OpenCL device-resident tensors and plan-once launches: DeviceTensors are bound as they
are (no host copy), out= is written on the device without a read-back or a wait, and a
decode loop re-enqueues one prepared launch (kernel objects and arguments set once)."""

from __future__ import annotations

import numpy as np
import pyopencl as cl

import attnreg
from tests.support import check_close, make_tensors


def _counting_sync(rt, monkeypatch) -> list[int]:
    calls = [0]
    orig = rt.mem.sync

    def sync() -> None:
        calls[0] += 1
        orig()

    monkeypatch.setattr(rt.mem, "sync", sync)
    return calls


def test_tensors_are_device_buffers(dev):
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        t = s.tensor(np.arange(10, dtype=np.float32))
        assert isinstance(t.handle, cl.Buffer) and t.handle.size >= 40
        t.write(np.full(3, 7, np.float32), offset_elems=4)       # a strip at an offset
        want = np.arange(10, dtype=np.float32)
        want[4:7] = 7
        np.testing.assert_array_equal(t.numpy(), want)
        half = s.tensor(np.arange(5, dtype=np.float16))
        half.write(np.array([9], np.float16), offset_elems=3)     # odd element offset
        np.testing.assert_array_equal(half.numpy(), [0, 1, 2, 9, 4])
        t.free()
        assert t.freed


def test_decode_loop_binds_resident_tensors_and_prepares_once(dev, monkeypatch):
    rng = np.random.default_rng(3)
    B, NKV, H, C, NQ = 2, 2, 64, 128, 8
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        cache = s.kv_cache(batch=B, kv_num_heads=NKV, head_size=H, capacity=C, dtype="float16")
        spec = cache.spec(num_heads=NQ)
        out = s.empty(spec.out_shape, "float16")
        qdev = s.tensor(np.zeros(spec.q_shape, np.float16))
        ks, vs = [], []
        rt = None
        for step in range(5):
            kn = rng.standard_normal((B, 3 if step == 0 else 1, NKV, H)).astype(np.float16)
            vn = rng.standard_normal(kn.shape).astype(np.float16)
            cache.append(kn, vn)
            ks.append(kn)
            vs.append(vn)
            q = rng.standard_normal(spec.q_shape).astype(np.float16)
            qdev.write(q)
            if rt is None:
                rt = s.runtime(s.plan(spec))
                syncs = _counting_sync(rt, monkeypatch)
            before = dict(rt.counters)
            nsync = syncs[0]
            assert s.run(spec, cache.tensors(qdev), out=out) is out
            moved = {k: rt.counters[k] - before.get(k, 0)
                     for k in ("host_uploads", "readbacks", "launches", "prepares")}
            assert moved["host_uploads"] == 0 and moved["readbacks"] == 0, moved
            assert syncs[0] == nsync, "a run into a DeviceTensor must not wait"
            assert moved["launches"] == 1
            assert moved["prepares"] == (1 if step == 0 else 0), (step, moved)
            if step == 0:
                first = [ln.kernel for ln in next(iter(rt._preps.values())).launches]
            L = sum(x.shape[1] for x in ks)
            host = {"q": q, "seqlens_k": np.full(B, L, np.int32)}
            for name, parts in (("k", ks), ("v", vs)):
                full = np.full(spec.kv_shape, np.nan, np.float16)
                x = np.concatenate(parts, 1)                       # [B, L, NKV, H]
                if spec.kv_layout == "BSNH":
                    full[:, :L] = x
                else:
                    full[:, :, :L] = x.transpose(0, 2, 1, 3)
                host[name] = full
            check_close(spec, out.numpy(), host, what=f"step {step}")
        # the same kernel objects (arguments set once) served every step
        assert [ln.kernel for ln in next(iter(rt._preps.values())).launches] == first
        assert s.plans_made == 1


def test_host_inputs_with_device_out_are_copied_first(dev):
    spec = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=63, num_heads=4, kv_num_heads=2,
                                 head_size=32, dtype="float32")
    t = make_tensors(spec, seed=11)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        out = s.empty(spec.out_shape, "float32")
        q = t["q"].copy()
        s.run(spec, {**t, "q": q}, out=out)
        q[:] = np.nan                      # the caller reuses its array at once
        check_close(spec, out.numpy(), t)


def test_numpy_runs_reuse_the_prepared_launch(dev):
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=90, num_heads=4, kv_num_heads=2,
                                 head_size=32, return_lse=True)
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        for seed in range(3):
            t = make_tensors(spec, seed=seed)
            check_close(spec, s.run(spec, t), t)
        rt = s.runtime(s.plan(spec))
        assert rt.counters["prepares"] == 1 and rt.counters["launches"] == 3


def test_copy_bandwidth(dev):
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        rt = s.runtime(s.plan(attnreg.AttentionSpec()))
        gbs = rt.mem.copy_bandwidth(nbytes=8 << 20, iters=3)
        assert gbs > 0.1
        assert callable(rt.copy_bandwidth)
