"""`attnreg bench`: named suites timed side by side on every device, with ratios.

Each case is timed through its runtime's ``timings()`` (inputs uploaded once, no read-back
per iteration, GPU time from timestamp queries / profiling events where the device has them,
wall clock otherwise).
Reported: medians, effective GB/s (bytes that must move: q, visible k/v, out) and TFLOP/s.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import api
from ..caps import DeviceCaps
from ..errors import NoKernelError, SpecError
from ..plan import Plan
from ..quant import kv_bytes_per_token, quantize_kv
from ..session import Session
from ..spec import AttentionSpec
from ..tensors import check_tensors


@dataclass(frozen=True)
class Case:
    name: str
    spec: AttentionSpec
    note: str = ""


def _decode(L: int, dtype: str = "float16", kv_dtype: str | None = None) -> AttentionSpec:
    return AttentionSpec(batch=1, seq_len=1, past_len=L - 1, num_heads=32, kv_num_heads=8,
                         head_size=128, dtype=dtype, causal=True, kv_dtype=kv_dtype)


def _storages(cases: list[Case], long: int) -> list[Case]:
    """The kv-dtypes suite: every float16 case, then again in bfloat16 (the target: within
    5%), and the long decode with int8 and int4 K/V (the targets: 1.8x and 3x float16);
    storage_ratios compares each with its float16 twin, measured in the same run."""
    f16 = [c for c in cases if c.spec.dtype == "float16"]
    out = f16 + [Case(_bf16_name(c.name), c.spec.replace(dtype="bfloat16"), c.note) for c in f16]
    return out + [Case(f"decode-f16-{kv}-L{long}", _decode(long, kv_dtype=kv),
                       f"GQA 32/8 H=128, {kv} K/V") for kv in ("int8", "int4")]


def _bf16_name(name: str) -> str:
    return name.replace("f16", "bf16") if "f16" in name else name + "-bf16"


def twin(name: str) -> str | None:
    """The float16 case a kv-dtypes case is measured against (None: it is one)."""
    for kv in ("int8", "int4"):
        if f"-{kv}-" in name:
            return name.replace(f"-{kv}-", "-")
    if name.endswith("-bf16"):
        return name[:-len("-bf16")]
    return name.replace("bf16", "f16") if "bf16" in name else None


def storage_ratios(rows: Sequence[Row]) -> str:
    """Per backend and device: each bf16 / int8 / int4 case's speed-up over its float16 twin
    (x = twin's time / the case's; GPU time where measured)."""
    from .textui import table

    def basis(r: Row) -> float:
        return r.gpu_us if r.gpu_us is not None else r.wall_us

    ok = [r for r in rows if r.suite == "kv-dtypes" and not r.kernels.startswith(("FAILED", "n/a"))]
    by = {(r.backend, r.device, r.case): r for r in ok}
    out = []
    for r in ok:
        base = by.get((r.backend, r.device, twin(r.case) or ""))
        if base is None:
            continue
        out.append([f"{r.backend}/{r.device}", r.case, f"{basis(base):.1f}", f"{basis(r):.1f}",
                    f"{basis(base) / basis(r):.2f}x", f"{r.max_err:.2g}" if r.max_err else "-"])
    return table(("device", "case", "f16 twin (us)", "this (us)", "speed-up", "max err"), out)


SUITES: dict[str, list[Case]] = {
    "decode": [Case(f"decode-f16-L{L}", _decode(L), "GQA 32/8 H=128") for L in (2048, 8192)]
    + [Case("decode-f32-L8192", _decode(8192, "float32"), "GQA 32/8 H=128")],
    "long-context": [Case("decode-f16-L32768", _decode(32768), "GQA 32/8 H=128")],
    "whisper": [Case("whisper-S4-T1500", AttentionSpec(
        batch=1, seq_len=4, past_len=1496, num_heads=8, kv_num_heads=8, head_size=64,
        dtype="float16", causal=False), "cross-attention, 8 heads H=64")],
    "prefill": [Case(f"prefill-f16-S{S}", AttentionSpec(
        batch=1, seq_len=S, past_len=0, num_heads=32, kv_num_heads=8, head_size=128,
        dtype="float16", causal=True), "causal GQA 32/8 H=128") for S in (512, 2048)],
}
QUICK: dict[str, list[Case]] = {
    "decode": [Case("decode-f16-L512", _decode(512)),
               Case("decode-f32-L512", _decode(512, "float32"))],
    "whisper": [Case("whisper-S4-T300", AttentionSpec(
        batch=1, seq_len=4, past_len=296, num_heads=8, kv_num_heads=8, head_size=64,
        dtype="float16", causal=False))],
    "prefill": [Case("prefill-f16-S64", AttentionSpec(
        batch=1, seq_len=64, past_len=0, num_heads=8, kv_num_heads=2, head_size=64,
        dtype="float16", causal=True))],
    "long-context": [],
}
SUITES["kv-dtypes"] = _storages([c for s in ("decode", "long-context", "whisper", "prefill")
                                 for c in SUITES[s]], 32768)
QUICK["kv-dtypes"] = _storages([c for s in ("decode", "whisper", "prefill") for c in QUICK[s]],
                               512)


def visible_pairs(spec: AttentionSpec) -> int:
    """(query row, key) pairs that are visible, per (batch, head): sets the FLOPs."""
    L, S = spec.total_len, spec.seq_len
    total = 0
    for i in range(S):
        p = L - S + i
        hi = p + 1 if spec.causal else L
        lo = max(0, p - spec.local_window + 1) if spec.local_window > 0 else 0
        total += max(0, min(hi, L) - lo)
    return total


def traffic(spec: AttentionSpec) -> tuple[float, float]:
    """(bytes that must move, FLOPs) for one call, no reuse assumed beyond one read of K/V."""
    e = spec.itemsize
    q = spec.batch * spec.seq_len * spec.num_heads * spec.head_size * e
    kv = spec.batch * spec.total_len * kv_bytes_per_token(spec)    # as stored (codes + scales)
    flops = 4.0 * spec.batch * spec.num_heads * spec.head_size * visible_pairs(spec)
    return float(2 * q + kv), flops


@dataclass
class Row:
    suite: str
    case: str
    backend: str
    device: str
    kernels: str
    gpu_us: float | None
    wall_us: float
    gb_s: float | None
    tflops: float | None
    max_err: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def _inputs(spec: AttentionSpec, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {n: (rng.standard_normal(s) * 0.5).astype(spec.dtype) for n, s in
         (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    if spec.kv_dtype is not None:           # the same values, quantized as a cache holds them
        for n in ("k", "v"):
            t[n], t[f"{n}_scale"] = quantize_kv(t[n], spec.kv_dtype)
    return check_tensors(spec, t)


def _median_us(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e6


def time_plan(session: Session, plan: Plan, inputs: Mapping[str, Any], iters: int,
              warmup: int) -> dict[str, Any]:
    """Per-launch timings of a plan on its session's runtime (inputs bound once)."""
    rt = session.runtime(plan)
    rt.launch(plan, inputs)                                    # compiles, warms caches
    return rt.timings(plan, inputs, iters=iters, warmup=warmup)


