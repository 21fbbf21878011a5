"""`attnreg bench`: the named suites (bench_suites.py) timed side by side on every device and
beside the peers; bench_report.py prints and plots the rows.

Each case is timed through its runtime's ``timings()`` (inputs uploaded once, no read-back
per iteration, GPU time from timestamp queries / profiling events where the device has them,
wall clock otherwise): per launch ("gpu us") and back to back ("b2b us": N launches
enqueued without waiting, the first start to the last end, / N).
Reported: medians, effective GB/s (bytes that must move: q, visible k/v, out), TFLOP/s, and
the fraction of the case's limit (bench_limits.py: bytes over the measured copy roof, FLOPs
over the GEMM probe's rate for subgroup-matrix kernels, over the datasheet's otherwise).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import api, headpad
from .. import registry as regmod
from ..caps import DeviceCaps
from ..errors import NoKernelError, SpecError
from ..plan import Plan
from ..quant import quantize_kv
from ..session import Session
from ..spec import AttentionSpec
from ..tensors import check_tensors
from . import bench_limits
from .bench_report import Row
from .bench_suites import QUICK, SUITES, Case, traffic


def _inputs(spec: AttentionSpec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {n: (rng.standard_normal(s) * 0.5).astype(spec.dtype) for n, s in
         (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    if spec.kv_dtype is not None:           # the same values, quantized as a cache holds them
        for n in ("k", "v"):
            t[n], t[f"{n}_scale"] = quantize_kv(t[n], spec.kv_dtype)
    return check_tensors(spec, t)


# The float64 reference output of each spec's bench inputs (_inputs is seeded), computed once
# per process rather than once per device (a prefill's is seconds of numpy).
_EXPECTED: dict[AttentionSpec, np.ndarray] = {}


def _expected(spec: AttentionSpec, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    from ..reference import attention, out_layout
    if spec not in _EXPECTED:
        _EXPECTED[spec] = out_layout(spec, attention(spec, inputs)[0])
    return _EXPECTED[spec]


def _median_us(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e6


def time_plan(session: Session, plan: Plan, inputs: Mapping[str, Any], iters: int,
              warmup: int) -> dict[str, Any]:
    """Per-launch timings of a plan on its session's runtime (inputs bound once)."""
    rt = session.runtime(plan)
    inputs = headpad.host_inputs(plan, inputs)                 # a padded plan's kernel inputs
    rt.launch(plan, inputs)                                    # compiles, warms caches
    return rt.timings(plan, inputs, iters=iters, warmup=warmup)


def time_case(session: Session, spec: AttentionSpec, inputs: Mapping[str, np.ndarray],
              iters: int, warmup: int) -> tuple[dict[str, list[float]], str]:
    """Per-iteration timings for one spec on the session's device, and the kernels used."""
    _, plan = session.run_with_plan(spec, inputs)              # compiles, warms caches
    times = session.runtime(plan).timings(plan, headpad.host_inputs(plan, inputs), iters=iters,
                                          warmup=warmup)
    return times, " -> ".join(plan.kernels)


# Suites beside the table's: timed by their own code below.
OWN_SUITES = ("decode-loop", "context-parallel")


