"""Threads (issue [hardening], item 3): two threads hammering one Session, whose lock
serializes them, or one Session each, on every available device; every run checked against
the reference and every tensor read back."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
SPEC = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=20, num_heads=4, kv_num_heads=2,
                             head_size=16, dtype="float32")


def _session(dev: attnreg.DeviceCaps) -> attnreg.Session:
    return attnreg.Session(backend=dev.backend, device=dev.id)


def _hammer(s: attnreg.Session, seed: int, n: int, errors: list[str]) -> None:
    try:
        for i in range(n):
            spec = SPEC.replace(past_len=10 + (seed * 7 + i) % 20, causal=bool(i % 2))
            t = make_tensors(spec, seed * 1000 + i)
            got = s.run(spec, t)
            _, problem = compare(spec, got, expected(spec, t))
            if problem:
                errors.append(f"thread {seed} run {i}: {problem}")
            x = s.tensor(t["q"])
            if not np.array_equal(x.numpy(), t["q"]):
                errors.append(f"thread {seed} run {i}: tensor read-back differs")
            x.free()
    except Exception as exc:                    # reported, not swallowed
        errors.append(f"thread {seed}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("shared", [True, False], ids=["one-session", "two-sessions"])
@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_two_threads(dev: attnreg.DeviceCaps, shared: bool) -> None:
    """Two threads hammering one Session (its lock serializes them) or one Session each."""
    n = 6 if dev.backend == "browser" else 12
    sessions = [_session(dev)] if shared else [_session(dev), _session(dev)]
    errors: list[str] = []
    threads = [threading.Thread(target=_hammer, args=(sessions[i % len(sessions)], i, n, errors))
               for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    for s in sessions:
        s.close()
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, "\n".join(errors)