def time_case(session: Session, spec: AttentionSpec, inputs: Mapping[str, np.ndarray],
              iters: int, warmup: int) -> tuple[dict[str, list[float]], str]:
    """Per-iteration timings for one spec on the session's device, and the kernels used."""
    _, plan = session.run_with_plan(spec, inputs)              # compiles, warms caches
    times = session.runtime(plan).timings(plan, inputs, iters=iters, warmup=warmup)
    return times, " -> ".join(plan.kernels)


def run_suites(suites: Sequence[str], *, backend: str | None = None, device: str | None = None,
               quick: bool = False, iters: int = 50, warmup: int = 5, check: bool = True,
               peers: bool = True, gpu_only: bool = False,
               log: Callable[[str], None] = print) -> list[Row]:
    table = QUICK if quick else SUITES
    for s in suites:
        if s not in table and s != "decode-loop":
            raise SpecError("suite", s, f"one of {sorted([*table, 'decode-loop'])}")
    names = backend.split(",") if backend else [None]
    devs = [d for b in names for d in api.devices(b) if d.available]
    if device is not None:
        devs = [d for d in devs if device in (d.id, d.name) or device.lower() in d.name.lower()]
    devs = _device_filter(devs, gpu_only)
    rows: list[Row] = []
    for dev in devs:
        with Session(backend=dev.backend, device=dev.id) as session:
            roof = copy_bandwidth(session, dev)
            if roof is not None:
                log(f"  {dev.backend}/{dev.slug}: measured copy bandwidth {roof:.1f} GB/s (the roof)")
                rows.append(Row("roof", "copy-bandwidth", dev.backend, dev.slug, "copy", None,
                                float("nan"), roof, None, None, {"roof": True}))
            for suite in suites:
                for case in table.get(suite, []):
                    rows.append(_bench_one(session, dev, suite, case, iters, warmup, check, log))
    if "decode-loop" in suites:
        for dev in (d for d in devs if d.backend != "reference"):
            with Session(backend=dev.backend, device=dev.id) as session:
                try:
                    for layout in ("BSNH", "BNSH"):
                        rows.append(decode_loop(session, dev, length=512 if quick else 2048,
                                                steps=8 if quick else 64, layout=layout, log=log))
                except NoKernelError as exc:
                    log(f"  {dev.backend}/{dev.slug} decode-loop: n/a ({exc.explanation[:80]})")
    if peers:
        for suite in suites:
            for case in table.get(suite, []):
                if case.spec.kv_dtype is None:      # the peers read float K/V only
                    rows += peer_rows(suite, case, iters, warmup, log)
    return rows


