"""`attnreg demo`: one prefill and one decode on every available device, each checked
against the float64 reference (the README's main job)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import api
from ..errors import SpecError
from ..kernel import TOLERANCE
from ..reference import attention, out_layout
from ..session import Session
from ..spec import AttentionSpec
from .textui import table


def _inputs(spec: AttentionSpec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {n: rng.standard_normal(s).astype(spec.dtype)
         for n, s in (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    if spec.seqlens_k:
        t["seqlens_k"] = rng.integers(spec.seq_len, spec.capacity + 1, spec.batch).astype(np.int32)
    return t


DEMO_CASES = (
    ("prefill", AttentionSpec(batch=1, seq_len=128, past_len=0, num_heads=8, kv_num_heads=2,
                              head_size=64, dtype="float16", causal=True)),
    ("decode", AttentionSpec(batch=2, seq_len=1, past_len=1023, num_heads=32, kv_num_heads=8,
                             head_size=128, dtype="float16", causal=True, seqlens_k=True)),
)


def cmd_demo(a: argparse.Namespace) -> int:
    devs = api.devices(a.backend, refresh=True)
    rows, failures = [], 0
    for d in devs:
        if not d.available:
            continue
        with Session(backend=d.backend, device=d.id) as s:
            for name, spec in DEMO_CASES:
                t = _inputs(spec)
                try:
                    t0 = time.perf_counter()
                    out, plan = s.run_with_plan(spec, t)
                    first = time.perf_counter() - t0
                    warm = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        s.run(spec, t)
                        warm.append(time.perf_counter() - t0)
                except (SpecError, RuntimeError) as exc:
                    failures += 1
                    rows.append((d.backend, d.slug, name, "-", "-", "-", f"FAILED: {exc}"))
                    continue
                want = out_layout(spec, attention(spec, t)[0])
                err = float(np.abs(out.astype(np.float64) - want).max())
                atol, rtol = TOLERANCE[spec.dtype]
                ok = bool(np.all(np.abs(out - want) <= atol + rtol * np.abs(want)))
                failures += not ok
                rows.append((d.backend, d.slug, name, " -> ".join(plan.kernels),
                             f"{first * 1e3:.1f}", f"{np.median(warm) * 1e3:.2f}",
                             f"{err:.2e} ({'ok' if ok else 'OVER TOLERANCE'})"))
    print("attnreg demo: one prefill and one decode per device, checked against the float64 "
          "reference")
    for name, spec in DEMO_CASES:
        print(f"  {name}: {spec!r}")
    print(table(("backend", "device", "case", "kernel(s)", "first ms", "warm ms",
                 "max err vs reference"), rows))
    down = [d for d in devs if not d.available]
    if down:
        print("\nunavailable:")
        for d in down:
            print(f"  {d.backend}: {d.reason}")
    return 1 if failures else 0
