"""Bounded soak: a decode loop with appends keeps device memory flat (alloc/free counters,
process RSS) and its results right; Sessions opened and closed in a loop leak nothing."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]


# A driver defect, not ours: Debian 12's Mesa 22.3 lavapipe grows by about 0.6 MB for every
# dispatch of Tint's SPIR-V of the decode kernels (dawn backend). The same WGSL through naga
# (webgpu) does not, Tint's prefill and reduce do not, and dawn on the H100 does not (0.0 MB
# over 200 decodes). The dawn device on lavapipe says so in its settings; strict: a lavapipe
# or Dawn that fixes it turns these cases red, so the note goes too.
KNOWN_LEAKS = {("dawn", "llvmpipe"): "Mesa 22.3 lavapipe leaks ~0.6 MB per dispatch of Tint's "
               "decode kernels (not naga's, not on GPUs)"}


def _known_leak(dev: attnreg.DeviceCaps, request: pytest.FixtureRequest) -> None:
    why = KNOWN_LEAKS.get((dev.backend, dev.slug))
    if why:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def live_buffers(rt: attnreg.Runtime) -> int:
    return rt.counters["allocs"] - rt.counters["frees"]


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_decode_loop_soak(dev: attnreg.DeviceCaps, request: pytest.FixtureRequest) -> None:
    _known_leak(dev, request)
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
                rt = s.device_runtime(out.device_id)
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
    # No known leak here: since the decode kernels took the model shapes (2026-11-25), 300
    # Dawn sessions on lavapipe each with one decode grow RSS by less than the bound (the
    # strict xfail passed); the 1000-step loop above still shows the driver's growth.
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
