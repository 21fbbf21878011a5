"""merge_states on every backend, and the shared-prefix (cascade) use: a prefix attended once
for many requests, merged with each request's own suffix, equals full attention."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.tensors import check_tensors
from attnreg.testing import make_tensors

BACKENDS = sorted({d.backend for d in attnreg.devices() if d.available})


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_merge_equals_numpy_merge(backend: str) -> None:
    spec = attnreg.AttentionSpec(batch=2, seq_len=3, past_len=60, num_heads=4, head_size=32,
                                 causal=True, local_window=20)
    t = check_tensors(spec, make_tensors(spec, seed=2))
    o, lse = ref.partial_states(spec, t, 16)          # includes empty (-inf) splits
    assert np.isneginf(lse).any()
    states = [(o[..., i, :].astype(np.float32), lse[..., i].astype(np.float32))
              for i in range(o.shape[3])]
    got_o, got_lse = attnreg.merge_states(states, backend=backend)
    want_o, want_lse = ref.attention(spec, t)
    np.testing.assert_allclose(got_o, want_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-4)
    assert got_o.dtype == np.float32 and got_o.shape == want_o.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_cascade_equals_full_attention(backend: str) -> None:
    """16 requests share a 512-token prefix (kept once); each has its own 40-token suffix."""
    rng = np.random.default_rng(5)
    n_req, prefix, suffix, nq, nkv, h = 16, 512, 40, 4, 2, 32
    kp = rng.standard_normal((1, nkv, prefix, h)).astype(np.float32)
    vp = rng.standard_normal((1, nkv, prefix, h)).astype(np.float32)
    ks = rng.standard_normal((n_req, nkv, suffix, h)).astype(np.float32)
    vs = rng.standard_normal((n_req, nkv, suffix, h)).astype(np.float32)
    q = rng.standard_normal((n_req, 1, nq, h)).astype(np.float32)        # one decode row each
    with attnreg.Session(backend=backend) as s:
        # prefix: all 16 requests as 16 query rows of one batch entry (non-causal: all visible)
        pre = attnreg.AttentionSpec(batch=1, seq_len=n_req, past_len=prefix - n_req,
                                    num_heads=nq, kv_num_heads=nkv, head_size=h, causal=False,
                                    return_lse=True)
        q_pre = q.transpose(1, 0, 2, 3)                                   # [1, n_req, Nq, H]
        o_pre, lse_pre = s.run(pre, {"q": q_pre, "k": kp, "v": vp})
        suf = attnreg.AttentionSpec(batch=n_req, seq_len=1, past_len=suffix - 1, num_heads=nq,
                                    kv_num_heads=nkv, head_size=h, causal=False, return_lse=True)
        o_suf, lse_suf = s.run(suf, {"q": q, "k": ks, "v": vs})
        # both states as [n_req, Nq, 1, H] / [n_req, Nq, 1]
        o, _ = s.merge_states([(o_pre[0][:, :, None, :], lse_pre[0].T[:, :, None]),
                               (o_suf.transpose(0, 2, 1, 3), lse_suf)])
    full = attnreg.AttentionSpec(batch=n_req, seq_len=1, past_len=prefix + suffix - 1,
                                 num_heads=nq, kv_num_heads=nkv, head_size=h, causal=False)
    k_full = np.concatenate([np.repeat(kp, n_req, 0), ks], axis=2)
    v_full = np.concatenate([np.repeat(vp, n_req, 0), vs], axis=2)
    want, _ = ref.attention(full, {"q": q, "k": k_full, "v": v_full})
    np.testing.assert_allclose(o, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_propagates_nan_of_nonempty_states_only(backend: str) -> None:
    """docs/contract.md "Non-finite values and scalar fields": a NaN or inf in the o of a state
    with a finite lse reaches the merged o as NaN, even where its weight underflows to 0; the o of
    an empty state (lse -inf) is ignored, NaN and inf included; lse is not touched by o."""
    rng = np.random.default_rng(4)
    o = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(3)]
    lse = [np.array([0.5, 1.0, -0.2], np.float32), np.array([-200.0, 0.3, -np.inf], np.float32),
           np.full(3, -np.inf, np.float32)]
    o[1][0, 2] = np.nan          # weight exp(-200.5) == 0 in float32: still NaN
    o[1][1, 5] = np.inf          # NaN in the merged o
    o[1][2] = np.nan             # empty in row 2: ignored
    o[2][:] = np.inf             # an empty state: ignored
    got_o, got_lse = attnreg.merge_states(list(zip(o, lse)), backend=backend)
    want_o, want_lse = ref.merge(list(zip(o, lse)))
    assert np.array_equal(np.isnan(got_o), np.isnan(want_o))
    assert np.isnan(got_o).sum() == 2 and np.isnan(got_o[0, 2]) and np.isnan(got_o[1, 5])
    fin = ~np.isnan(want_o)
    np.testing.assert_allclose(got_o[fin], want_o[fin], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(got_lse, want_lse, atol=2e-4)


@pytest.mark.parametrize("backend", [None, *BACKENDS])
@pytest.mark.parametrize("q_layout,rows", [("BSNH", 3), ("BNSH", 3), ("BSNH", 4), ("BNSH", 4)])
def test_run_outputs_merge_as_returned(backend: str | None, q_layout: str, rows: int) -> None:
    """run(..., return_lse=True) on two disjoint key halves (masked by -inf biases) merges
    into full attention in either q_layout; with S == Nq the shapes cannot tell the layouts
    apart, so the caller names it (unnamed, the rows reading is BNSH's)."""
    spec = attnreg.AttentionSpec(batch=2, seq_len=rows, past_len=57, num_heads=4,
                                 kv_num_heads=2, head_size=32, q_layout=q_layout,
                                 return_lse=True, bias=True)
    t = make_tensors(spec, seed=4, poison=False)
    c = spec.capacity
    halves = []
    for keep in (slice(0, 25), slice(25, c)):
        bias = np.full((1, 1, rows, c), -np.inf, np.float32)
        bias[..., keep] = 0.0
        halves.append(attnreg.run(spec, {**t, "bias": bias}, backend="reference"))
    full = attnreg.run(spec, {**t, "bias": np.zeros((1, 1, rows, c), np.float32)},
                       backend="reference")
    layout = q_layout if rows == spec.num_heads else None
    o, lse = attnreg.merge_states(halves, backend=backend, layout=layout)
    assert o.shape == full[0].shape and lse.shape == full[1].shape == (2, 4, rows)
    np.testing.assert_allclose(o, full[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, full[1], atol=2e-4)
    if rows == spec.num_heads:
        o2, _ = attnreg.merge_states(halves, backend=backend)
        if q_layout == "BNSH":
            np.testing.assert_allclose(o2, full[0], atol=2e-5, rtol=1e-4)


def test_merge_layout_is_checked() -> None:
    o = np.zeros((1, 3, 4, 8), np.float32)
    with pytest.raises(attnreg.SpecError, match="layout"):
        attnreg.merge_states([(o, np.zeros((1, 4, 3), np.float32))], layout="NHSB")
    with pytest.raises(attnreg.SpecError, match=r"\(1, 4, 3\)"):
        attnreg.merge_states([(o, np.zeros((1, 3, 4), np.float32))], layout="BSNH")
