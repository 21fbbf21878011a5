"""WebGPU device-resident tensors: real device buffers, no host copies for resident inputs,
launches prepared once per (plan, buffers), f16 strips at odd offsets, and freeing."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.backends.webgpu import copy_probe
from attnreg.testing import compare, expected
from tests.support import check_close, make_tensors, require_devices


@pytest.fixture(scope="module")
def session():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


def _runtime(s: attnreg.Session):
    rt = s.device_runtime(s.home_device())
    assert hasattr(rt, "alloc"), "the WebGPU runtime keeps tensors on the device"
    return rt


def test_tensors_are_device_buffers(session):
    rt = _runtime(session)
    t = session.tensor(np.arange(80, dtype=np.float32).reshape(1, 1, 10, 8))
    assert type(t.handle).__name__ == "GPUBuffer" and t.handle.size == 320
    odd = session.empty((3,), "float16")
    assert odd.handle.size == 8                       # 6 bytes rounded up to 4
    np.testing.assert_array_equal(t.numpy().reshape(-1), np.arange(80, dtype=np.float32))
    before = rt.counters["frees"]
    t.free()
    assert t.freed and rt.counters["frees"] == before + 1
    with pytest.raises(attnreg.SpecError, match="live DeviceTensor"):
        spec = attnreg.AttentionSpec(seq_len=1, past_len=9, head_size=8)
        session.run(spec, {"q": np.zeros(spec.q_shape, np.float32), "k": t, "v": t})


@pytest.mark.parametrize("offset,count", [(1, 3), (0, 5), (7, 1), (2, 4), (333, 301), (4, 0)])
def test_f16_strips_at_any_offset(session, offset, count):
    """Odd element offsets and odd counts need a 16-bit patch (writeBuffer takes 4-byte
    offsets and sizes); neighbours of the strip keep their values."""
    n = 1000
    rng = np.random.default_rng(offset)
    base = rng.standard_normal(n).astype(np.float16)
    t = session.tensor(base)
    strip = rng.standard_normal(count).astype(np.float16)
    t.write(strip, offset_elems=offset)
    want = base.copy()
    want[offset:offset + count] = strip
    np.testing.assert_array_equal(t.numpy(), want)
    if count:
        t.write(strip[:1], offset_elems=n - 1)         # the last element of the buffer
        want[n - 1] = strip[0]
        np.testing.assert_array_equal(t.numpy(), want)


def test_f16_single_element_appends(session):
    """Element-by-element f16 writes (every other one at an odd offset) stay exact."""
    t = session.empty((2, 9), "float16")
    t.write(np.zeros(18, np.float16))
    host = np.zeros(18, np.float16)
    for i in range(18):
        v = np.float16(i + 0.5)
        t.write(np.array([v]), offset_elems=i)
        host[i] = v
    np.testing.assert_array_equal(t.numpy().reshape(-1), host)
    assert _runtime(session).counters["patch16"] > 0


def _decode_setup(s: attnreg.Session, L: int = 40, dtype: str = "float16"):
    rng = np.random.default_rng(3)
    cache = s.kv_cache(batch=2, kv_num_heads=2, head_size=32, capacity=64, dtype=dtype)
    kv = rng.standard_normal((2, L, 2, 32)).astype(dtype)
    cache.append(kv, kv)
    spec = cache.spec(num_heads=8, seq_len=1, causal=True)
    q = s.tensor(rng.standard_normal(spec.q_shape).astype(dtype))
    out = s.empty(spec.out_shape, dtype)
    return cache, spec, q, out


def test_decode_loop_makes_no_host_copies(session):
    """Resident q/k/v/seqlens and out=: after the first step no upload, no read-back, no new
    bind group or parameter block; one submit per step."""
    rt = _runtime(session)
    cache, spec, q, out = _decode_setup(session)
    session.run(spec, cache.tensors(q), out=out)
    before = dict(rt.counters)
    for _ in range(5):
        assert session.run(spec, cache.tensors(q), out=out) is out
    c = rt.counters
    for name in ("host_uploads", "readbacks", "prepares", "bind_groups"):
        assert c[name] == before.get(name, 0), name
    assert c["submits"] == before["submits"] + 5
    assert c["prepared_hits"] == before.get("prepared_hits", 0) + 5


def test_bind_groups_reused_across_appends(session):
    """Appending writes through upload() into the same buffers: the prepared launch (bind
    groups, parameter block) is reused and the results follow the cache contents."""
    rt = _runtime(session)
    rng = np.random.default_rng(4)
    cache, spec, q, out = _decode_setup(session, L=20, dtype="float32")
    ks = [cache.k.numpy(), cache.v.numpy()]
    session.run(spec, cache.tensors(q), out=out)
    groups = rt.counters["bind_groups"]
    for _ in range(3):
        kn = rng.standard_normal((2, 1, 2, 32)).astype(np.float32)
        cache.append(kn, -kn)
        session.run(spec, cache.tensors(q), out=out)
        host = {"q": q.numpy(), "k": cache.k.numpy(), "v": cache.v.numpy(),
                "seqlens_k": cache.lengths.copy()}
        _, problem = compare(spec, out.numpy(), expected(spec, host))
        assert not problem
    assert rt.counters["bind_groups"] == groups
    assert not np.array_equal(ks[0], cache.k.numpy())


def test_freed_buffer_forgets_prepared_launches(session):
    rt = _runtime(session)
    spec = attnreg.AttentionSpec(seq_len=3, past_len=30, num_heads=4, kv_num_heads=2,
                                 head_size=32, return_lse=True)
    t = make_tensors(spec, 9)
    k = session.tensor(t["k"])
    got = session.run(spec, {**t, "k": k})
    check_close(spec, got, t)
    prepared = len(rt._prepared)
    k.free()
    assert len(rt._prepared) < prepared
    t2 = make_tensors(spec, 10)
    k2 = session.tensor(t2["k"])              # may reuse the freed buffer's address
    check_close(spec, session.run(spec, {**t2, "k": k2}), t2)


def test_host_inputs_reuse_the_prepared_launch(session):
    rt = _runtime(session)
    spec = attnreg.AttentionSpec(seq_len=1, past_len=50, num_heads=4, kv_num_heads=1,
                                 head_size=64, dtype="float16", bias=True)
    t = make_tensors(spec, 12)
    check_close(spec, session.run(spec, t), t)
    prepares = rt.counters["prepares"]
    t2 = make_tensors(spec, 13)
    check_close(spec, session.run(spec, t2), t2)
    assert rt.counters["prepares"] == prepares
    big = spec.replace(past_len=500)            # staging buffers grow: launches re-prepared
    t3 = make_tensors(big, 14)
    check_close(big, session.run(big, t3), t3)
    check_close(spec, session.run(spec, t2), t2)


def test_f16_device_bias_is_widened_once(session):
    rt = _runtime(session)
    spec = attnreg.AttentionSpec(seq_len=2, past_len=40, num_heads=4, kv_num_heads=2,
                                 head_size=32, dtype="float16", bias=True)
    t = make_tensors(spec, 15)
    t["bias"] = t["bias"].astype(np.float16)
    bias = session.tensor(t["bias"])
    check_close(spec, session.run(spec, {**t, "bias": bias}), t)
    allocs = rt.counters["allocs"]
    check_close(spec, session.run(spec, {**t, "bias": bias}), t)
    assert rt.counters["allocs"] == allocs
    t["bias"][:, :, :, :5] = -np.inf
    bias.write(t["bias"])
    check_close(spec, session.run(spec, {**t, "bias": bias}), t)


def test_lse_comes_back_when_out_stays(session):
    spec = attnreg.AttentionSpec(seq_len=1, past_len=30, num_heads=4, kv_num_heads=2,
                                 head_size=32, return_lse=True)
    t = make_tensors(spec, 16)
    out = session.empty(spec.out_shape, "float32")
    got, lse = session.run(spec, t, out=out)
    assert got is out
    check_close(spec, (out.numpy(), lse), t)


def test_copy_bandwidth(session):
    rt = _runtime(session)
    both = copy_probe.copy_bandwidths(rt.memory, nbytes=8 << 20, repeats=2)
    assert set(both) == ({"command", "shader"} if rt.dev.has_timestamps else {"command"})
    assert all(0.05 < bw < 1e5 for bw in both.values())
    assert 0.05 < rt.copy_bandwidth(nbytes=4 << 20, repeats=1) < 1e5