def run_suites(suites: Sequence[str], *, backend: str | None = None, device: str | None = None,
               quick: bool = False, iters: int = 50, warmup: int = 5, check: bool = True,
               peers: bool = True, gpu_only: bool = False, flags: Mapping[str, Any] | None = None,
               cp_length: int | None = None, cp_ranks: int = 2,
               log: Callable[[str], None] = print) -> list[Row]:
    table = QUICK if quick else SUITES
    for s in suites:
        if s not in table and s not in OWN_SUITES:
            raise SpecError("suite", s, f"one of {sorted([*table, *OWN_SUITES])}")
    names = backend.split(",") if backend else [None]
    devs = [d for b in names for d in api.devices(b) if d.available]
    if device is not None:
        devs = [d for d in devs if device in (d.id, d.name) or device.lower() in d.name.lower()]
    devs = _device_filter(devs, gpu_only)
    rows: list[Row] = []
    _EXPECTED.clear()
    for dev in devs if any(s in table for s in suites) else []:
        cases = [(suite, case) for suite in suites for case in table.get(suite, [])]
        rows += _bench_device(dev, cases, iters, warmup, check, flags, log)
    if "decode-loop" in suites:
        for dev in (d for d in devs if d.backend != "reference"):
            with Session(backend=dev.backend, device=dev.id) as session:
                try:
                    for layout in ("BSNH", "BNSH"):
                        rows.append(decode_loop(session, dev, length=512 if quick else 2048,
                                                steps=8 if quick else 64, layout=layout, log=log))
                    rows += engine_loop(dev, length=512 if quick else 2048,
                                        steps=8 if quick else 64, log=log)
                except NoKernelError as exc:
                    log(f"  {dev.backend}/{dev.slug} decode-loop: n/a ({exc.explanation[:80]})")
    if "context-parallel" in suites:
        from . import bench_cp
        cp_backends = backend.split(",") if backend else sorted(
            {d.backend for d in devs} - {"reference", "browser"})
        rows += bench_cp.run(cp_backends, device=device, flags=flags,
                             length=cp_length or (4096 if quick else 131072), ranks=cp_ranks,
                             iters=iters, warmup=warmup, check=check, log=log)
    if peers:
        for suite in suites:
            for case in table.get(suite, []):
                if case.spec.kv_dtype is None:      # the peers read float K/V only
                    rows += peer_rows(suite, case, iters, warmup, log)
    return rows


def _bench_device(dev: DeviceCaps, cases: list[tuple[str, Case]], iters: int, warmup: int,
                  check: bool, flags: Mapping[str, Any] | None,
                  log: Callable[[str], None]) -> list[Row]:
    """The device's roofs (copy bandwidth, the GEMM probe's rate) and every case on it."""
    rows: list[Row] = []
    with Session(backend=dev.backend, device=dev.id, flags=flags) as session:
        roof = copy_bandwidth(session, dev)
        if roof is not None:
            log(f"  {dev.backend}/{dev.slug}: measured copy bandwidth {roof:.1f} GB/s (the roof)")
            rows.append(Row("roof", "copy-bandwidth", dev.backend, dev.slug, "copy", None,
                            float("nan"), roof, None, None, {"roof": True}))
        probe, how = matrix_peak(session)
        log(f"  {dev.backend}/{dev.slug}: matrix units: "
            + (f"{probe:.1f} TFLOP/s ({how})" if probe else how))
        if probe:
            rows.append(Row("roof", "matrix-gemm", dev.backend, dev.slug, how, None,
                            float("nan"), None, probe, None, {"roof": True}))
        sheet = bench_limits.datasheet(dev.name)
        if sheet is not None:
            log(f"  {dev.backend}/{dev.slug}: {bench_limits.SOURCE} peaks for {dev.name}: tensor "
                f"{sheet[0]}, vector f16 {sheet[1]}, vector f32 {sheet[2]} TFLOP/s")
        for suite, case in cases:
            rows.append(_bench_one(session, dev, suite, case, iters, warmup, check, log,
                                   (roof, probe)))
    return rows


def copy_bandwidth(session: Session, dev: DeviceCaps) -> float | None:
    """The device's measured copy bandwidth (GB/s): the roof."""
    try:
        spec = AttentionSpec(seq_len=1, past_len=0, head_size=8)
        return float(session.runtime(session.plan(spec)).copy_bandwidth())
    except Exception:            # a missing roof must not stop the bench
        return None


def matrix_peak(session: Session) -> tuple[float | None, str]:
    """The device's GEMM-probe rate in TFLOP/s and its config (Runtime.matrix_peak), or None
    and why there is none."""
    try:
        spec = AttentionSpec(seq_len=1, past_len=0, head_size=8)
        return session.runtime(session.plan(spec)).matrix_peak()
    except Exception as exc:     # a failing probe must not stop the bench
        return None, f"the GEMM probe failed: {exc!r}"[:200]


