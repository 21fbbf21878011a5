"""Partial states are an exchange format: states written by any backend, reduced by any
other (and by itself), give the contract's answer. One session per device, every
(producer, consumer) pair, f32 and f16 inputs, splits that are empty for the shorter sequence,
a head sink, and the lse."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.testing import make_tensors
from tests.support import IN_CI, check_close

BACKENDS = ("reference", "webgpu", "opencl", "browser", "dawn")
DEVICES = {b: next((d for d in attnreg.devices(b) if d.available), None) for b in BACKENDS}
SPLIT = 32


def _spec(dtype: str) -> attnreg.AttentionSpec:
    # lengths (100, 29): batch 1's splits 1..3 hold no visible key (empty states, lse -inf)
    return attnreg.AttentionSpec(batch=2, seq_len=2, past_len=98, num_heads=6, kv_num_heads=2,
                                 head_size=64, dtype=dtype, causal=True, seqlens_k=True,
                                 kv_capacity=100, head_sink=True, return_lse=True)


@pytest.fixture(scope="module")
def sessions() -> Iterator[dict[str, attnreg.Session]]:
    missing = [b for b, d in DEVICES.items() if d is None]
    if missing and IN_CI:
        pytest.fail(f"CI must have a device for every backend; missing: {missing}")
    out = {b: attnreg.Session(backend=b, device=d.id) for b, d in DEVICES.items() if d is not None}
    yield out
    for s in out.values():
        s.close()


@pytest.fixture(scope="module")
def states(sessions: dict[str, attnreg.Session]) -> dict[tuple[str, str], tuple]:
    """(producer, dtype) -> (tensors, o_parts, lse_parts), each checked against the float64
    partial states first so a reduce failure below points at the consumer."""
    got = {}
    for dtype in ("float32", "float16"):
        spec = _spec(dtype)
        t = make_tensors(spec, seed=7, lengths=(100, 29))
        want_o, want_l = ref.partial_states(spec, t, SPLIT)
        for b, s in sessions.items():
            o, lse = s.partial_states(spec, t, split_size=SPLIT)
            assert o.dtype == np.float32 and lse.dtype == np.float32, b
            assert np.isneginf(lse[1, :, :, 1:]).all(), f"{b}: empty splits must have lse -inf"
            np.testing.assert_allclose(o, want_o, atol=3e-5, rtol=1e-4, err_msg=b)
            np.testing.assert_allclose(lse, want_l, atol=3e-4, err_msg=b)
            got[(b, dtype)] = (t, o, lse)
    return got


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("consumer", BACKENDS)
@pytest.mark.parametrize("producer", BACKENDS)
def test_states_from_one_backend_reduce_on_another(
        sessions: dict[str, attnreg.Session], states: dict[tuple[str, str], tuple],
        producer: str, consumer: str, dtype: str) -> None:
    if producer not in sessions or consumer not in sessions:
        pytest.skip(f"no device for {producer if producer not in sessions else consumer}")
    spec = _spec(dtype)
    t, o, lse = states[(producer, dtype)]
    got = sessions[consumer].reduce_states(spec, o, lse, t["head_sink"])
    check_close(spec, got, t, what=f"{producer} states reduced on {consumer}")
