"""Every backend's runtime implements the whole runtime contract (attnreg.Runtime, with its
memory half attnreg.memory.Memory): memory round trips, launches into device outputs,
timings, the copy roof and counters, and refusals that the Session honours (a write the
memory cannot make, a K/V storage it cannot quantize into) -- checked on each backend's real
device, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.memory import Memory
from tests.support import check_close, make_tensors, require_devices

BACKENDS = ("reference", "webgpu", "opencl", "browser", "dawn")
SPEC = attnreg.AttentionSpec(batch=1, seq_len=2, past_len=40, num_heads=4, kv_num_heads=2,
                             head_size=32, causal=True, return_lse=True)


@pytest.fixture(scope="module", params=BACKENDS)
def session(request: pytest.FixtureRequest):
    require_devices(request.param)
    with attnreg.Session(backend=request.param) as s:
        yield s


def test_runtime_is_the_protocol(session: attnreg.Session) -> None:
    rt = session.runtime(session.plan(SPEC))
    assert isinstance(rt, attnreg.Runtime) and isinstance(rt, Memory)
    assert session.device_runtime(rt.caps.id) is rt
    for name in ("launch", "timings", "alloc", "upload", "download", "free", "copy_bandwidth",
                 "matrix_peak", "close", "copy_rows", "write_refusal", "quantize_refusal", "quantize_into"):
        assert callable(getattr(type(rt), name, None)), name
    assert isinstance(rt.counters, dict)


def test_memory_round_trip(session: attnreg.Session) -> None:
    rt = session.runtime(session.plan(SPEC))
    data = np.arange(64, dtype=np.float32)
    h = rt.alloc(data.nbytes)
    rt.upload(h, data)
    rt.upload(h, np.full(8, -1.0, np.float32), 16 * 4)          # a strip at an offset
    want = data.copy()
    want[16:24] = -1.0
    got = np.frombuffer(rt.download(h, data.nbytes), np.float32)
    assert np.array_equal(got, want)
    rt.free(h)


def test_launch_into_a_device_output(session: attnreg.Session) -> None:
    t = make_tensors(SPEC, seed=3)
    q = session.tensor(t["q"])
    out = session.empty(SPEC.out_shape, SPEC.dtype)
    rt = session.runtime(session.plan(SPEC))
    before = rt.counters["launches"]
    got, lse = session.run(SPEC, {**t, "q": q}, out=out)
    assert got is out and rt.counters["launches"] == before + 1
    check_close(SPEC, (out.numpy(), lse), t, what=session.plan(SPEC).kernel)


def test_timings_and_roof(session: attnreg.Session) -> None:
    t = make_tensors(SPEC, seed=4, poison=False)
    plan = session.plan(SPEC)
    rt = session.runtime(plan)
    times = rt.timings(plan, attnreg.tensors.check_tensors(SPEC, t), iters=3, warmup=1)
    assert len(times["wall_s"]) == 3 and all(x > 0 for x in times["wall_s"])
    assert all(x > 0 for x in times.get("gpu_s", [1.0]))
    # back to back: the device runtimes measure it (timestamps / events, else wall clock)
    assert session.backend in ("reference", "browser") or times["b2b_s"]
    assert all(x > 0 for x in times.get("b2b_s", [1.0]))
    assert 0.01 < rt.copy_bandwidth(nbytes=4 << 20) < 1e5
    peak, how = rt.matrix_peak()            # a measured rate, or why there is none
    assert how and (peak is None or (peak > 0 and "GEMM probe" in how)), (peak, how)


def test_quantizes_or_says_why(session: attnreg.Session) -> None:
    """quantize_refusal decides: None, and a quantized cache is made and appended to; words,
    and the cache is refused with a SpecError that carries them."""
    rt = session.device_runtime(session.home_device())
    shape = dict(batch=1, kv_num_heads=2, head_size=64, capacity=8)
    for kv_dtype in ("int8", "int4"):
        why = rt.quantize_refusal(kv_dtype, "float16", 64)
        if why is None:
            cache = session.kv_cache(**shape, kv_dtype=kv_dtype)
            cache.append(*(np.ones((1, 3, 2, 64), np.float16),) * 2)
            assert list(cache.lengths) == [3]
        else:
            assert isinstance(why, str) and why
            with pytest.raises(attnreg.SpecError, match="kv_dtype") as err:
                session.kv_cache(**shape, kv_dtype=kv_dtype)
            assert why in str(err.value)


def test_writes_or_says_why(session: attnreg.Session) -> None:
    """write_refusal decides where a write may go: None, and the bytes land there; words,
    and the write is refused with them, leaving the tensor as it was. A write of 2-byte
    elements and one that reaches the tensor's end go through on every runtime."""
    t = session.tensor(np.arange(13, dtype=np.uint8))
    why = t.memory.write_refusal(1, 1, 2, 13)
    if why is None:
        t.write(np.full(2, 99, np.uint8), 1)
        assert list(t.numpy()[:4]) == [0, 99, 99, 3]
    else:
        with pytest.raises(attnreg.SpecError, match="offset_elems") as err:
            t.write(np.full(2, 99, np.uint8), 1)
        assert why in str(err.value) and list(t.numpy()[:4]) == [0, 1, 2, 3]
    assert t.memory.write_refusal(1, 8, 5, 13) is None
    t.write(np.full(5, 7, np.uint8), 8)
    assert list(t.numpy()[7:]) == [7] * 6
    h = session.tensor(np.zeros(7, np.float16))
    assert h.memory.write_refusal(2, 2, 6, 14) is None
    h.write(np.ones(3, np.float16), 1)
    assert list(h.numpy()) == [0, 1, 1, 1, 0, 0, 0]