def copy_bandwidth(session: Session, dev: DeviceCaps) -> float | None:
    """The device's measured copy bandwidth (GB/s): the roof."""
    try:
        spec = AttentionSpec(seq_len=1, past_len=0, head_size=8)
        return float(session.runtime(session.plan(spec)).copy_bandwidth())
    except Exception:            # a missing roof must not stop the bench
        return None


def roofline_png(rows: Sequence[Row], path: str) -> str | None:
    """Effective GB/s against arithmetic intensity (FLOP/byte) per device, with the measured
    copy bandwidth as the roof. Needs matplotlib (pip install attnreg[bench]); returns the
    reason when it cannot draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'attnreg[bench]')"
    fig, ax = plt.subplots(figsize=(8, 5))
    table = {c.name: c.spec for cases in (*SUITES.values(), *QUICK.values()) for c in cases}
    devices = sorted({(r.backend, r.device) for r in rows if r.suite != "roof"})
    for backend, dev in devices:
        pts = [r for r in rows if (r.backend, r.device) == (backend, dev) and r.gb_s
               and r.case in table]
        if not pts:
            continue
        xs = [traffic(table[r.case])[1] / traffic(table[r.case])[0] for r in pts]
        line = ax.scatter(xs, [float(r.gb_s or 0) for r in pts], label=f"{backend}/{dev}")
        for x, r in zip(xs, pts):
            ax.annotate(r.case, (x, r.gb_s), fontsize=6, alpha=0.7)
        roof = next((r.gb_s for r in rows if r.suite == "roof" and (r.backend, r.device)
                     == (backend, dev)), None)
        if roof:
            ax.axhline(roof, linestyle="--", color=line.get_facecolor()[0],
                       label=f"{backend}/{dev} copy roof {roof:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel("effective bandwidth (GB/s)")
    ax.set_title("attnreg bench: effective bandwidth vs arithmetic intensity")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


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
    plans_before = len(session._plans)
    call = session.prepare(spec, cache.tensors(q), out=out)      # plan once, run many
    parts: dict[str, list[float]] = {"q_write": [], "append": [], "call": [], "step_waited": []}
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
    replans = len(session._plans) - plans_before
    med = {k: _median_us(v) for k, v in parts.items()}
    log(f"  {dev.backend}/{dev.slug} decode-loop L={length} {layout}: call {med['call']:.1f} us, "
        f"append {med['append']:.1f} us, q write {med['q_write']:.1f} us, waited step "
        f"{med['step_waited']:.1f} us ({replans} plan(s) for {steps} steps)")
    dt = "f16" if dtype == "float16" else "f32"
    return Row("decode-loop", f"decode-loop-{dt}-L{length}-{layout}", dev.backend, dev.slug,
               "prepared call over a KV cache", None, med["step_waited"], None, None, None,
               {**{f"{k}_us": v for k, v in med.items()}, "plans": replans, "steps": steps})


def peer_rows(suite: str, case: Case, iters: int, warmup: int,
              log: Callable[[str], None]) -> list[Row]:
    """ONNX Runtime WebGPU and torch SDPA on the same case, when they are installed."""
    from . import peers as peermod
    if all(peermod.statuses().values()):
        return []
    got = peermod.bench_peers([(case.name, case.spec)], iters=iters, warmup=warmup,
                              log=lambda m: log("  peer " + m))[0]
    nbytes, flops = traffic(case.spec)
    out = []
    for key, name, kern in (("ort", "ort-webgpu", "com.microsoft attention op"),
                            ("torch", "torch", "scaled_dot_product_attention")):
        res = got.get(key, {})
        if not isinstance(res, dict) or "skipped" in res or "error" in res or "wall_us" not in res:
            continue
        gpu, wall = res.get("gpu_us"), float(res["wall_us"])
        basis = gpu if gpu is not None else wall
        dev = str(res.get("describe", {}).get("device", "")) or name
        kern = str(res.get("label") or kern)        # the torch peer names the SDPA backend it kept
        out.append(Row(suite, case.name, name, dev[:24], kern, gpu, wall,
                       nbytes / (basis * 1e-6) / 1e9, flops / (basis * 1e-6) / 1e12,
                       res.get("max_err"), {"correct": res.get("correct"),
                                            "problem": res.get("problem", ""),
                                            "submit_us": res.get("submit_us")}))
    return out


def _device_filter(devs: list[DeviceCaps], gpu_only: bool) -> list[DeviceCaps]:
    """GPUs (and the reference, which is the baseline) when gpu_only."""
    return [d for d in devs if not gpu_only or d.device_type == "gpu" or d.backend == "reference"]


def _bench_one(session: Session, dev: DeviceCaps, suite: str, case: Case, iters: int,
               warmup: int, check: bool, log: Callable[[str], None]) -> Row:
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
    basis = gpu if gpu is not None else wall
    err = None
    if check:
        from ..reference import attention, out_layout
        got = session.run(spec, inputs).astype(np.float64)
        err = float(np.abs(got - out_layout(spec, attention(spec, inputs)[0])).max())
    row = Row(suite, case.name, dev.backend, dev.slug, kernels, gpu, wall,
              nbytes / (basis * 1e-6) / 1e9, flops / (basis * 1e-6) / 1e12, err)
    log(f"  {dev.backend}/{dev.slug} {case.name}: gpu {gpu and f'{gpu:.1f}'} us, wall "
        f"{wall:.1f} us")
    return row


def ratios(rows: Sequence[Row]) -> str:
    """Per case: attnreg's best GPU-time row against each peer (x = peer time / ours)."""
    from .textui import table

    def basis(r: Row) -> float:
        return r.gpu_us if r.gpu_us is not None else r.wall_us

    peers = ("ort-webgpu", "torch", "reference")
    out = []
    for case in dict.fromkeys(r.case for r in rows if r.suite not in ("roof", "decode-loop")):
        mine = [r for r in rows if r.case == case and r.backend not in peers
                and not r.kernels.startswith(("FAILED", "n/a"))]
        if not mine:
            continue
        best = min(mine, key=basis)
        webgpu = [r for r in mine if r.backend == "webgpu"]
        hosts: dict[str, str] = {}
        for r in sorted(mine, key=basis):
            hosts.setdefault(r.backend, f"{r.backend} {basis(r):.1f}")
        cells = [case, f"{best.backend}/{best.device} {basis(best):.1f} us",
                 ", ".join(hosts.values())]
        for peer in peers:
            pr = next((r for r in rows if r.case == case and r.backend == peer), None)
            mine_r = min(webgpu, key=basis) if peer == "ort-webgpu" and webgpu else best
            if pr is None:
                cells.append("-")
                continue
            flag = "" if pr.extra.get("correct", True) else " (peer WRONG)"
            cells.append(f"{basis(pr):.1f} us = {basis(pr) / basis(mine_r):.2f}x{flag}")
        out.append(cells)
    return table(("case", "attnreg best", "each backend (us)", "ORT WebGPU (vs our webgpu)",
                  "torch SDPA",
                  "numpy reference"), out)


