"""Misuse that used to crash the process or corrupt results (issue [hardening]): use after
free/close, Ctrl-C inside device operations, threads, interrupted KV-cache appends, exceptions
from signal handlers. On every available device. (Bad call arguments and out-of-range
scalars: test_bad_calls.py; plugin loading: test_plugin_loading.py; threads:
test_threads.py.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.testing import compare, expected, make_tensors
from attnreg.tools import fuzz_hostile

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
S = attnreg.AttentionSpec
SPEC = S(batch=2, seq_len=1, past_len=20, num_heads=4, kv_num_heads=2, head_size=16,
         dtype="float32")


def _session(dev: attnreg.DeviceCaps) -> attnreg.Session:
    return attnreg.Session(backend=dev.backend, device=dev.id)


def _decode_step(s: attnreg.Session, cache: attnreg.KVCache, rng: np.random.Generator
                 ) -> tuple[attnreg.AttentionSpec, dict[str, np.ndarray], Any]:
    """One attention over the cache; returns (spec, host copy of the inputs, output)."""
    spec = cache.spec(num_heads=4)
    q = rng.standard_normal(spec.q_shape).astype(np.float32)
    out = s.run(spec, cache.tensors(q))
    return spec, {"q": q}, out


def _check_cache_step(s: attnreg.Session, cache: attnreg.KVCache, k_host: np.ndarray,
                      v_host: np.ndarray, rng: np.random.Generator, what: str) -> None:
    """The cache's device lengths agree with its host lengths, and attention over it matches
    the reference over the host copy of what was appended."""
    assert np.array_equal(cache.seqlens.numpy(), cache.lengths), \
        f"{what}: device seqlens {cache.seqlens.numpy()} != host lengths {cache.lengths}"
    spec, host, out = _decode_step(s, cache, rng)
    host.update(k=k_host, v=v_host, seqlens_k=cache.lengths.astype(np.int32))
    _, problem = compare(spec, out, expected(spec, host))
    assert not problem, f"{what}: {problem}"


def _t(spec: attnreg.AttentionSpec = SPEC) -> dict[str, np.ndarray]:
    return make_tensors(spec, 0)


def _host_cache(cache: attnreg.KVCache) -> tuple[np.ndarray, np.ndarray]:
    shape = (cache.batch, cache.capacity, cache.kv_num_heads, cache.head_size)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


# -- 1. use after free / close ---------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_use_after_free_or_close_is_a_closed_error(dev: attnreg.DeviceCaps) -> None:
    s = _session(dev)
    t = s.tensor(np.ones(8, np.float32))
    t.free()
    for call in (t.numpy, lambda: t.write(np.ones(8, np.float32))):
        with pytest.raises(attnreg.ClosedError, match="freed"):
            call()
    t.free()                                    # twice: harmless
    live = s.tensor(np.ones(8, np.float32))
    cache = s.kv_cache(batch=1, kv_num_heads=1, head_size=16, capacity=8, dtype="float32")
    cache.append(np.ones((1, 2, 1, 16), np.float32), np.ones((1, 2, 1, 16), np.float32))
    spec = cache.spec(num_heads=1)
    q = np.ones(spec.q_shape, np.float32)
    prepared = s.prepare(spec, cache.tensors(s.tensor(q)))
    s.close()
    s.close()                                   # twice: harmless
    for call in (live.numpy, lambda: live.write(np.ones(8, np.float32)),
                 lambda: s.empty((4,), "float32"), lambda: s.tensor(np.ones(4, np.float32)),
                 lambda: s.kv_cache(batch=1, kv_num_heads=1, head_size=16, capacity=4),
                 lambda: cache.append(np.ones((1, 1, 1, 16), np.float32),
                                      np.ones((1, 1, 1, 16), np.float32)),
                 lambda: s.run(spec, {"q": q, "k": cache.k, "v": cache.v,
                                      "seqlens_k": cache.seqlens}),
                 prepared, lambda: s.plan(SPEC)):
        with pytest.raises(attnreg.ClosedError, match="closed"):
            call()
    live.free()                                 # after close: harmless


# -- 2. Ctrl-C inside a read-back (the buffer stays mapped) --------------------------------
@contextmanager
def _interrupt_at_line(n: int, where: str | tuple[str, ...]) -> Iterator[list[int]]:
    """Raise KeyboardInterrupt at the n-th line executed in files whose path contains
    ``where`` (or one of them), as a Ctrl-C that lands there would; yields [lines seen]."""
    seen = [0]
    places = (where,) if isinstance(where, str) else where

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not any(w in frame.f_code.co_filename for w in places):
            return None                          # no line events in other frames
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt(f"injected at line {n} of {where}")
        return tracer

    sys.settrace(tracer)
    try:
        yield seen
    finally:
        sys.settrace(None)


# The injected interrupts also land in wgpu objects' __del__, which Python reports and ignores.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("dev", [d for d in DEVICES if d.backend == "webgpu"],
                         ids=[i for d, i in zip(DEVICES, IDS) if d.backend == "webgpu"])
def test_interrupt_inside_webgpu_readback_leaves_the_runtime_usable(dev: attnreg.DeviceCaps
                                                                     ) -> None:
    """KeyboardInterrupt at every line wgpu executes during a read-back (bypassing the
    session's SIGINT deferral, as a non-SIGINT async exception would): the next read works."""
    data = np.arange(64, dtype=np.float32)
    with _session(dev) as s:
        t = s.tensor(data)
        rt = s.device_runtime(t.device_id)
        hits = 0
        # Every line up to 150, then a sample: the wait for the map is a polling loop whose
        # line count grows with the time the copy takes.
        for n in [*range(1, 150), *range(150, 1500, 37)]:
            with _interrupt_at_line(n, os.sep + "wgpu" + os.sep) as seen:
                try:
                    raw = rt.download(t.handle, t.nbytes)
                except KeyboardInterrupt:
                    hits += 1
                    raw = None
            if raw is None:
                got = np.frombuffer(rt.download(t.handle, t.nbytes), np.float32)
                assert np.array_equal(got, data), f"read after an interrupt at line {n}"
            elif seen[0] < n:
                break                            # ran to the end: every line was tried
        assert hits > 100, f"only {hits} interruption points inside the read-back"
        assert np.array_equal(t.numpy(), data)


# -- 2b/4. a SIGINT storm over a decode loop -----------------------------------------------
class _SigintStorm:
    """SIGINT to this process at random intervals from a thread. The test's own bookkeeping
    must not be interrupted: the handler raises KeyboardInterrupt only while a library call
    runs (``armed``); the session's deferral holds it and delivers it through the handler
    when the call is complete."""

    def __init__(self, interval: list[float]) -> None:
        self.interval = interval
        self.armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def handler(self, signum: int, frame: Any) -> None:
        if self.armed:
            raise KeyboardInterrupt

    def _run(self) -> None:
        r, pid = np.random.default_rng(4), os.getpid()
        while not self._stop.wait(float(r.uniform(*self.interval))):
            os.kill(pid, signal.SIGINT)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def widen(self) -> None:
        """Each interrupt widens the interval, so steps get through on a loaded machine."""
        self.interval[:] = [1.25 * self.interval[0], 1.25 * self.interval[1]]


def _step_time(s: attnreg.Session) -> float:
    """One decode step's time on the session's device (after its compile)."""
    like = attnreg.AttentionSpec(batch=2, seq_len=1, past_len=31, num_heads=4,
                                 kv_num_heads=2, head_size=16)      # a step's size
    qkv = {n: np.ones(shape, np.float32) for n, shape in
           (("q", like.q_shape), ("k", like.kv_shape), ("v", like.kv_shape))}
    s.run(like, qkv)                                                # compiles
    t0 = time.monotonic()
    s.run(like, qkv)
    return time.monotonic() - t0


def _storm_step(s: attnreg.Session, cache: Any, rng: np.random.Generator, storm: _SigintStorm,
                k_host: np.ndarray, v_host: np.ndarray) -> bool:
    """One append and run under the storm; True if it completed, False if interrupted. The
    host copy follows the cache: an append happened whole (the interrupt came after it) or
    not at all."""
    before = cache.lengths.copy()
    kn = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    vn = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    done = False
    try:
        storm.armed = True
        cache.append(kn, vn)
        spec = cache.spec(num_heads=4)
        out = s.run(spec, cache.tensors(np.ones(spec.q_shape, np.float32)))
        storm.armed = False
        done = True
        assert np.isfinite(out).all()
    except KeyboardInterrupt:
        storm.armed = False
        storm.widen()
    if not np.array_equal(cache.lengths, before):
        assert np.array_equal(cache.lengths, before + 1)
        for b in range(2):
            k_host[b, before[b]] = kn[b, 0]
            v_host[b, before[b]] = vn[b, 0]
    return done


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_sigint_storm_keeps_session_and_cache_consistent(dev: attnreg.DeviceCaps) -> None:
    """Ctrl-C every few milliseconds during appends, runs and read-backs: each interrupt
    reaches the caller, between operations; the session stays usable and the cache
    consistent (device seqlens == host lengths; results match the reference)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    rng = np.random.default_rng(3)
    # Intervals around one step's time (measured below, before the storm): from 1 ms on
    # webgpu/opencl to tens of milliseconds in the browser.
    storm = _SigintStorm([0.001, 0.006])
    previous = signal.signal(signal.SIGINT, storm.handler)
    try:
        with _session(dev) as s:
            # room for many steps: a fast backend (reference) must meet several interrupts
            # before the cache fills (at 64 it once filled before the first one landed)
            cache = s.kv_cache(batch=2, kv_num_heads=2, head_size=16, capacity=512,
                               dtype="float32")
            k_host, v_host = _host_cache(cache)
            step = _step_time(s)
            storm.interval[:] = [max(0.001, 0.3 * step), max(0.006, 1.5 * step)]
            interrupts = steps = 0
            storm.start()
            deadline = time.monotonic() + 5.0
            try:
                # Past the deadline only while too few steps completed (a loaded machine), up
                # to 15 s more.
                while (time.monotonic() < deadline or steps < 3) \
                        and time.monotonic() < deadline + 15.0 \
                        and cache.lengths.max() < cache.capacity - 1:
                    if _storm_step(s, cache, rng, storm, k_host, v_host):
                        steps += 1
                    else:
                        interrupts += 1
            finally:
                storm.stop()
            _check_cache_step(s, cache, k_host, v_host, rng, "after the storm")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert interrupts >= 3 and steps >= 3, (interrupts, steps)


# -- 4. an interrupted KV-cache append rolls back --------------------------------------------
@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_append_interrupted_at_every_line_stays_consistent(dev: attnreg.DeviceCaps) -> None:
    """KeyboardInterrupt at each line of KVCache.append's own code (not a SIGINT, so not
    deferred): host lengths and device seqlens never disagree, and the next step is right."""
    rng = np.random.default_rng(5)
    with _session(dev) as s:
        cache = s.kv_cache(batch=2, kv_num_heads=2, head_size=16, capacity=200, dtype="float32")
        k_host, v_host = _host_cache(cache)
        k_host[:, :1] = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
        v_host[:, :1] = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
        cache.append(k_host[:, :1], v_host[:, :1])        # a first token: decode needs one
        n = 1
        while n < 200:
            before = cache.lengths.copy()
            kn = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
            vn = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
            # KVCache.append's lines and those of the DeviceTensor writes it makes
            with _interrupt_at_line(n, tuple("attnreg" + os.sep + f for f in
                                             ("kv_cache.py", "device_tensor.py"))) as seen:
                try:
                    cache.append(kn, vn)
                    done = True
                except KeyboardInterrupt:
                    done = False
            if not np.array_equal(cache.lengths, before):
                for b in range(2):
                    k_host[b, before[b]] = kn[b, 0]
                    v_host[b, before[b]] = vn[b, 0]
            _check_cache_step(s, cache, k_host, v_host, rng, f"interrupt at line {n}")
            if done and seen[0] < n:
                break
            n += 1
        assert n > 10


def test_sigint_deferral_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGINT)
    with attnreg.Session(backend="reference") as s:
        s.run(SPEC, _t())
    assert signal.getsignal(signal.SIGINT) is before


# -- 6. exceptions from any signal handler (issue [trust]) -----------------------------------
def _armed_call(delay: float, call: Callable[[], Any]) -> bool:
    """Run call with a SIGALRM due after ``delay`` whose handler raises (as a caller's
    timeout would; attnreg.tools.fuzz_hostile); True if the call completed."""
    return fuzz_hostile.with_alarm(delay, call) is not fuzz_hostile.INTERRUPTED


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_an_exception_from_a_sigalrm_handler_leaves_the_session_usable(dev: attnreg.DeviceCaps
                                                                       ) -> None:
    """An exception raised from a SIGALRM handler during a WebGPU read-back left wgpu-py's
    map half done and the next submit hung. Alarms at offsets around one call's length, on
    runs and read-backs: each is held while the device is mid-operation and raised after (or
    before the call), the session stays usable and its results right."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    t = _t()
    rng = np.random.default_rng(7)
    with _session(dev) as s:
        x = s.tensor(t["q"])
        s.run(SPEC, t)                                     # compiles
        t0 = time.monotonic()
        s.run(SPEC, t)
        x.numpy()
        step = max((time.monotonic() - t0) / 2, 0.0005)
        interrupted = 0
        for i in range(12 if dev.backend == "browser" else 40):    # a browser job is slow
            call = (lambda: s.run(SPEC, t)) if i % 2 else x.numpy
            interrupted += not _armed_call(float(rng.uniform(0.0, 1.5)) * step + 1e-5, call)
        assert interrupted >= 3, interrupted
        _, problem = compare(SPEC, s.run(SPEC, t), expected(SPEC, t))
        assert not problem and np.array_equal(x.numpy(), t["q"])


