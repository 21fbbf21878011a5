"""Every backend's runtime implements the whole runtime contract (attnreg.Runtime): memory
round trips, launches into device outputs, timings, the copy roof and counters -- checked on
each backend's real device, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
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
    assert isinstance(rt, attnreg.Runtime)
    for name in ("launch", "timings", "alloc", "upload", "download", "free", "copy_bandwidth",
                 "close"):
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
    assert 0.01 < rt.copy_bandwidth(nbytes=4 << 20) < 1e5
