"""Shared test machinery: inputs with poisoned tails, contract tolerances, device checks."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.spec import AttentionSpec
from attnreg.tools.testing import compare, expected, make_tensors

__all__ = ["IN_CI", "check_close", "expected", "make_tensors", "require_devices"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def check_close(spec: AttentionSpec, got: Any, tensors: dict[str, np.ndarray],
                tol: tuple[float, float] | None = None, what: str = "") -> float:
    """Assert got (out or (out, lse)) matches the reference within tolerance; return max err."""
    err, problem = compare(spec, got, expected(spec, tensors), tol)
    assert not problem, f"{what}: {problem}; spec={spec!r}"
    return err


def require_devices(backend: str) -> list[attnreg.DeviceCaps]:
    """Available devices of a backend; skip when none, but fail in CI (CI=true)."""
    devs = [d for d in attnreg.devices(backend) if d.available]
    if not devs:
        why = "; ".join(d.reason for d in attnreg.devices(backend)) or "no device"
        if IN_CI:
            pytest.fail(f"backend {backend} has no device in CI: {why}")
        pytest.skip(f"backend {backend} has no device: {why}")
    return devs
