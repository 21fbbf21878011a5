"""Measurements behind the issue-8 rules and the issue-7 targets, on the local WebGPU adapter:

  check       the new variants against the float64 reference (prefill tunables, unfused,
              block skipping, paged), before anything is timed
  copy        copy_bandwidth(): the bench's roof
  overhead    host time per decode call (KV cache + device tensors, out=): submit+wait and
              submit only, L=2048 f16 GQA 32/8 H=128
  blocks      block skipping vs the dense-bias kernel: 4 sequences packed in one batch entry
              (block-diagonal bias), prefill and decode-style rows
  crossover   fused (decode_partial + reduce) vs unfused (decode_qk + decode_pv + reduce)
              decode over GQA group, head size and L

    python3 -m attnreg.backends.webgpu.bench_variants --out DIR [--quick] [--only check,copy,...]

Each stage writes DIR/<stage>.json as soon as it finishes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import attnreg
from attnreg.spec import AttentionSpec
from attnreg.testing import compare, expected, make_tensors

STAGES = ("check", "copy", "overhead", "blocks", "crossover")


def _runtime(s: attnreg.Session) -> Any:
    return s.device_runtime(s.home_device())


def gpu_us(s: attnreg.Session, spec: AttentionSpec, inputs: Mapping[str, Any], *,
           iters: int = 20, **plan_kw: Any) -> dict[str, Any]:
    """Median GPU (else wall) microseconds of the plan for spec, and its kernels."""
    plan = s.plan(spec, **plan_kw)
    t = s.runtime(plan).timings(plan, inputs, iters=iters, warmup=2, warmup_s=0.05)  # type: ignore[attr-defined]
    basis = t.get("gpu_s") or t["wall_s"]
    return {"us": statistics.median(basis) * 1e6, "kernels": list(plan.kernels),
            "params": dict(plan.params)}


def packed_bias(lengths: Sequence[int], rows: int | None = None) -> np.ndarray:
    """[1, 1, rows, n] block-diagonal bias of sequences packed in one batch entry."""
    n = sum(lengths)
    full = np.full((n, n), -np.inf, np.float32)
    start = 0
    for L in lengths:
        full[start:start + L, start:start + L] = 0.0
        start += L
    return np.ascontiguousarray(full[n - (rows or n):][None, None])


# -- check ---------------------------------------------------------------------------------
def check(s: attnreg.Session, quick: bool) -> list[dict[str, Any]]:
    rows = []

    def one(name: str, spec: AttentionSpec, t: dict[str, Any], **kw: Any) -> None:
        try:
            err, problem = compare(spec, s.run(spec, t, **kw), expected(spec, t))
        except Exception as exc:
            err, problem = float("inf"), f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append({"case": name, "max_err": err, "ok": not problem, "problem": problem})

    for name, spec in (("decode-L2048", AttentionSpec(seq_len=1, past_len=2047, num_heads=32,
                                                       kv_num_heads=8, head_size=128,
                                                       dtype="float16")),
                       ("whisper-S4-T1500", AttentionSpec(seq_len=4, past_len=1496, num_heads=8,
                                                          kv_num_heads=8, head_size=64,
                                                          dtype="float16", causal=False)),
                       ("prefill-S512", AttentionSpec(seq_len=128 if quick else 512, past_len=0,
                                                      num_heads=32, kv_num_heads=8, head_size=128,
                                                      dtype="float16", causal=True))):
        one(f"default-plan-{name}", spec, make_tensors(spec, 0))
    pre = AttentionSpec(batch=2, seq_len=45, past_len=60, num_heads=4, kv_num_heads=2,
                        head_size=128, dtype="float16", causal=True, seqlens_k=True,
                        kv_capacity=110, bias=True, return_lse=True)
    t = make_tensors(pre, 1, lengths=[105, 70], mask_frac=0.1)
    for staging in ("direct", "workgroup"):
        for step in (8, 16, 32, 64):
            for out_tile in ("registers", "half_workgroup"):
                p = {"kv_staging": staging, "max_k_step": step, "out_tile": out_tile,
                     "kv_tile": 32, "q_tile": 16}
                one(f"prefill-{staging}-k{step}-{out_tile}", pre, t,
                    kernel="webgpu.prefill.f16.sg", params=p)
    dec = AttentionSpec(batch=2, seq_len=3, past_len=2000, num_heads=32, kv_num_heads=8,
                        head_size=128, dtype="float16", causal=True, seqlens_k=True,
                        kv_capacity=2100, softcap=5.0, head_sink=True, return_lse=True)
    t = make_tensors(dec, 2, lengths=[2100, 777])
    for kid in ("webgpu.decode_qk.f16.m4", "webgpu.decode_partial.f16.m4"):
        one(kid, dec, t, kernel=kid)
    paged = dec.replace(kv_layout="paged", page_size=16, num_pages=200, kv_capacity=2096)
    t = make_tensors(paged, 3, lengths=[2096, 500])
    for kid in ("webgpu.decode_qk.f16.m4", "webgpu.decode_partial.f16.m4"):
        one(f"paged-{kid}", paged, t, kernel=kid)
    lengths = [512] * 4 if not quick else [128] * 4
    n = sum(lengths)
    bs = AttentionSpec(seq_len=n, past_len=0, num_heads=8, kv_num_heads=8, head_size=64,
                       dtype="float16", causal=True, bias=True)
    t = make_tensors(bs, 4)
    t["bias"] = packed_bias(lengths)
    one("prefill-blocks", bs, t, kernel="webgpu.prefill.f16.sg.blocks")
    bd = bs.replace(seq_len=4, past_len=n - 4)
    t = make_tensors(bd, 5)
    t["bias"] = packed_bias(lengths, rows=4)
    one("decode-blocks-m1", bd, t, kernel="webgpu.decode_partial.f16.m1.blocks")
    one("decode-blocks-m4", bd, t, kernel="webgpu.decode_partial.f16.m4.blocks")
    return rows


# -- copy, overhead --------------------------------------------------------------------------
def copy(s: attnreg.Session, quick: bool) -> dict[str, Any]:
    rt = _runtime(s)
    size = (64 if quick else 256) << 20
    return {"copy_gb_s": rt.copy_bandwidth(size, repeats=5), "bytes": size,
            "accounting": "bytes read + bytes written per second (2 x size / time)",
            "timestamps_inside_encoders": "timestamp-query-inside-encoders" in rt.dev.features}


def overhead(s: attnreg.Session, quick: bool, L: int = 2048) -> dict[str, Any]:
    """Host microseconds per decode call over a KV cache of L tokens with device tensors."""
    rng = np.random.default_rng(0)
    cache = s.kv_cache(batch=1, kv_num_heads=8, head_size=128, capacity=L, dtype="float16")
    kv = rng.standard_normal((1, L - 1, 8, 128)).astype(np.float16)
    cache.append(kv, kv)
    spec = cache.spec(num_heads=32, seq_len=1, causal=True)
    q = s.tensor(rng.standard_normal(spec.q_shape).astype(np.float16))
    out = s.empty(spec.out_shape, "float16")
    tensors = cache.tensors(q)
    rt = _runtime(s)
    n = 100 if quick else 1000
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:               # clocks up, plan and bind groups made
        s.run(spec, tensors, out=out)
    rt.dev.wait()
    plan = s.plan(spec)
    res: dict[str, Any] = {"spec": spec.short(), "kernels": list(plan.kernels), "calls": n}

    def timed(label: str, call: Callable[[], Any], wait_inside: bool) -> None:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            if wait_inside:
                rt.dev.wait()
            ts.append(time.perf_counter() - t0)
            if not wait_inside:
                rt.dev.wait()
        res[label] = {"median_us": statistics.median(ts) * 1e6,
                      "p90_us": float(np.percentile(ts, 90)) * 1e6}

    timed("run_submit_wait", lambda: s.run(spec, tensors, out=out), True)
    timed("run_submit_only", lambda: s.run(spec, tensors, out=out), False)
    timed("launch_submit_only", lambda: rt.launch(plan, tensors, outputs={"out": out}), False)
    def step() -> None:                              # one token appended, then attention
        cache.lengths[0] = L - 1
        cache.append(kv[:, :1], kv[:, :1])
        s.run(spec, tensors, out=out)

    timed("append_run_wait", step, True)
    res["gpu_us"] = gpu_us(s, spec, tensors)["us"]
    res["counters"] = dict(rt.counters)
    return res


# -- block skipping ----------------------------------------------------------------------------
def blocks(s: attnreg.Session, quick: bool) -> list[dict[str, Any]]:
    seq = 128 if quick else 512
    lengths = [seq] * 4
    n = sum(lengths)
    rows = []
    cases = [("prefill-noncausal", AttentionSpec(seq_len=n, past_len=0, num_heads=8,
                                                 kv_num_heads=8, head_size=64, dtype="float16",
                                                 causal=False, bias=True), None),
             ("prefill-causal", AttentionSpec(seq_len=n, past_len=0, num_heads=8, kv_num_heads=8,
                                              head_size=64, dtype="float16", causal=True,
                                              bias=True), None),
             ("decode-S4-last-seq", AttentionSpec(seq_len=4, past_len=n - 4, num_heads=32,
                                                  kv_num_heads=8, head_size=128, dtype="float16",
                                                  causal=True, bias=True), 4)]
    for name, spec, last in cases:
        t = make_tensors(spec, 6, poison=False)
        host_bias = packed_bias(lengths, rows=last)
        t["bias"] = host_bias
        dev = {**t, "bias": s.tensor(host_bias)}   # device bias: lists built once
        row: dict[str, Any] = {"case": name, "spec": spec.short()}
        for mode in ("off", "on"):
            r = gpu_us(s, spec, dev, flags={"block_skip": mode})
            err, problem = compare(spec, s.run(spec, dev, flags={"block_skip": mode}),
                                   expected(spec, t))
            row[mode] = {**r, "max_err": err, "ok": not problem}
        row["speedup"] = row["off"]["us"] / row["on"]["us"]
        rows.append(row)
    # Dense-bias overhead of the block variant where nothing can be skipped.
    spec = cases[0][1]
    t = make_tensors(spec, 7, poison=False)
    t["bias"] = np.zeros((1, 1, n, n), np.float32)
    dev = {**t, "bias": s.tensor(t["bias"])}
    dense = {m: gpu_us(s, spec, dev, flags={"block_skip": m})["us"] for m in ("off", "on")}
    rows.append({"case": "prefill-all-visible-bias", "off_us": dense["off"], "on_us": dense["on"],
                 "ratio_on_over_off": dense["on"] / dense["off"]})
    return rows


# -- crossover ---------------------------------------------------------------------------------
def crossover(s: attnreg.Session, quick: bool, rounds: int = 2,
              lengths: Sequence[int] = (512, 2048, 8192, 32768)) -> list[dict[str, Any]]:
    rows = []
    for h in (64, 128):
        for g in (1, 4, 8):
            for L in lengths:
                spec = AttentionSpec(seq_len=1, past_len=L - 1, num_heads=8 * g, kv_num_heads=8,
                                     head_size=h, dtype="float16", causal=True)
                rng = np.random.default_rng(L)
                t = {n: (rng.standard_normal(sh) * 0.5).astype(np.float16)
                     for n, sh in (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
                # Interleaved rounds, best median of each: a busy moment decides nothing.
                iters = 5 if quick else 20
                best: dict[str, dict[str, Any]] = {}
                for _ in range(rounds):
                    for route in ("split_kv", "split_kv_unfused"):
                        r = gpu_us(s, spec, t, iters=iters, flags={"route": route})
                        if route not in best or r["us"] < best[route]["us"]:
                            best[route] = r
                fused, unfused = best["split_kv"], best["split_kv_unfused"]
                rows.append({"group": g, "head_size": h, "L": L, "fused_us": fused["us"],
                             "unfused_us": unfused["us"], "unfused_over_fused":
                             unfused["us"] / fused["us"], "split": fused["params"].get("n_splits")})
                print(json.dumps(rows[-1]), flush=True)
    return rows


RUNNERS: dict[str, Callable[[attnreg.Session, bool], Any]] = {
    "check": check, "copy": copy, "overhead": overhead, "blocks": blocks, "crossover": crossover}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (lavapipe)")
    ap.add_argument("--only", default=",".join(STAGES))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with attnreg.Session(backend="webgpu") as s:
        caps = s.runtime(s.plan(AttentionSpec())).caps
        (out / "device.json").write_text(json.dumps({"device": caps.label, "name": caps.name}))
        print("device:", caps.label, flush=True)
        for stage in a.only.split(","):
            t0 = time.perf_counter()
            try:
                res = RUNNERS[stage](s, a.quick)
            except Exception as exc:          # keep the other stages' results
                res = {"error": f"{type(exc).__name__}: {exc}"}
            (out / f"{stage}.json").write_text(json.dumps(res, indent=1, default=str))
            print(f"[{stage}] {time.perf_counter() - t0:.1f} s", json.dumps(res, default=str)[:2000],
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