def decode_loop(session: Session, dev: DeviceCaps, *, length: int = 2048, steps: int = 64,
                dtype: str = "float16", layout: str = "BNSH",
                log: Callable[[str], None] = print) -> Row:
    """A real decode loop's host cost per step on one device, GQA 32/8 H=128 over a static
    KV cache of ``length`` keys (``layout``), through a prepared call (plan once, run many).
    Parts are timed separately: writing the next query row, appending the new token's K/V
    (one strip per batch entry for BSNH, per (batch, head) for BNSH), the attention call
    (submit only: the host overhead per decode call), and a step that waits for the result."""
    rng = np.random.default_rng(0)
    b, nkv, h, nq = 1, 8, 128, 32
    cache = session.kv_cache(batch=b, kv_num_heads=nkv, head_size=h, capacity=length + 2 * steps,
                             dtype=dtype, layout=layout, device=dev.id)
    fill = rng.standard_normal((b, length - 1, nkv, h)).astype(dtype)
    cache.append(fill, fill)
    spec = cache.spec(num_heads=nq, seq_len=1, causal=True)
    q = session.empty(spec.q_shape, dtype, device=dev.id)
    out = session.empty(spec.out_shape, dtype, device=dev.id)
    kv1 = rng.standard_normal((b, 1, nkv, h)).astype(dtype)
    q_host = rng.standard_normal(spec.q_shape).astype(dtype)
    plans_before = session.plans_made
    call = session.prepare(spec, cache.tensors(q), out=out)      # plan once, run many
    parts: dict[str, list[float]] = {"q_write": [], "append": [], "call": [], "step_waited": []}
    moved = _transfers(call.runtime.counters)
    for _ in range(steps):
        t0 = time.perf_counter()
        q.write(q_host)
        t1 = time.perf_counter()
        cache.append(kv1, kv1)
        t2 = time.perf_counter()
        call()
        t3 = time.perf_counter()
        out.numpy()                          # wait for the GPU: the step a sampler sees
        t4 = time.perf_counter()
        parts["q_write"].append(t1 - t0)
        parts["append"].append(t2 - t1)
        parts["call"].append(t3 - t2)
        parts["step_waited"].append(t4 - t0)
    per_step = moved() / steps
    replans = session.plans_made - plans_before
    med, row = _loop_row(dev, f"decode-loop-{_tag(dtype)}-L{length}-{layout}",
                         "prepared call over a KV cache", parts, plans=replans, steps=steps,
                         transfers_per_step=per_step)
    log(f"  {dev.backend}/{dev.slug} decode-loop L={length} {layout}: call {med['call']:.1f} us, "
        f"append {med['append']:.1f} us, q write {med['q_write']:.1f} us, waited step "
        f"{med['step_waited']:.1f} us, {per_step:.1f} host transfers a step ({replans} plan(s) "
        f"for {steps} steps)")
    return row


def _tag(dtype: str) -> str:
    return "f16" if dtype == "float16" else "f32"


def _loop_row(dev: DeviceCaps, case: str, what: str, parts: Mapping[str, list[float]],
              **extra: Any) -> tuple[dict[str, float], Row]:
    """A decode-loop row: the medians of its timed parts (``step_waited`` the row's wall
    time), in microseconds."""
    med = {k: _median_us(v) for k, v in parts.items()}
    return med, Row("decode-loop", case, dev.backend, dev.slug, what, None, med["step_waited"],
                    None, None, None, {**{f"{k}_us": v for k, v in med.items()}, **extra})


def _transfers(counters: Mapping[str, int]) -> Callable[[], int]:
    """Host transfers (uploads and read-backs) a runtime made since this call."""
    def count() -> int:
        return sum(counters.get(n, 0) for n in ("host_uploads", "readbacks"))
    start = count()
    return lambda: count() - start


