"""Sessions on the caller's device, on the caller's buffers, recorded into the caller's
command stream (docs/interop.md), on every backend that runs on device objects (webgpu and
dawn on lavapipe, opencl on PoCL in CI): results against the float64 reference, no host
transfer in a recorded launch, the caller's buffers never freed, and every refusal a
SpecError naming what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import registry
from attnreg.hookspecs import Interop
from tests.support import check_close, make_tensors, require_devices

BACKENDS = ("webgpu", "dawn", "opencl")
# One spec throughout (one set of programs per backend): a decode step over a cache with
# per-batch lengths, so int32 tensors are wrapped too.
SPEC = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=47, num_heads=4, kv_num_heads=2,
                             head_size=32, dtype="float16", kv_capacity=48, seqlens_k=True,
                             causal=True)


class Engine:
    """A backend's device object as an engine holds it, its buffers, and a Session on it."""

    def __init__(self, backend: str) -> None:
        caps = require_devices(backend)[0]
        interop = registry.get().interop(backend)
        assert interop is not None, backend
        self.backend, self.interop = backend, interop
        self.obj = interop.device(caps, {})
        self.session = attnreg.Session(backend=backend, device=self.obj)

    def buffer(self, array: np.ndarray) -> Any:
        return self.interop.buffer(self.obj, array)

    def wrapped(self, t: dict[str, np.ndarray]) -> dict[str, attnreg.DeviceTensor]:
        return {n: self.session.wrap(self.buffer(a), a.shape, a.dtype.name) for n, a in t.items()}


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    e = Engine(request.param)
    yield e
    e.session.close()