@pytest.mark.parametrize("dev", [d for d in DEVICES if d.backend in ("webgpu", "dawn")],
                         ids=[i for d, i in zip(DEVICES, IDS) if d.backend in ("webgpu", "dawn")])
def test_a_read_back_past_its_bound_or_interrupted_is_cancelled(dev: attnreg.DeviceCaps,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The wait for a read-back is bounded (ATTNREG_DEVICE_TIMEOUT) and sliced: past the
    bound, or when a signal's handler raises meanwhile, the map is cancelled and the next
    call works. A prefill's own read-back waits for the prefill (far longer than the 1 ms
    bound and the alarm's 2 ms). On Dawn that wait is always the map's; wgpu-native on
    lavapipe sometimes waits inside the submit instead (native code, which no Python bound
    reaches: the read-back then finds the map done), so there a right result passes too."""
    busy = attnreg.AttentionSpec(batch=1, seq_len=512, past_len=0, num_heads=8,
                                 kv_num_heads=8, head_size=64)
    t = make_tensors(busy, 0, poison=False)
    want = expected(busy, t)
    with _session(dev) as s:
        s.run(busy, t)                                               # compiles
        monkeypatch.setenv("ATTNREG_DEVICE_TIMEOUT", "0.001")
        try:
            _, problem = compare(busy, s.run(busy, t), want)
            assert dev.backend != "dawn" and not problem, problem or "no TimeoutError"
        except TimeoutError as exc:
            assert "ATTNREG_DEVICE_TIMEOUT" in str(exc)
        monkeypatch.delenv("ATTNREG_DEVICE_TIMEOUT")
        _, problem = compare(busy, s.run(busy, t), want)
        assert not problem, f"after a timed-out read-back: {problem}"
        results = [_armed_call(0.002, lambda: s.run(busy, t)) for _ in range(3)]
        assert not any(results), results
        _, problem = compare(busy, s.run(busy, t), want)
        assert not problem, f"after interrupted read-backs: {problem}"
