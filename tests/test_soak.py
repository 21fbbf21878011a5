"""Bounded soak: a decode loop with appends keeps device memory flat (alloc/free counters,
process RSS) and its results right; Sessions opened and closed in a loop leak nothing."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import attnreg
from attnreg.tools.testing import compare, expected, make_tensors

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def live_buffers(rt: attnreg.Runtime) -> int:
    return rt.counters["allocs"] - rt.counters["frees"]


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_decode_loop_soak(dev: attnreg.DeviceCaps) -> None:
    steps = 60 if dev.backend == "browser" else 1000
    rng = np.random.default_rng(11)
    B, NKV, NQ, H, C = 2, 2, 4, 32, steps + 8
    with attnreg.Session(backend=dev.backend, device=dev.id) as s:
        cache = s.kv_cache(batch=B, kv_num_heads=NKV, head_size=H, capacity=C, dtype="float16")
        spec = cache.spec(num_heads=NQ)
        out = s.empty(spec.out_shape, "float16")
        q_dev = s.empty(spec.q_shape, "float16")
        k_host = np.zeros((B, C, NKV, H), np.float16)
        v_host = np.zeros((B, C, NKV, H), np.float16)
        run = None
        rss0 = live0 = 0.0
        for step in range(steps):
            kn = rng.standard_normal((B, 1, NKV, H)).astype(np.float16)
            vn = rng.standard_normal((B, 1, NKV, H)).astype(np.float16)
            k_host[:, step], v_host[:, step] = kn[:, 0], vn[:, 0]
            cache.append(kn, vn)
            q = rng.standard_normal(spec.q_shape).astype(np.float16)
            q_dev.write(q)
            if run is None:
                run = s.prepare(spec, cache.tensors(q_dev), out=out)
            run()
            if step == 20:                      # warm: everything allocated once
                gc.collect()
                rt = s._device_runtime(out.device_id)
                rss0, live0 = rss_mib(), live_buffers(rt)
            if step % 50 == 7 or step == steps - 1:
                host = {"q": q, "k": k_host, "v": v_host,
                        "seqlens_k": cache.lengths.astype(np.int32)}
                _, problem = compare(spec, out.numpy(), expected(spec, host))
                assert not problem, f"step {step}: {problem}"
        gc.collect()
        assert live_buffers(rt) == live0, "device buffers grew during the loop"
        grown = rss_mib() - rss0
        assert grown < 40, f"RSS grew {grown:.1f} MiB over {steps - 20} steps"


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_session_churn(dev: attnreg.DeviceCaps) -> None:
    n = 2 if dev.backend == "browser" else 300
    spec = attnreg.AttentionSpec(batch=1, seq_len=2, past_len=30, num_heads=2, head_size=32)
    t = make_tensors(spec, 1)
    rss0 = 0.0
    for i in range(n):
        with attnreg.Session(backend=dev.backend, device=dev.id) as s:
            x = s.tensor(t["q"])
            got = s.run(spec, t)
            assert np.array_equal(x.numpy(), t["q"])
        _, problem = compare(spec, got, expected(spec, t))
        assert not problem, f"session {i}: {problem}"
        if i == min(3, n - 2):
            gc.collect()
            rss0 = rss_mib()
    gc.collect()
    grown = rss_mib() - rss0
    assert grown < 40, f"RSS grew {grown:.1f} MiB over the last sessions of {n}"
