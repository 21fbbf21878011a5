"""Measurements behind the OpenCL variants' rules: the one-launch decode (decode_fused) against
the two-launch split-KV decode, a parameter sweep of the fused decode, the unfused decode's
crossover (GQA group x head size x L), masked-block skipping on packed sequences, the
copy-bandwidth roof, and the new families' conformance cases. One run writes one JSON::

    python3 -m bench.opencl_variants --device H100 --out results.json
    python3 -m bench.opencl_variants --device pocl --quick --out pocl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import attnreg
from attnreg import reference
from attnreg.spec import AttentionSpec
from attnreg.testing import packed_docs, random_qkv
from attnreg.tools import cases
from attnreg.tools import conformance as conf

Log = Callable[[str], None]
DEADLINE = {"t": math.inf}        # perf_counter() after which remaining measurements are skipped
ROUTES = {"fused": "split_kv_fused", "two_launch": "split_kv", "unfused": "split_kv_unfused"}


def decode_spec(L: int, dtype: str = "float16", nq: int = 32, nkv: int = 8, h: int = 128,
                batch: int = 1) -> AttentionSpec:
    return AttentionSpec(batch=batch, seq_len=1, past_len=L - 1, num_heads=nq, kv_num_heads=nkv,
                         head_size=h, dtype=dtype, causal=True)


def kv_bytes(spec: AttentionSpec) -> int:
    return 2 * spec.batch * spec.kv_num_heads * spec.total_len * spec.head_size * spec.itemsize


def time_plan(s: attnreg.Session, spec: AttentionSpec, inputs: Mapping[str, Any], *,
              flags: Mapping[str, Any] | None = None, kernel: str | None = None,
              params: Mapping[str, Any] | None = None, iters: int = 30, warmup: int = 5,
              want: np.ndarray | None = None) -> dict[str, Any]:
    """Median GPU microseconds of one plan (profiling events), its stages and kernels."""
    plan = s.plan(spec, kernel=kernel, params=params, flags=flags)
    rt: Any = s.runtime(plan)
    t = rt.timings(plan, inputs, iters=iters, warmup=warmup)
    gpu = statistics.median(t["gpu_s"]) * 1e6
    row: dict[str, Any] = {
        "spec": spec.short(), "route": plan.route, "kernels": list(plan.kernels),
        "params": {k: v for st in plan.stages for k, v in st.params.items()},
        "gpu_us": round(gpu, 2), "gpu_min_us": round(min(t["gpu_s"]) * 1e6, 2),
        "wall_us": round(statistics.median(t["wall_s"]) * 1e6, 2),
        "kv_gb_s": round(kv_bytes(spec) / gpu / 1e3, 1),
        "stage_us": {k: round(statistics.median(v) * 1e6, 2)
                     for k, v in t.get("stage_gpu_s", {}).items()},
        "kernel_info": t.get("kernels", {})}
    if want is not None:
        got = s.run(spec, inputs, kernel=kernel, params=params, flags=flags)
        if isinstance(got, tuple):          # return_lse: (out, lse); want is out
            got = got[0]
        row["max_err"] = float(np.abs(got.astype(np.float64) - want).max())
    return row


def _want(spec: AttentionSpec, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    return reference.out_layout(spec, reference.attention(spec, inputs)[0])


def _safe(log: Log, what: str, fn: Callable[..., dict[str, Any]], *args: Any,
          **kw: Any) -> dict[str, Any]:
    """fn(*args, **kw) as a logged row; an error (or the deadline) becomes the row's error."""
    if time.perf_counter() > DEADLINE["t"]:
        return {"what": what, "error": "skipped: past the deadline"}
    try:
        row = fn(*args, **kw)
    except Exception as exc:          # a variant that cannot run is reported, not fatal
        row = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    row["what"] = what
    log(json.dumps(row))
    return row


def warm_up(s: attnreg.Session, seconds: float, log: Log) -> None:
    """Keep the device busy so its clocks ramp before anything is timed."""
    spec = decode_spec(8192)
    x = random_qkv(spec)
    plan = s.plan(spec)
    rt: Any = s.runtime(plan)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        rt.timings(plan, x, iters=20, warmup=0)
        n += 1
    log(f"warm-up: {n * 20} decode launches in {seconds:.1f} s")


def fused_vs_two_launch(s: attnreg.Session, log: Log, quick: bool) -> list[dict[str, Any]]:
    """The issue-4 decode: one launch (decode_fused) vs decode_partial + reduce (and the
    unfused route), with the rules' parameters and with NVIDIA's PTX conversion forced."""
    shapes = [(512, "float16"), (512, "float32")] if quick else \
        [(2048, "float16"), (8192, "float16"), (32768, "float16"), (8192, "float32")]
    rows = []
    for L, dt in shapes:
        spec = decode_spec(L, dt, *((8, 2, 64) if quick else ()))
        x = random_qkv(spec)
        want = _want(spec, x)
        runs: list[tuple[str, str, dict[str, Any] | None]] = [
            (name, route, None) for name, route in ROUTES.items()]
        if dt == "float16":
            runs += [("fused+ptx", ROUTES["fused"], {"cvt": "ptx"}),
                     ("two_launch+ptx", ROUTES["two_launch"], {"cvt": "ptx"}),
                     ("fused+ptx+fast_exp", ROUTES["fused"], {"cvt": "ptx", "fast_exp": True})]
        for name, route, params in runs:
            rows.append(_safe(log, f"decode-{name}-L{L}-{dt}", time_plan, s, spec, x,
                              flags={"route": route}, params=params, want=want))
    return rows


