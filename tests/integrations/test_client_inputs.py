"""Inputs as real clients hold them (docs/contract.md "Shapes real models need"): DLPack and
__array__ CPU arrays read without a copy, int64 index tensors, head_sink in the spec's dtype.
Every result is compared with the float64 reference on the plain numpy inputs."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.tensors import check_tensors
from attnreg.testing import make_tensors

BACKENDS = sorted({d.backend for d in attnreg.devices() if d.available} - {"browser"})


class DLPackOnly:
    """An array that speaks only DLPack (as torch, jax and friends do)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kw: object) -> object:
        return self.a.__dlpack__(**kw)  # type: ignore[arg-type]

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.a.__dlpack_device__()


def _spec(dtype: str = "float16") -> attnreg.AttentionSpec:
    return attnreg.AttentionSpec(batch=2, seq_len=2, past_len=70, num_heads=4, kv_num_heads=2,
                                 head_size=32, dtype=dtype, seqlens_k=True, kv_capacity=96,
                                 head_sink=True, kv_layout="paged", page_size=16, num_pages=15,
                                 causal=True)


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    atol, rtol = attnreg.kernel.TOLERANCE[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), atol=atol,
                               rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dlpack_int64_indices_and_sink_in_dtype(backend: str, dtype: str) -> None:
    spec = _spec(dtype)
    t = make_tensors(spec, 3, lengths=(96, 40))
    sink = t["head_sink"].astype(dtype)              # the model keeps its sinks in dtype
    want = attnreg.run(spec, {**t, "head_sink": sink.astype(np.float32)}, backend="reference")
    given = {n: DLPackOnly(a) for n, a in t.items() if dtype != "bfloat16" or n not in "qkv"}
    if dtype == "bfloat16":         # numpy's DLPack has no bfloat16: __array__ objects then
        given.update({n: t[n] for n in ("q", "k", "v")})
    given.update(seqlens_k=DLPackOnly(t["seqlens_k"].astype(np.int64)),
                 block_table=DLPackOnly(t["block_table"].astype(np.int64)),
                 head_sink=DLPackOnly(sink) if dtype != "bfloat16" else sink)
    _close(attnreg.run(spec, given, backend=backend), want, dtype)


def test_checked_inputs_share_memory_and_narrow_indices() -> None:
    spec = _spec()
    t = make_tensors(spec, 3, lengths=(96, 40))
    given = {n: DLPackOnly(a) for n, a in t.items()}
    given["seqlens_k"] = t["seqlens_k"].astype(np.int64)
    got = check_tensors(spec, given)
    for n in ("q", "k", "v"):
        assert np.shares_memory(got[n], t[n]), n           # read in place, not copied
    assert got["seqlens_k"].dtype == np.int32 and (got["seqlens_k"] == t["seqlens_k"]).all()


def test_int64_values_are_checked_not_wrapped() -> None:
    spec = _spec()
    t = make_tensors(spec, 3, lengths=(96, 40))
    sk = t["seqlens_k"].astype(np.int64)
    sk[1] = 2**32 + 40                 # would read 40 after a silent int32 wrap
    with pytest.raises(attnreg.SpecError, match=r"seqlens_k'\]\[1\]"):
        attnreg.run(spec, {**t, "seqlens_k": sk}, backend="reference")
    bt = t["block_table"].astype(np.int64)
    bt[1, -1] = 2**40                  # past batch 1's length, yet int32 cannot hold it
    with pytest.raises(attnreg.SpecError, match="int32 can hold"):
        attnreg.run(spec, {**t, "block_table": bt}, backend="reference")
    with pytest.raises(attnreg.SpecError, match="head_sink"):
        attnreg.run(spec, {**t, "head_sink": t["head_sink"].astype(np.float64)},
                    backend="reference")


def test_torch_cpu_tensors_read_in_place() -> None:
    torch = pytest.importorskip("torch")          # an optional extra
    spec = _spec("bfloat16")
    t = make_tensors(spec, 3, lengths=(96, 40))
    tt = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
          if a.dtype == np.dtype("bfloat16") else torch.from_numpy(a) for n, a in t.items()}
    tt["seqlens_k"] = tt["seqlens_k"].long()
    tt["block_table"] = tt["block_table"].long()
    got = check_tensors(spec, tt)
    assert np.shares_memory(got["k"], t["k"]) and got["k"].dtype == np.dtype("bfloat16")
    want = attnreg.run(spec, t, backend="reference")
    _close(attnreg.run(spec, tt, backend="reference"), want, "bfloat16")