def _moved(counters: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {n: counters[n] - before.get(n, 0) for n in ("host_uploads", "readbacks")}


def test_runs_and_records_on_the_callers_buffers(engine: Engine) -> None:
    """run() and a recorded launch on wrapped inputs (k at an offset into a bigger buffer)
    match the reference; the recorded one moves nothing between host and device."""
    s, t = engine.session, make_tensors(SPEC, seed=5)
    assert s.explain(SPEC).caps.id.startswith(f"{engine.backend}:caller")
    w = engine.wrapped({n: a for n, a in t.items() if n != "k"})
    pad = 256 // t["k"].itemsize                     # WebGPU's and PoCL's offset alignments
    w["k"] = s.wrap(engine.buffer(np.concatenate([np.zeros(pad, np.float16), t["k"].ravel()])),
                    t["k"].shape, "float16", offset=256,
                    strides=tuple(b // 2 for b in np.ascontiguousarray(t["k"]).strides))
    out = s.wrap(engine.buffer(np.zeros(SPEC.out_shape, np.float16)), SPEC.out_shape, "float16")
    assert s.run(SPEC, w, out=out) is out
    check_close(SPEC, out.numpy(), t, what="run on wrapped buffers")
    prepared = s.prepare(SPEC, w, out=out)
    out.write(np.full(SPEC.out_shape, np.nan, np.float16))
    counters = prepared.runtime.counters
    before = dict(counters)
    engine.interop.submit(engine.obj, prepared.encode)
    engine.interop.wait(engine.obj)
    assert _moved(counters, before) == {"host_uploads": 0, "readbacks": 0}
    assert counters["recorded"] == before.get("recorded", 0) + 1
    check_close(SPEC, out.numpy(), t, what="recorded into the caller's stream")


def test_records_into_the_callers_compute_pass() -> None:
    """WebGPU: the dispatches go into a pass the caller began, between its own."""
    e = Engine("webgpu")
    with e.session as s:
        t = make_tensors(SPEC, seed=9)
        out = s.wrap(e.buffer(np.zeros(SPEC.out_shape, np.float16)), SPEC.out_shape, "float16")
        prepared = s.prepare(SPEC, e.wrapped(t), out=out)
        out.write(np.full(SPEC.out_shape, np.nan, np.float16))
        enc = e.obj.create_command_encoder()
        cp = enc.begin_compute_pass()
        prepared.encode(cp)
        cp.end()
        e.obj.queue.submit([enc.finish()])
        check_close(SPEC, out.numpy(), t, what="recorded into the caller's compute pass")


def test_wrap_names_what_is_wrong(engine: Engine) -> None:
    s = engine.session
    buf = engine.buffer(np.zeros(64, np.float32))
    for kw, field in ((dict(buffer=np.zeros(64, np.float32)), "buffer"),
                      (dict(shape=(65,)), "buffer"),
                      (dict(offset=4), "offset"),
                      (dict(shape=(8, 8), strides=(1, 8)), "strides"),
                      (dict(dtype="float64"), "dtype"),
                      (dict(shape=(0,)), "shape")):
        args = {"buffer": buf, "shape": (64,), "dtype": "float32", **kw}
        with pytest.raises(attnreg.SpecError) as err:
            s.wrap(args.pop("buffer"), args.pop("shape"), args.pop("dtype"), **args)
        assert err.value.field.startswith(field), (kw, err.value)


def test_the_callers_buffers_are_never_freed(engine: Engine) -> None:
    """free() and close() let go of a wrapped buffer; its owner's data stays."""
    data = np.arange(64, dtype=np.float32)
    buf = engine.buffer(data)
    with attnreg.Session(backend=engine.backend, device=engine.obj) as s:
        t = s.wrap(buf, (64,), "float32")
        t.free()
        s.wrap(buf, (64,), "float32")
    again = engine.session.wrap(buf, (64,), "float32")
    assert np.array_equal(again.numpy(), data)


# dawn keeps its tensors in the webgpu backend's memory; a paged program on PoCL costs ~5 s
@pytest.mark.parametrize("engine,layout", [("webgpu", "BSNH"), ("webgpu", "paged"),
                                           ("opencl", "BSNH")], indirect=["engine"])
def test_kv_cache_over_the_callers_pools(engine: Engine, layout: str) -> None:
    """A cache over the engine's K/V buffers: appends land in them, runs read them."""
    s, rng = engine.session, np.random.default_rng(2)
    paged = dict(page_size=16, num_pages=6,
                 block_table=np.array([[5, 0, 3], [1, 4, 2]], np.int32)) if layout == "paged" else {}
    pool = (6, 16, 2, 32) if paged else (2, 48, 2, 32)
    k, v = (s.wrap(engine.buffer(np.zeros(pool, np.float16)), pool, "float16") for _ in "kv")
    cache = s.kv_cache(batch=2, kv_num_heads=2, head_size=32, capacity=48, dtype="float16",
                       layout=layout, k=k, v=v, **paged)
    kn = rng.standard_normal((2, 40, 2, 32)).astype(np.float16)
    cache.append(kn, -kn)
    spec = cache.spec(num_heads=4, causal=True)
    q = rng.standard_normal(spec.q_shape).astype(np.float16)
    got = s.run(spec, cache.tensors(s.tensor(q)))
    host = {"q": q, "k": cache.k.numpy(), "v": cache.v.numpy(), "seqlens_k": cache.lengths}
    if paged:
        host["block_table"] = paged["block_table"]
        assert np.array_equal(k.numpy()[5, :16], kn[0, :16])       # batch 0's first page
    check_close(spec, got, host, what=f"a cache over the caller's {layout} pools")
    with pytest.raises(attnreg.SpecError, match=r"^k="):         # a pool of another shape
        s.kv_cache(batch=2, kv_num_heads=2, head_size=64, capacity=48, layout=layout, k=k,
                   **paged)


def test_recording_needs_everything_on_the_device(engine: Engine) -> None:
    s, t = engine.session, make_tensors(SPEC, seed=6)
    w = engine.wrapped(t)
    out = s.wrap(engine.buffer(np.zeros(SPEC.out_shape, np.float16)), SPEC.out_shape, "float16")
    record = lambda p, stream: p.encode(stream)       # noqa: E731
    for prepared, field in ((s.prepare(SPEC, w), "out"),
                            (s.prepare(SPEC, {**w, "q": t["q"]}, out=out), "tensors['q']")):
        with pytest.raises(attnreg.SpecError) as err:
            engine.interop.submit(engine.obj, lambda stream, p=prepared: record(p, stream))
        assert err.value.field == field
    with pytest.raises(attnreg.SpecError) as err:
        s.prepare(SPEC, w, out=out).encode(object())
    assert err.value.field == "stream"


def test_device_objects_attnreg_cannot_run_on() -> None:
    require_devices("webgpu")
    with pytest.raises(attnreg.SpecError) as err:
        attnreg.Session(device=object())
    assert err.value.field == "backend"
    for backend in ("webgpu", "reference"):
        with pytest.raises(attnreg.SpecError) as err:
            attnreg.Session(backend=backend, device=object())
        assert err.value.field == "device"


def test_caps_as_the_caller_requested_them() -> None:
    """A device requested without features: planned for as it is (float32 kernels, no
    subgroups), explain says what its adapter would also have offered."""
    require_devices("webgpu")
    import wgpu

    adapter = wgpu.gpu.request_adapter_sync()
    with attnreg.Session(backend="webgpu", device=adapter.request_device_sync()) as s:
        plan = s.explain(SPEC.replace(dtype="float32"))
        assert not plan.caps.features & {"shader-f16", "subgroups"}
        assert all("sg" not in k.split(".") for k in plan.kernels), plan.kernels
        assert "its adapter also offers" in plan.explain()
        with pytest.raises(attnreg.NoKernelError, match="shader-f16"):
            s.explain(SPEC)


def test_webgpu_out_shares_no_buffer_with_an_input() -> None:
    e = Engine("webgpu")
    with e.session as s:
        t = make_tensors(SPEC, seed=7, poison=False)
        w = e.wrapped(t)
        both = e.buffer(np.zeros(4096, np.uint8))
        w["q"] = s.wrap(both, SPEC.q_shape, "float16")
        out = s.wrap(both, SPEC.out_shape, "float16", offset=2048)
        with pytest.raises(attnreg.SpecError) as err:
            s.run(SPEC, w, out=out)
        assert err.value.field == "out"


def test_dawn_says_a_destroyed_buffer_was_destroyed() -> None:
    """Dawn refuses a submit that uses a destroyed buffer: a SpecError naming the wrapped
    tensor (wgpu-native aborts instead, docs/interop.md)."""
    e = Engine("dawn")
    with e.session as s:
        t = make_tensors(SPEC, seed=8, poison=False)
        w = e.wrapped(t)
        out = s.wrap(e.buffer(np.zeros(SPEC.out_shape, np.float16)), SPEC.out_shape, "float16")
        call = s.prepare(SPEC, w, out=out)
        w["v"].handle.buffer.destroy()
        with pytest.raises(attnreg.SpecError, match="destroyed") as err:
            call()
        assert "'v'" in err.value.field


def test_an_opencl_queue_must_run_in_order() -> None:
    require_devices("opencl")
    import pyopencl as cl

    interop: Interop | None = registry.get().interop("opencl")
    assert interop is not None
    queue = interop.device(require_devices("opencl")[0], {})
    ooo = cl.CommandQueue(queue.context, queue.device,
                          properties=cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE)
    with pytest.raises(attnreg.SpecError, match="in-order"):
        attnreg.Session(backend="opencl", device=ooo)