SWEEP: list[dict[str, Any]] = [
    {}, {"cvt": "ptx"}, {"prefetch": 2}, {"wg": 64}, {"wg": 256}, {"split_size": 64},
    {"split_size": 256}, {"split_size": 512}, {"fast_exp": True}, {"fence": "cl"},
    {"cvt": "ptx", "fast_exp": True}, {"cvt": "ptx", "prefetch": 2},
    {"cvt": "ptx", "fast_exp": True, "prefetch": 2}, {"cvt": "ptx", "fast_exp": True, "wg": 64},
    {"cvt": "ptx", "fast_exp": True, "wg": 256}, {"cvt": "ptx", "fast_exp": True, "split_size": 256},
    {"cvt": "ptx", "fast_exp": True, "split_size": 64}]


def fused_sweep(s: attnreg.Session, log: Log, quick: bool) -> list[dict[str, Any]]:
    """decode_fused parameters at L=8192 f16 (the issue-4 target) and f32."""
    rows = []
    for dt in ("float16", "float32"):
        spec = decode_spec(512 if quick else 8192, dt, *((8, 2, 64) if quick else ()))
        x = random_qkv(spec)
        want = _want(spec, x)
        for p in SWEEP[:3] if quick else SWEEP:
            if dt == "float32" and "cvt" in p:
                continue
            rows.append(_safe(log, f"fused-sweep-{dt}-{p}", time_plan, s, spec, x,
                              flags={"route": "split_kv_fused"}, params=p or None, want=want))
    return rows


def crossover(s: attnreg.Session, log: Log, quick: bool) -> list[dict[str, Any]]:
    """Unfused (decode_qk + decode_pv + reduce) vs the fused decodes, by group x head x L."""
    rows = []
    nkv = 2 if quick else 8
    Ls = (512, 1024, 2048, 4096, 8192, 16384, 32768)
    for g in (1, 4, 8):
        for h in (64, 128):
            for L in Ls:
                spec = decode_spec(L, "float16", nkv * g, nkv, h)
                x = random_qkv(spec, seed=L + g)
                row: dict[str, Any] = {"group": g, "head_size": h, "L": L}
                outs = {}
                for name, route in ROUTES.items():
                    r = _safe(log, f"crossover-{name}-g{g}-h{h}-L{L}", time_plan, s, spec, x,
                              flags={"route": route}, iters=10 if quick else 30)
                    row[f"{name}_us"] = r.get("gpu_us")
                    if "error" not in r:
                        outs[name] = s.run(spec, x, flags={"route": route}).astype(np.float64)
                if len(outs) == 3:
                    row["max_diff"] = float(max(np.abs(outs[n] - outs["fused"]).max()
                                                for n in outs))
                best = min((n for n in ROUTES if row.get(f"{n}_us")),
                           key=lambda n: row[f"{n}_us"], default=None)
                row["fastest"] = best
                rows.append(row)
                log(json.dumps(row))
    return rows


def block_skip(s: attnreg.Session, log: Log, quick: bool) -> list[dict[str, Any]]:
    """Packed sequences, block-diagonal bias: the dense-bias kernel vs block skipping (same
    results); and the cost of block skipping where nothing can be skipped (random bias)."""
    rows = []
    nq, nkv, h = (8, 2, 64) if quick else (32, 8, 128)
    for dt in ("float16",) if quick else ("float16", "float32"):
        spec, x = packed_docs(4, 512, nq, nkv, h, dt)
        dev_bias = s.tensor(x["bias"])
        resident = {**x, "bias": dev_bias}
        out = {}
        pair: dict[str, Any] = {"what": f"block-skip-4x512-{dt}", "spec": spec.short()}
        for mode in ("off", "on"):
            r = _safe(log, f"block-skip-{mode}-{dt}", time_plan, s, spec, resident,
                      flags={"block_skip": mode}, iters=5 if quick else 20,
                      warmup=1 if quick else 3)
            pair[mode] = r
            if "error" not in r:
                out[mode] = s.run(spec, resident, flags={"block_skip": mode}).astype(np.float64)
        if len(out) == 2 and pair["on"].get("gpu_us"):
            pair["speedup"] = round(pair["off"]["gpu_us"] / pair["on"]["gpu_us"], 2)
            pair["max_diff"] = float(np.abs(out["on"] - out["off"]).max())
            if quick:           # the float64 reference of S=2048 x 32 heads is slow on a host
                want = _want(spec, x)
                pair["max_err_on"] = float(np.abs(out["on"] - want).max())
                pair["max_err_off"] = float(np.abs(out["off"] - want).max())
        rows.append(pair)
        log(json.dumps({k: v for k, v in pair.items() if k not in ("on", "off")}))
        # nothing to skip: a random (finite) bias of the same shape
        rnd = np.random.default_rng(1).standard_normal(x["bias"].shape).astype(np.float32)
        x2: dict[str, Any] = {**x, "bias": s.tensor(rnd)}
        dense: dict[str, Any] = {"what": f"block-skip-dense-bias-{dt}"}
        for mode in ("off", "on"):
            dense[mode] = _safe(log, f"dense-bias-{mode}-{dt}", time_plan, s, spec, x2,
                                flags={"block_skip": mode}, iters=5 if quick else 20,
                                warmup=1 if quick else 3).get("gpu_us")
        if dense["on"] and dense["off"]:
            dense["on_over_off"] = round(dense["on"] / dense["off"], 3)
        rows.append(dense)
        log(json.dumps(dense))
    return rows


