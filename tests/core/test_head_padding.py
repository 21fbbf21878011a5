"""Head sizes off every kernel's steps (4, 10, 13, ...) run padded with zero columns
(attnreg/headpad.py): on host arrays, DeviceTensors, KV caches, prepared decode loops, device
outputs, partial states and reduces, on every GPU backend; checked against the float64
reference. Also the device primitive under it, Runtime.copy_rows, at any byte pitch."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import headpad
from attnreg.spec import AttentionSpec
from tests.support import QUICK, check_close, make_tensors, require_devices

GPU = ("webgpu", "dawn", "opencl")


def _spec(h: int, hv: int | None = None, **kw: object) -> AttentionSpec:
    fields: dict = dict(batch=2, seq_len=3, past_len=20, num_heads=4, kv_num_heads=2,
                        head_size=h, v_head_size=hv, dtype="float32", causal=True)
    fields.update(kw)
    return AttentionSpec(**fields)


@pytest.mark.parametrize("backend", GPU)
@pytest.mark.parametrize("h,hv,dtype,s", [(4, None, "float32", 1), (10, None, "float16", 5),
                                         (13, 5, "bfloat16", 33), (4, 10, "float16", 1),
                                         (1, 3, "float32", 2)])
def test_odd_head_sizes_run_padded(backend: str, h: int, hv: int | None, dtype: str,
                                   s: int) -> None:
    require_devices(backend)
    spec = _spec(h, hv, dtype=dtype, seq_len=s, bias=True, seqlens_k=True, head_sink=True,
                 return_lse=True, kv_capacity=s + 30, past_len=24)
    t = make_tensors(spec, seed=h * 7 + s, lengths=(s + 24, s + 3))
    with attnreg.Session(backend=backend) as sess:
        out, plan = sess.run_with_plan(spec, t)
        check_close(spec, out, t, what=plan.kernel)
        text = plan.explain()
        assert f"spec:    {spec!r}" in text
        if plan.request is None:          # a kernel of this backend takes the sizes as they are
            assert plan.spec == spec and "head_padding" not in text
            assert h % 4 == 0 and (hv or h) % 4 == 0
            return
        assert plan.request == spec and plan.spec.head_size >= h
        assert plan.spec.effective_scale == spec.effective_scale
        assert "head_padding" in text and f"head_size {h} ->" in text


@pytest.mark.parametrize("backend", GPU)
def test_native_head_sizes_do_not_pad(backend: str) -> None:
    require_devices(backend)
    plan = attnreg.explain(_spec(64), backend=backend)
    assert plan.request is None and "head_padding" not in plan.explain()


@pytest.mark.parametrize("backend", GPU)
def test_resident_decode_loop_pads_on_the_device(backend: str) -> None:
    """A KV cache of head size 10 (v 6), appended and attended in a prepared loop with the
    output kept on the device: each step copies K/V into their padded twins on the device
    and moves nothing else through the host than the appended tokens."""
    require_devices(backend)
    rng = np.random.default_rng(3)
    h, hv, cap = 10, 6, 24
    with attnreg.Session(backend=backend) as sess:
        cache = sess.kv_cache(batch=1, kv_num_heads=2, head_size=h, v_head_size=hv,
                              capacity=cap, dtype="float16")
        ks = rng.standard_normal((1, cap, 2, h)).astype(np.float16)
        vs = rng.standard_normal((1, cap, 2, hv)).astype(np.float16)
        cache.append(ks[:, :8], vs[:, :8])
        spec = cache.spec(num_heads=4)
        q = sess.tensor(rng.standard_normal(spec.q_shape).astype(np.float16))
        out = sess.empty(spec.out_shape, "float16")
        step = sess.prepare(spec, cache.tensors(q), out=out)
        assert step.plan.request is not None
        rt = sess.runtime(step.plan)
        for n in range(8, 12):
            cache.append(ks[:, n:n + 1], vs[:, n:n + 1])
            before = dict(rt.counters)
            assert step() is out
            moved = {c: rt.counters[c] - before.get(c, 0) for c in ("host_uploads", "readbacks")}
            assert moved == {"host_uploads": 0, "readbacks": 0}, moved
            want = {"q": q.numpy(), "k": ks.transpose(0, 2, 1, 3) if spec.kv_layout == "BNSH"
                    else ks, "v": vs.transpose(0, 2, 1, 3) if spec.kv_layout == "BNSH" else vs,
                    "seqlens_k": np.array([n + 1], np.int32)}
            check_close(spec, out.numpy(), want, what=f"step {n}")


@pytest.mark.parametrize("backend", GPU)
def test_partials_and_reduce_of_odd_v_head_size(backend: str) -> None:
    require_devices(backend)
    spec = _spec(12, 5, seq_len=2, past_len=40)
    t = make_tensors(spec, seed=11)
    o, lse = attnreg.partial_states(spec, t, split_size=16, backend=backend)
    ro, rlse = attnreg.partial_states(spec, t, split_size=16, backend="reference")
    assert o.shape == ro.shape and o.shape[-1] == 5
    np.testing.assert_allclose(o, ro, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, rlse, atol=2e-4)
    out = attnreg.reduce_states(spec, ro, rlse, backend=backend)
    check_close(spec, out, t, what="reduce")


@pytest.mark.parametrize("backend", (*GPU, "reference"))
@pytest.mark.parametrize("rows,row_bytes,src_pitch,dst_pitch", [
    (7, 10, 10, 16), (7, 10, 16, 10), (3, 6, 6, 8), (5, 20, 20, 32), (9, 3, 3, 5), (1, 2, 2, 2)])
def test_copy_rows_any_pitch(backend: str, rows: int, row_bytes: int, src_pitch: int,
                             dst_pitch: int) -> None:
    """Runtime.copy_rows against numpy: data where it belongs, zeros in every padding byte
    (the destination starts full of garbage)."""
    if backend != "reference":
        require_devices(backend)
    rng = np.random.default_rng(rows * 31 + dst_pitch)
    src = rng.integers(1, 255, rows * src_pitch, dtype=np.uint8)
    with attnreg.Session(backend=backend) as sess:
        a = sess.tensor(src)
        b = sess.tensor(np.full(rows * dst_pitch, 0xEE, np.uint8))
        sess.runtime(sess.plan(_spec(64))).copy_rows(a.handle, b.handle, rows, row_bytes,
                                                     src_pitch, dst_pitch)
        got = b.numpy().reshape(rows, dst_pitch)
    want = np.zeros((rows, dst_pitch), np.uint8)
    want[:, :row_bytes] = src.reshape(rows, src_pitch)[:, :row_bytes]
    np.testing.assert_array_equal(got, want)


def test_padding_choices_are_rules() -> None:
    """The candidates come from the kernels' declared steps, nearest first; int4 never pads."""
    reg = attnreg.registry.get()
    ks = reg.kernels("webgpu")
    pairs = attnreg.rules.head_padding(_spec(10, 5), ks)
    assert (16, 8) in pairs and all(a >= 10 and b >= 5 for a, b in pairs)
    dist = [a + b for a, b in pairs]
    assert dist == sorted(dist)
    plan = attnreg.explain(_spec(10, 5), backend="webgpu")
    assert (plan.spec.head_size, plan.spec.head_size_v) == (16, 8)
    assert attnreg.rules.head_padding(_spec(64, kv_dtype="int4"), ks) == []
    padded = headpad.padded_spec(_spec(10, 5), 16, 8)
    assert (padded.head_size, padded.head_size_v, padded.scale) == (16, 8, 1 / np.sqrt(10))


