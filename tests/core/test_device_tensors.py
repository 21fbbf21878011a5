"""Device-resident tensors and the static KV cache: a decode loop plans once and its
results match the reference over the cache contents, on every available device."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]


@pytest.mark.parametrize("layout", ["BNSH", "BSNH"])
@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_decode_loop_with_kv_cache(dev: attnreg.DeviceCaps, layout: str) -> None:
    rng = np.random.default_rng(7)
    B, NKV, H, C, NQ = 2, 2, 32, 80, 8
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        cache = s.kv_cache(batch=B, kv_num_heads=NKV, head_size=H, capacity=C, dtype="float16",
                           layout=layout)
        ks, vs = [], []
        for step in range(6):
            n_new = 5 if step == 0 else 1          # a prompt, then single tokens
            kn = rng.standard_normal((B, n_new, NKV, H)).astype(np.float16)
            vn = rng.standard_normal((B, n_new, NKV, H)).astype(np.float16)
            cache.append(kn, vn)
            ks.append(kn)
            vs.append(vn)
            spec = cache.spec(num_heads=NQ, seq_len=1, causal=True)
            q = rng.standard_normal(spec.q_shape).astype(np.float16)
            out = s.empty(spec.out_shape, "float16")
            got = s.run(spec, cache.tensors(s.tensor(q)), out=out)
            assert got is out
            k_all, v_all = np.concatenate(ks, 1), np.concatenate(vs, 1)    # [B, L, NKV, H]
            L = k_all.shape[1]
            host = {"q": q, "seqlens_k": np.full(B, L, np.int32)}
            for name, x in (("k", k_all), ("v", v_all)):
                full = np.full(spec.kv_shape, np.nan, np.float16)
                if layout == "BSNH":
                    full[:, :L] = x
                else:
                    full[:, :, :L] = x.transpose(0, 2, 1, 3)
                host[name] = full
            _, problem = compare(spec, out.numpy(), expected(spec, host))
            assert not problem, f"step {step}: {problem}"
        assert s.plans_made == 1, "a decode loop over a static cache must plan once"
        assert list(cache.lengths) == [10, 10]


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_device_tensor_errors(dev: attnreg.DeviceCaps) -> None:
    with attnreg.Session(backend=dev.backend, device=dev.id) as s, \
            attnreg.Session(backend=dev.backend, device=dev.id) as other:
        cache = s.kv_cache(batch=1, kv_num_heads=1, head_size=16, capacity=4, dtype="float32")
        with pytest.raises(attnreg.SpecError, match="k_new"):
            cache.append(np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 1, 1, 8), np.float32))
        with pytest.raises(attnreg.SpecError, match=r"k_new\.shape"):
            cache.append(np.zeros((1, 5, 1, 16), np.float32), np.zeros((1, 5, 1, 16), np.float32))
        cache.append(np.ones((1, 2, 1, 16), np.float32), np.ones((1, 2, 1, 16), np.float32))
        spec = cache.spec(num_heads=2)
        q = np.ones(spec.q_shape, np.float32)
        with pytest.raises(attnreg.SpecError, match="out"):
            s.run(spec, cache.tensors(q), out=s.empty((1, 1, 2, 8), "float32"))
        with pytest.raises(attnreg.SpecError, match="live DeviceTensor of this Session"):
            other.run(spec, cache.tensors(q))
        with pytest.raises(attnreg.SpecError, match="dtype"):
            s.empty((2, 2), "float64")
        t = s.tensor(np.arange(6, dtype=np.float32))
        np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32))
        with pytest.raises(attnreg.SpecError, match="elements"):
            t.write(np.zeros(4, np.float32), offset_elems=3)
        out = s.run(spec, cache.tensors(q))          # host out when out= is not given
        np.testing.assert_allclose(out, np.ones(spec.out_shape), atol=1e-6)


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_prepared_decode_call_matches_run(dev: attnreg.DeviceCaps) -> None:
    rng = np.random.default_rng(3)
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        cache = s.kv_cache(batch=1, kv_num_heads=2, head_size=32, capacity=40, dtype="float32")
        kv = rng.standard_normal((1, 20, 2, 32)).astype(np.float32)
        cache.append(kv, kv)
        spec = cache.spec(num_heads=4)
        q = s.tensor(rng.standard_normal(spec.q_shape).astype(np.float32))
        out = s.empty(spec.out_shape, "float32")
        call = s.prepare(spec, cache.tensors(q), out=out)
        for _ in range(3):            # the cache grows; the prepared call sees the new length
            one = rng.standard_normal((1, 1, 2, 32)).astype(np.float32)
            cache.append(one, one)
            assert call() is out
            want = s.run(spec, cache.tensors(q))
            np.testing.assert_allclose(out.numpy(), want, atol=1e-6)
        q.free()
        with pytest.raises(attnreg.SpecError, match="freed"):
            call()
