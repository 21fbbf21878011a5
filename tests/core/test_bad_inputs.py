"""A table of bad inputs run against every available device's Session: each is a SpecError
naming the field, and a correct run in the same Session follows (device stays usable)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.testing import make_tensors
from tests.support import check_close

DEVICES = [d for d in attnreg.devices() if d.available]
SPEC = attnreg.AttentionSpec(batch=2, seq_len=2, past_len=14, num_heads=4, kv_num_heads=2,
                             head_size=32, dtype="float32", seqlens_k=True, bias=True,
                             head_sink=True, kv_capacity=20)


def _t(**changes: Any) -> dict[str, Any]:
    t: dict[str, Any] = make_tensors(SPEC, seed=1, lengths=[20, 9])
    for k, v in changes.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v(t) if callable(v) else v
    return t


def _spec(**changes: Any) -> Callable[[attnreg.Session], Any]:
    return lambda s: s.run(SPEC.replace(**changes), _t())


def _run(**changes: Any) -> Callable[[attnreg.Session], Any]:
    return lambda s: s.run(SPEC, _t(**changes))


def _other_kernel(s: attnreg.Session) -> Any:
    # A kernel of a different backend than the session's device.
    mine = s.plan(SPEC).backend
    others = [k for k in attnreg.kernels() if k.backend != mine]
    if not others:
        raise attnreg.SpecError("kernel", None, "skip: only one backend is installed")
    return s.run(SPEC, _t(), kernel=others[0].id)


def _dtype_mismatched_kernel(s: attnreg.Session) -> Any:
    mine = s.plan(SPEC).backend
    k16 = [k for k in attnreg.kernels(mine) if k.dtypes == frozenset({"float16"})]
    if not k16:
        raise attnreg.SpecError("kernel", None, "skip: backend has no f16-only kernel")
    return s.run(SPEC, _t(), kernel=k16[0].id)


# Keys for a K of almost 2**31 elements (8 GiB in float32): the most a spec may ask for.
BIG_C = 2**21 - 8


def _too_big_for_device(s: attnreg.Session) -> Any:
    # More keys than any storage binding of a GPU-ish device allows: must be refused by the
    # plan, before any allocation.
    big = SPEC.replace(kv_capacity=BIG_C, head_size=256, bias=False, seqlens_k=False,
                       head_sink=False, past_len=BIG_C - 2)
    return s.plan(big)


def _cache_past_binding(s: attnreg.Session) -> Any:
    """A KV cache one key past the device's storage-binding limit: refused before it is
    allocated (a 144 MiB cache on lavapipe allocated, then every plan failed)."""
    limit = s.binding_limit(s.home_device())
    if limit is None:
        raise attnreg.SpecError("capacity", None, "skip: no binding limit (the numpy reference)")
    return s.kv_cache(batch=1, kv_num_heads=8, head_size=128, dtype="float32",
                      capacity=limit // (8 * 128 * 4) + 1)


def _o_parts(**kw: Any) -> Callable[[attnreg.Session], Any]:
    def go(s: attnreg.Session) -> Any:
        o = np.zeros((2, 4, 2, 3, 32), np.float32)
        lse = np.zeros((2, 4, 2, 3), np.float32)
        args = {"o_parts": o, "lse_parts": lse, "head_sink": np.zeros(4, np.float32), **kw}
        return s.reduce_states(SPEC, args["o_parts"], args["lse_parts"], args["head_sink"])
    return go


CASES: list[tuple[str, Callable[[attnreg.Session], Any], str]] = [
    ("q-missing", _run(q=None), "tensors['q']"),
    ("v-missing", _run(v=None), "tensors['v']"),
    ("extra-tensor", _run(mask=np.zeros(1)), "tensors['mask']"),
    ("q-float64", _run(q=lambda t: t["q"].astype(np.float64)), "tensors['q'].dtype"),
    ("k-float16", _run(k=lambda t: t["k"].astype(np.float16)), "tensors['k'].dtype"),
    ("q-bnsh-given", _run(q=lambda t: np.ascontiguousarray(t["q"].transpose(0, 2, 1, 3))),
     "tensors['q'].shape"),
    ("k-bsnh-given", _run(k=lambda t: np.ascontiguousarray(t["k"].transpose(0, 2, 1, 3))),
     "tensors['k'].shape"),
    ("v-short", _run(v=lambda t: t["v"][:, :, :19]), "tensors['v'].shape"),
    ("q-extra-dim", _run(q=lambda t: t["q"][None]), "tensors['q'].shape"),
    ("seqlens-float", _run(seqlens_k=np.array([20, 9], np.float32)), "tensors['seqlens_k'].dtype"),
    # int64 lengths are read (docs/contract.md "Shapes real models need") after a range check,
    # never wrapped to int32
    ("seqlens-int64-huge", _run(seqlens_k=np.array([20, 2**32 + 9], np.int64)),
     "tensors['seqlens_k'][1]"),
    ("seqlens-over-capacity", _run(seqlens_k=np.array([21, 9], np.int32)), "tensors['seqlens_k'][0]"),
    ("seqlens-zero", _run(seqlens_k=np.array([20, 0], np.int32)), "tensors['seqlens_k'][1]"),
    ("seqlens-under-seq-len", _run(seqlens_k=np.array([1, 9], np.int32)), "tensors['seqlens_k'][0]"),
    ("seqlens-missing", _run(seqlens_k=None), "tensors['seqlens_k']"),
    ("bias-not-broadcastable", _run(bias=np.zeros((2, 2, 2, 20), np.float32)), "tensors['bias'].shape"),
    ("bias-2d", _run(bias=np.zeros((2, 20), np.float32)), "tensors['bias'].shape"),
    ("bias-float64", _run(bias=lambda t: t["bias"].astype(np.float64)), "tensors['bias'].dtype"),
    ("sink-shape", _run(head_sink=np.zeros(2, np.float32)), "tensors['head_sink'].shape"),
    ("sink-nan", _run(head_sink=np.full(4, np.nan, np.float32)), "tensors['head_sink'][0]"),
    ("spec-zero-batch", lambda s: SPEC.replace(batch=0), "batch"),
    ("spec-negative-heads", lambda s: SPEC.replace(num_heads=-4), "num_heads"),
    ("spec-bad-group", lambda s: SPEC.replace(kv_num_heads=3), "kv_num_heads"),
    ("spec-bad-layout", lambda s: SPEC.replace(kv_layout="BHSD"), "kv_layout"),
    ("spec-paged-without-pages", lambda s: SPEC.replace(kv_layout="paged"), "page_size"),
    ("spec-capacity", lambda s: SPEC.replace(kv_capacity=10), "kv_capacity"),
    ("unknown-flag", lambda s: s.run(SPEC, _t(), flags={"fast": True}), "flags['fast']"),
    ("bad-flag-value", lambda s: s.run(SPEC, _t(), flags={"m_tile": "four"}), "flags['m_tile']"),
    ("unknown-kernel", lambda s: s.run(SPEC, _t(), kernel="webgpu.magic"), "kernel"),
    ("kernel-of-other-backend", _other_kernel, "kernel"),
    ("forced-kernel-cannot-run", _dtype_mismatched_kernel, "spec"),
    ("too-big-for-device", _too_big_for_device, "tensors['k']"),
    ("bad-split-size", lambda s: s.partial_states(SPEC, _t(), split_size=0), "split_size"),
    ("reduce-o-float64", _o_parts(o_parts=np.zeros((2, 4, 2, 3, 32))), "o_parts"),
    ("reduce-lse-shape", _o_parts(lse_parts=np.zeros((2, 4, 2, 4), np.float32)), "lse_parts"),
    ("reduce-sink-missing", _o_parts(head_sink=None), "head_sink"),
    # issue [trust]: checks before copies, huge integers, the field the caller set
    ("tensor-2**33-broadcast", lambda s: s.tensor(np.broadcast_to(np.float32(0), (2**33,))),
     "shape"),
    ("write-2**33-broadcast", lambda s: s.tensor(np.zeros(4, np.float32)).write(
        np.broadcast_to(np.float32(0), (2**33,))), "array"),
    ("past-len-10**5000", lambda s: SPEC.replace(past_len=10**5000), "past_len"),
    ("scale-10**5000", lambda s: SPEC.replace(scale=10**5000), "scale"),
    ("flag-10**5000", lambda s: s.run(SPEC, _t(), flags={"split_size": 10**5000}),
     "flags['split_size']"),
    ("param-10**5000", lambda s: s.run(SPEC, _t(), params={"split_size": -10**5000}),
     "params['split_size']"),
    ("capacity-from-past-len", lambda s: attnreg.AttentionSpec(
        batch=3, seq_len=5, past_len=10**9, num_heads=4, head_size=32), "past_len"),
    ("kv-cache-past-binding", _cache_past_binding, "capacity"),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("dev", DEVICES, ids=[f"{d.backend}-{d.slug}" for d in DEVICES])
def test_bad_inputs_then_a_good_run(dev: attnreg.DeviceCaps) -> None:
    assert len(CASES) >= 30
    t = _t()
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        for name, call, field in CASES:
            try:
                call(s)
            except attnreg.SpecError as exc:
                if "skip:" in str(exc):
                    continue
                assert exc.field == field, f"{name}: field {exc.field!r} != {field!r}: {exc}"
                assert "expected" in str(exc) or isinstance(exc, attnreg.NoKernelError), name
                if isinstance(exc, attnreg.NoKernelError):
                    assert exc.rejected, f"{name}: the error must list candidates"
            else:
                binding = dev.limit("storage_binding")
                if name == "too-big-for-device" and (binding is None or binding >= BIG_C * 4096):
                    continue      # no binding limit (the numpy reference), or 8 GiB fit
                pytest.fail(f"{name}: no SpecError on {dev.id}")
        check_close(SPEC, s.run(SPEC, t), t, what=f"good run after bad inputs on {dev.id}")


HUGE_TEXT = "x" * 10**7          # a 10 MB name or value
BOUNDED: list[tuple[str, Callable[[attnreg.Session], Any]]] = [
    ("flag-name", lambda s: s.run(SPEC, _t(), flags={HUGE_TEXT: 1})),
    ("flag-value", lambda s: s.run(SPEC, _t(), flags={"route": HUGE_TEXT})),
    ("flag-int-key", lambda s: s.run(SPEC, _t(), flags={10**5000: 1})),
    ("param-name", lambda s: s.run(SPEC, _t(), params={HUGE_TEXT: 1})),
    ("tensor-name", lambda s: s.run(SPEC, _t(**{HUGE_TEXT: np.zeros(1)}))),
    ("tensor-int-key", lambda s: s.run(SPEC, _t(**{"q": None}) | {10**5000: np.zeros(1)})),
    ("spec-field", lambda s: attnreg.AttentionSpec(**{HUGE_TEXT: 1})),
    ("spec-dtype", lambda s: SPEC.replace(dtype=HUGE_TEXT)),
    ("spec-nested", lambda s: SPEC.replace(batch=[[10**5000] * 1000] * 1000)),
    ("kernel", lambda s: s.run(SPEC, _t(), kernel=HUGE_TEXT)),
    ("backend", lambda s: attnreg.Session(backend=HUGE_TEXT)),
    ("device", lambda s: attnreg.Session(backend="reference", device=HUGE_TEXT)),
    ("negative-huge", lambda s: SPEC.replace(head_size=-10**6000)),
]


def test_messages_are_bounded_and_always_formatted() -> None:
    """Whatever the size of a name or value (10 MB strings, integers of 5000 digits, deep
    lists), the SpecError's field and message stay short: never a 10 MB message, never a
    ValueError raised while formatting one."""
    with attnreg.Session(backend="reference") as s:
        for name, call in BOUNDED:
            with pytest.raises(attnreg.SpecError) as info:
                call(s)
            text = str(info.value)
            assert len(info.value.field) <= 200 and len(text) <= 4500, (name, len(text))
            assert "expected" in text, name
