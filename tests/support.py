"""Shared test machinery: inputs with poisoned tails, contract tolerances, device checks."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg import reference as ref
from attnreg.kernel import LSE_ATOL, TOLERANCE
from attnreg.spec import AttentionSpec

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def make_tensors(spec: AttentionSpec, seed: int = 0, *, lengths: Any = None,
                 bias_shape: tuple[int, ...] | None = None, mask_frac: float = 0.0,
                 poison: bool = True) -> dict[str, np.ndarray]:
    """Random inputs for spec. Keys past each batch's valid length are NaN (poison), so a
    kernel that reads them fails. ``mask_frac`` puts -inf into that fraction of the bias."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(spec.dtype)
    t: dict[str, np.ndarray] = {
        "q": rng.standard_normal(spec.q_shape).astype(dt),
        "k": rng.standard_normal(spec.kv_shape).astype(dt),
        "v": rng.standard_normal(spec.kv_shape).astype(dt),
    }
    c = spec.capacity
    if spec.seqlens_k:
        if lengths is None:
            lengths = rng.integers(spec.seq_len, c + 1, size=spec.batch)
        t["seqlens_k"] = np.asarray(lengths, dtype=np.int32)
    if poison:
        lens = ref.valid_lengths(spec, t)
        for b, L in enumerate(lens):
            for name in ("k", "v"):
                if spec.kv_layout == "BSNH":
                    t[name][b, L:] = np.nan
                else:
                    t[name][b, :, L:] = np.nan
    if spec.bias:
        shape = bias_shape or (spec.batch, spec.num_heads, spec.seq_len, c)
        bias = rng.standard_normal(shape).astype(np.float32)
        if mask_frac > 0:
            bias[rng.random(shape) < mask_frac] = -np.inf
        t["bias"] = bias
    if spec.head_sink:
        t["head_sink"] = rng.standard_normal(spec.num_heads).astype(np.float32)
    return t


def expected(spec: AttentionSpec, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference in the spec's output layout: (out, lse)."""
    out, lse = ref.attention(spec, tensors)
    return ref.out_layout(spec, out), lse


def check_close(spec: AttentionSpec, got: Any, tensors: dict[str, np.ndarray],
                tol: tuple[float, float] | None = None, what: str = "") -> float:
    """Assert got (out or (out, lse)) matches the reference within tolerance; return max err."""
    want_out, want_lse = expected(spec, tensors)
    out, lse = (got if spec.return_lse else (got, None))
    atol, rtol = tol or TOLERANCE[spec.dtype]
    assert out.shape == want_out.shape, (what, out.shape, want_out.shape)
    assert out.dtype == np.dtype(spec.dtype), (what, out.dtype)
    o = out.astype(np.float64)
    assert not np.isnan(o).any(), f"{what}: NaN in output"
    err = np.abs(o - want_out)
    bad = err > atol + rtol * np.abs(want_out)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} values off; max err "
                           f"{err.max():.3g} at {np.unravel_index(np.argmax(err), err.shape)}; "
                           f"atol={atol} rtol={rtol}; spec={spec!r}")
    if lse is not None:
        assert lse.dtype == np.float32 and lse.shape == spec.lse_shape
        inf_ok = np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
        assert inf_ok, f"{what}: -inf pattern of lse differs"
        fin = np.isfinite(want_lse)
        lerr = np.abs(lse[fin] - want_lse[fin])
        assert (lerr <= LSE_ATOL[spec.dtype]).all(), f"{what}: lse err {lerr.max():.3g}"
    return float(err.max()) if err.size else 0.0


def require_devices(backend: str) -> list[attnreg.DeviceCaps]:
    """Available devices of a backend; skip when none, but fail in CI (CI=true)."""
    devs = [d for d in attnreg.devices(backend) if d.available]
    if not devs:
        why = "; ".join(d.reason for d in attnreg.devices(backend)) or "no device"
        if IN_CI:
            pytest.fail(f"backend {backend} has no device in CI: {why}")
        pytest.skip(f"backend {backend} has no device: {why}")
    return devs