def engine_loop(dev: DeviceCaps, *, length: int = 2048, steps: int = 64, dtype: str = "float16",
                log: Callable[[str], None] = print) -> list[Row]:
    """The decode loop of an engine that owns its device and buffers (docs/interop.md), where
    the backend runs on device objects: GQA 32/8 H=128, q, K/V (BSNH, ``length`` keys), the
    lengths and out in the engine's buffers, the prepared attention recorded into a command
    stream of the engine's (encoder / queue), submitted and waited for each step. Steps
    alternate with today's loop through a Session's own tensors (the prepared call, then out
    read back: ``session_step``), so both see the same machine. The engine's own kernels,
    which would write q and the new token's K/V on the device, are not in the loop."""
    interop = regmod.get().interop(dev.backend)
    if interop is None:
        return []
    rng = np.random.default_rng(0)
    obj = interop.device(dev, {})
    spec = AttentionSpec(batch=1, seq_len=1, past_len=length - 1, num_heads=32, kv_num_heads=8,
                         head_size=128, dtype=dtype, kv_layout="BSNH", seqlens_k=True,
                         kv_capacity=length + steps, causal=True)
    host = {n: rng.standard_normal(shape).astype(dtype) for n, shape in
            (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    host["seqlens_k"] = np.array([length], np.int32)
    with Session(backend=dev.backend, device=obj) as s, \
            Session(backend=dev.backend, device=dev.id) as own:
        t = {n: s.wrap(interop.buffer(obj, a), a.shape, a.dtype.name) for n, a in host.items()}
        out = s.wrap(interop.buffer(obj, np.zeros(spec.out_shape, dtype)), spec.out_shape, dtype)
        call = s.prepare(spec, t, out=out)
        own_out = own.empty(spec.out_shape, dtype)
        own_call = own.prepare(spec, {n: own.tensor(a) for n, a in host.items()}, out=own_out)
        parts: dict[str, list[float]] = {"record": [], "step_waited": [], "session_step": []}
        moved, own_moved = _transfers(call.runtime.counters), _transfers(own_call.runtime.counters)
        for i in range(steps + 1):                 # the first: a warm-up, not timed
            t0 = time.perf_counter()
            interop.submit(obj, call.encode)
            t1 = time.perf_counter()
            interop.wait(obj)
            t2 = time.perf_counter()
            own_call()
            own_out.numpy()
            if i:
                parts["record"].append(t1 - t0)
                parts["step_waited"].append(t2 - t0)
                parts["session_step"].append(time.perf_counter() - t2)
        per_step, own_per_step = moved() / (steps + 1), own_moved() / (steps + 1)
    med, row = _loop_row(dev, f"decode-loop-{_tag(dtype)}-L{length}-engine",
                         "recorded into the engine's stream, its buffers", parts, plans=1,
                         steps=steps, transfers_per_step=per_step,
                         session_transfers_per_step=own_per_step)
    log(f"  {dev.backend}/{dev.slug} decode-loop L={length} engine: recorded step "
        f"{med['step_waited']:.1f} us (record + submit {med['record']:.1f} us), {per_step:.1f} "
        f"host transfers a step; the Session's own loop beside it {med['session_step']:.1f} us, "
        f"{own_per_step:.1f} host transfers a step")
    return [row]


# What each peer's times are (its row's "timing"): torch's come with its result.
ORT_TIMING = ("GPU time per call: the sum of the call's kernel durations from ORT's own WebGPU "
              "profiler; wall: call + a read-back that waits")


def peer_rows(suite: str, case: Case, iters: int, warmup: int,
              log: Callable[[str], None]) -> list[Row]:
    """ONNX Runtime WebGPU and torch SDPA on the same case, when they are installed."""
    from . import peers as peermod
    if all(peermod.statuses().values()):
        return []
    got = peermod.bench_peers([(case.name, case.spec)], iters=iters, warmup=warmup,
                              log=lambda m: log("  peer " + m))[0]
    out = []
    for key, name, kern in (("ort", "ort-webgpu", "com.microsoft attention op"),
                            ("torch", "torch", "scaled_dot_product_attention")):
        res = got.get(key, {})
        if not isinstance(res, dict) or "skipped" in res or "error" in res or "wall_us" not in res:
            continue
        out.append(_peer_row(suite, case, name, kern, res))
    return out


def _peer_row(suite: str, case: Case, name: str, kern: str, res: dict[str, Any]) -> Row:
    """A peer's result as a row. torch's GPU time is per call from a replayed CUDA graph of
    back-to-back calls (its b2b time too); ORT's is its profiler's kernel sum."""
    nbytes, flops = traffic(case.spec)
    desc = res.get("describe", {})
    gpu, wall = res.get("gpu_us"), float(res["wall_us"])
    basis = gpu if gpu is not None else wall
    dev = str(desc.get("device", "")) or name
    kern = str(res.get("label") or kern)        # the torch peer names the SDPA backend it kept
    extra = {"correct": res.get("correct"), "problem": res.get("problem", ""),
             "submit_us": res.get("submit_us"), "tried": desc.get("tried", {}),
             "timing": desc.get("timing", ORT_TIMING if name == "ort-webgpu" else "")}
    lim = None
    if name == "torch":   # its own copy roof; f16/bf16 SDPA runs on tensor cores, f32 not
        units = None if case.spec.dtype == "float32" else "tensor"
        pk = bench_limits.peak(str(desc.get("device_name", "")), case.spec.dtype, units, None)
        lim = bench_limits.fraction(case.spec, basis * 1e-6, desc.get("copy_gb_s"), pk)
    return Row(suite, case.name, name, dev[:24], kern, gpu, wall,
               nbytes / (basis * 1e-6) / 1e9, flops / (basis * 1e-6) / 1e12,
               res.get("max_err"), extra, b2b_us=gpu if name == "torch" else None,
               limit=lim[0] if lim else None, limit_of=lim[1] if lim else "")


def _device_filter(devs: list[DeviceCaps], gpu_only: bool) -> list[DeviceCaps]:
    """GPUs (and the reference, which is the baseline) when gpu_only."""
    return [d for d in devs if not gpu_only or d.device_type == "gpu" or d.backend == "reference"]


def _bench_one(session: Session, dev: DeviceCaps, suite: str, case: Case, iters: int,
               warmup: int, check: bool, log: Callable[[str], None],
               roofs: tuple[float | None, float | None] = (None, None)) -> Row:
    """One case on one device; ``roofs``: the device's copy GB/s and GEMM-probe TFLOP/s."""
    spec = case.spec
    inputs = _inputs(spec)
    n = max(3, iters // 10) if dev.backend == "reference" else iters
    try:
        times, kernels = time_case(session, spec, inputs, n, min(warmup, n))
    except NoKernelError as exc:  # this device cannot run the case: say why, not a failure
        first = next((r[0] for r in exc.rejected.values() if r), "no kernel")
        log(f"  {dev.backend}/{dev.slug} {case.name}: not supported ({first})")
        return Row(suite, case.name, dev.backend, dev.slug, f"n/a: {first}", None, float("nan"),
                   None, None, None)
    except Exception as exc:      # one failing case must not hide the others' numbers
        log(f"  {dev.backend}/{dev.slug} {case.name}: FAILED {exc!r}")
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return Row(suite, case.name, dev.backend, dev.slug, f"FAILED: {msg[:80]}", None,
                   float("nan"), None, None, None)
    nbytes, flops = traffic(spec)
    gpu = _median_us(times["gpu_s"]) if times.get("gpu_s") else None
    wall = _median_us(times["wall_s"])
    b2b = _median_us(times["b2b_s"]) if times.get("b2b_s") else None
    basis = gpu if gpu is not None else wall
    err = None
    if check:
        got = session.run(spec, inputs).astype(np.float64)
        err = float(np.abs(got - _expected(spec, inputs)).max())
    pk = bench_limits.peak(dev.name, spec.dtype, _matrix_api(session, session.plan(spec)),
                           roofs[1])
    lim = bench_limits.fraction(spec, basis * 1e-6, roofs[0], pk)
    row = Row(suite, case.name, dev.backend, dev.slug, kernels, gpu, wall,
              nbytes / (basis * 1e-6) / 1e9, flops / (basis * 1e-6) / 1e12, err, b2b_us=b2b,
              limit=lim[0] if lim else None, limit_of=lim[1] if lim else "")
    log(f"  {dev.backend}/{dev.slug} {case.name}: gpu {gpu and f'{gpu:.1f}'} us, b2b "
        f"{b2b and f'{b2b:.1f}'} us, wall {wall:.1f} us"
        + (f", {lim[0]:.2f} of {lim[1]}" if lim else ""))
    return row


def _matrix_api(session: Session, plan: Plan) -> str | None:
    """The API of the matrix units a plan's kernels run on (their hardware builds), or None."""
    for st in plan.stages:
        k = session.registry.kernel(st.kernel)
        if k.matrix is not None and st.params.get("mma", "hardware") == "hardware":
            return k.matrix.api
    return None