def format_rows(rows: Sequence[Row]) -> str:
    from .textui import table

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None or x != x else format(x, fmt)

    # Ratios side by side: every row against the numpy reference of the same case.
    ref = {r.case: r.wall_us for r in rows if r.backend == "reference"}
    out = []
    for r in rows:
        if r.suite == "roof":
            out.append((r.case, r.backend, r.device, "device-to-device copy", "-", "-",
                        f(r.gb_s, ".1f"), "-", "-", "-"))
            continue
        if r.suite == "decode-loop":
            e = r.extra
            parts = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in e.items()
                              if k.endswith("_us") and k != "step_waited_us")
            out.append((r.case, r.backend, r.device, f"{parts}; {e.get('plans')} plan(s)",
                        "-", f(r.wall_us, ".1f"), "-", "-", "-", "-"))
            continue
        basis = r.gpu_us if r.gpu_us is not None else r.wall_us
        vs = f"{ref[r.case] / basis:.1f}x" if r.case in ref and r.backend != "reference" else "-"
        out.append((r.case, r.backend, r.device, r.kernels, f(r.gpu_us, ".1f"), f(r.wall_us, ".1f"),
                    f(r.gb_s, ".1f"), f(r.tflops, ".3f"), vs, f(r.max_err, ".1e")))
    return table(("case", "backend", "device", "kernels", "gpu us", "wall us", "GB/s", "TFLOP/s",
                  "vs numpy", "max err"), out)


def read_json(path: str) -> list[Row]:
    with open(path) as fh:
        return [Row(**r) for r in json.load(fh)]


def write_json(rows: Sequence[Row], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([asdict(r) for r in rows], fh, indent=2)