def test_export_refuses_a_padded_plan(tmp_path) -> None:
    """An exported module binds the web app's buffers as they are: it never pads silently."""
    from attnreg.backends.browser import export
    with pytest.raises(attnreg.SpecError, match=r"head_size=10.*padded to 16/16"):
        export.export(_spec(10, dtype="float16"), str(tmp_path))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ("webgpu", "opencl", "browser"))
def test_every_head_size_the_reference_takes_plans(backend: str) -> None:
    """No NoKernelError for any head size of the contract: q/k 1..576 (v alike to 512) and v
    1..512 beside q/k 64 and 576, in float16 and float32 (planning only: the padded launches
    themselves run in the tests above and the padded cells). Dawn declares the webgpu
    backend's kernels."""
    devs = require_devices(backend)
    reg = attnreg.registry.get()
    # the quick matrix (CI): every size to 80 and past 500, between them every 7th (all
    # residues of the kernels' steps); the full one every size
    sizes = range(1, 577) if not QUICK else sorted(
        {*range(1, 81), *range(81, 501, 7), *range(501, 577)})
    pairs = [(h, None if h <= 512 else 512) for h in sizes] + \
        [(k, v) for k in (64, 576) for v in sizes if v <= 512]
    dtypes = [d for d in ("float16", "float32") if d == "float32" or backend == "opencl"
              or "shader-f16" in devs[0].features]
    for dtype in dtypes[:1] if QUICK else dtypes:
        for h, hv in pairs:
            spec = AttentionSpec(batch=1, seq_len=1, past_len=30, num_heads=2, kv_num_heads=1,
                                 head_size=h, v_head_size=hv, dtype=dtype)
            plan = reg.plan(spec, caps=devs[0])
            assert plan.spec.head_size >= h and plan.spec.head_size_v >= spec.head_size_v
