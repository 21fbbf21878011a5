"""Scores that overflow float32 from finite inputs (docs/contract.md "Overflow"), on every
available device against the float64 reference: a logit beyond float32's range makes its
row's out and lse NaN, the same everywhere; one within range is computed right even where
q.k alone is not (kernels fold the scale into q first); a bias that pushes a logit past the
range is +inf (poison) or -inf (a masked key). One spec (one program per device): batch 0
ordinary, batch 1 the extreme values."""

from __future__ import annotations

import numpy as np
import pytest

import attnreg
from attnreg.spec import F32_MAX
from attnreg.testing import compare, expected, make_tensors

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
SPEC = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=7, num_heads=2, kv_num_heads=1,
                             head_size=64, bias=True, return_lse=True)


def _inputs(qk: float, bias: float = 0.0, keys: slice = slice(3, 4)) -> dict[str, np.ndarray]:
    """Batch 1's q and k all ``qk`` (scale is 1/8: every score is 64 * qk**2 / 8) and its
    bias ``bias`` at ``keys``."""
    t = make_tensors(SPEC, seed=2, poison=False)
    t["q"][1] = qk
    t["k"][1] = qk
    t["bias"][:] = 0.0
    t["bias"][1, :, :, keys] = bias
    return t


def _check(s: attnreg.Session, t: dict[str, np.ndarray], what: str, lse: bool = True) -> None:
    want = expected(SPEC, t)
    got = s.run(SPEC, t)
    spec = SPEC if lse else SPEC.replace(return_lse=False)
    _, problem = compare(spec, got if lse else got[0], want)
    assert not problem, f"{what}: {problem}"


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_overflowing_scores_are_nan_and_scores_in_range_are_right(dev: attnreg.DeviceCaps
                                                                  ) -> None:
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        # the case: q = k = 1e19, a score of 8e38 > 3.4e38, NaN (out and lse)
        t = _inputs(1e19)
        out, lse = expected(SPEC, t)
        assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
        assert np.isfinite(out[0]).all() and np.isfinite(lse[0]).all()
        _check(s, t, "a score beyond float32")
        # q.k = 1.6e39 is beyond float32, the score scale * q.k = 2e38 is not: right (its
        # lse, ~2e38, carries float32's rounding of ~1e31: out is compared)
        t = _inputs(5e18)
        assert np.isfinite(expected(SPEC, t)[0]).all()
        _check(s, t, "q.k beyond float32, the score within", lse=False)
        # a score of 2e38 plus a bias of 3e38 is +inf in float32: it poisons the row
        t = _inputs(5e18, bias=3.0e38)
        assert np.isnan(expected(SPEC, t)[1][1]).all()
        _check(s, t, "score + bias > float32's max")
        # scores of -8e36 plus a bias of -3.4e38 are -inf: every key masked, out 0, lse -inf
        t = _inputs(1e18, bias=-3.4e38, keys=slice(None))
        t["q"][1] = -1e18
        assert np.isneginf(expected(SPEC, t)[1][1]).all()
        _check(s, t, "score + bias < -float32's max")
        # v at half the bound the contract gives (8 keys * |v| <= 3.4e38): right
        t = _inputs(0.0)
        t["v"][1] = np.float32(F32_MAX / (2 * SPEC.capacity))
        t["v"][1, ..., 3] *= -1
        _check(s, t, "v near float32's largest / the key count")