def decode_block_skip(s: attnreg.Session, log: Log, quick: bool) -> list[dict[str, Any]]:
    """Decode (S=1) over 4 packed documents: the last row sees one of them."""
    rows = []
    L = 2048 if quick else 8192
    spec = AttentionSpec(batch=1, seq_len=1, past_len=L - 1, num_heads=8 if quick else 32,
                         kv_num_heads=2 if quick else 8, head_size=64 if quick else 128,
                         dtype="float16", causal=True, bias=True)
    x = random_qkv(spec, seed=9)
    doc = np.arange(L) * 4 // L
    x["bias"] = np.where(doc == doc[-1], 0.0, -np.inf).astype(np.float32)[None, None, None]
    resident = {**x, "bias": s.tensor(x["bias"])}
    row: dict[str, Any] = {"what": f"decode-block-skip-L{L}"}
    for mode in ("off", "on"):
        row[mode] = _safe(log, f"decode-skip-{mode}", time_plan, s, spec, resident,
                          flags={"block_skip": mode}, iters=10 if quick else 30).get("gpu_us")
    if row["on"] and row["off"]:
        row["speedup"] = round(row["off"] / row["on"], 2)
    rows.append(row)
    log(json.dumps(row))
    return rows


def conformance(s: attnreg.Session, log: Log, filters: list[str],
                params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The unified generator's cells (attnreg.tools.cases) of this device's OpenCL kernels
    whose id contains one of ``filters``, optionally with params forced on top."""
    caps = s.plan(AttentionSpec()).caps
    todo = [c for c in cases.cases([caps], quick=True) if any(f in c.kernel for f in filters)]
    if params:
        todo = [dataclasses.replace(c, params=tuple(sorted({**dict(c.params), **params}.items())))
                for c in todo]
    bad, worst, t0 = [], 0.0, time.perf_counter()
    for case in todo:
        r = conf.run_case(case, s)
        if r.status != "pass":
            bad.append(f"{case.id}: {r.message[:300]}")
        else:
            worst = max(worst, r.max_abs_err)
    res = {"what": f"conformance {filters} {dict(params or {})}", "cases": len(todo),
           "failed": len(bad), "failures": bad[:40], "worst_err": worst,
           "seconds": round(time.perf_counter() - t0, 1)}
    log(json.dumps({k: v for k, v in res.items() if k != "failures"}))
    for b in bad[:40]:
        log("FAIL " + b)
    return res


PARTS = ("copy", "fused", "sweep", "crossover", "skip", "decode_skip")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU devices)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--warmup-s", type=float, default=0.0)
    ap.add_argument("--deadline-s", type=float, default=math.inf,
                    help="skip what is left after this many seconds")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    DEADLINE["t"] = time.perf_counter() + a.deadline_s
    res: dict[str, Any] = {}

    def log(msg: str) -> None:
        print(msg, flush=True)

    with attnreg.Session(backend="opencl", device=a.device) as s:
        caps = s.plan(AttentionSpec()).caps
        res["device"] = {"label": caps.label, "vendor": caps.vendor, "driver": caps.driver,
                         "units": caps.compute_units}
        log(json.dumps(res["device"]))
        if a.warmup_s:
            warm_up(s, a.warmup_s, log)
        if "copy" in parts:
            rt: Any = s.runtime(s.plan(AttentionSpec()))
            res["copy_gb_s"] = rt.copy_bandwidth()
            log(f"copy bandwidth {res['copy_gb_s']:.1f} GB/s (read + write)")
        for name, fn in (("fused", fused_vs_two_launch), ("sweep", fused_sweep),
                         ("crossover", crossover), ("skip", block_skip),
                         ("decode_skip", decode_block_skip)):
            if name in parts:
                t0 = time.perf_counter()
                res[name] = fn(s, log, a.quick)
                log(f"[{name}] {time.perf_counter() - t0:.1f} s")
                _save(a.out, res)
    _save(a.out, res)
    return 0


def _save(path: str | None, res: Mapping[str, Any]) -> None:
    """The results so far as JSON (after each part, so a run cut short keeps what it measured)."""
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
