"""Shared-prefix (cascade) attention: what attending a common prefix once saves.

N requests share a P-token prefix and each has its own S-token suffix; one decode row each.
  full:    every request attends its own copy of prefix + suffix (batch N, P + S keys).
  cascade: the prefix once, with the N requests as N query rows of one batch entry (P keys),
           plus each suffix (batch N, S keys), then attnreg's merge_states on the device.
Both give the same output (checked against the float64 reference, and tests/core/test_merge.py
checks the method). Prints per device: median time of each part, the ratio full / cascade,
and the KV bytes each reads. Kernel times (the merge's reduce kernel included) are GPU time
where the runtime has timestamps, wall time otherwise; Session.merge_states' wall time, with
its host copies of the states, is printed beside them.

  python3 bench/shared_prefix.py [--requests 16] [--prefix 4096] [--suffix 128]
                                 [--heads 16/4] [--head-size 128] [--backend webgpu,opencl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import attnreg
from attnreg.states import check_partials, merge_as_reduce
from attnreg.tools.bench import time_case


def _specs(n: int, p: int, s: int, nq: int, nkv: int, h: int, dtype: str
           ) -> tuple[attnreg.AttentionSpec, attnreg.AttentionSpec, attnreg.AttentionSpec]:
    common = dict(num_heads=nq, kv_num_heads=nkv, head_size=h, dtype=dtype, causal=False)
    full = attnreg.AttentionSpec(batch=n, seq_len=1, past_len=p + s - 1, **common)
    pre = attnreg.AttentionSpec(batch=1, seq_len=n, past_len=p - n, return_lse=True, **common)
    suf = attnreg.AttentionSpec(batch=n, seq_len=1, past_len=s - 1, return_lse=True, **common)
    return full, pre, suf


def _median_us(t: dict[str, list[float]]) -> float:
    key = "gpu_s" if t.get("gpu_s") else "wall_s"
    return statistics.median(t[key]) * 1e6


def _merge_times(sess: attnreg.Session, states: list[tuple[np.ndarray, np.ndarray]],
                 iters: int) -> tuple[float, float]:
    """(device time of the merge's reduce kernel, wall time of Session.merge_states with its
    host round trip). The reduce is timed on the inputs merge_states builds (merge_as_reduce)."""
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sess.merge_states(states)
        host.append(time.perf_counter() - t0)
    spec, o_parts, lse_parts, _ = merge_as_reduce(states)
    inputs = check_partials(spec, o_parts, lse_parts, None)
    plan = sess.plan(spec, op="reduce", params={"n_splits": len(states)})
    rt = sess.runtime(plan)
    dev = _median_us(rt.timings(plan, inputs, iters=iters, warmup=2))
    return dev, statistics.median(host) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--heads", default="16/4")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--backend", default="webgpu,opencl")
    ap.add_argument("--gpu-only", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    nq, nkv = (int(x) for x in a.heads.split("/"))
    n, p, s, h = a.requests, a.prefix, a.suffix, a.head_size
    full, pre, suf = _specs(n, p, s, nq, nkv, h, a.dtype)
    rng = np.random.default_rng(0)

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(a.dtype)
    q = rnd(n, 1, nq, h)                                    # BSNH: one decode row per request
    kp, vp = rnd(1, nkv, p, h), rnd(1, nkv, p, h)           # BNSH caches
    ks, vs = rnd(n, nkv, s, h), rnd(n, nkv, s, h)
    t_full = {"q": q, "k": np.concatenate([np.repeat(kp, n, 0), ks], 2),
              "v": np.concatenate([np.repeat(vp, n, 0), vs], 2)}
    t_pre = {"q": np.ascontiguousarray(q.transpose(1, 0, 2, 3)), "k": kp, "v": vp}
    t_suf = {"q": q, "k": ks, "v": vs}
    want = attnreg.run(full, t_full, backend="reference")         # float64, [N, 1, Nq, H]
    kv_bytes = {"full": 2 * t_full["k"].nbytes, "cascade": 2 * (kp.nbytes + ks.nbytes)}
    print(f"{n} requests, prefix {p}, suffix {s}, heads {nq}/{nkv}, H={h}, {a.dtype}; KV read: "
          f"full {kv_bytes['full'] / 1e6:.1f} MB, cascade {kv_bytes['cascade'] / 1e6:.1f} MB")
    rows = []
    for b in a.backend.split(","):
        for dev in attnreg.devices(b):
            if not dev.available or (a.gpu_only and dev.device_type == "cpu"):
                continue
            with attnreg.Session(backend=b, device=dev.id) as sess:
                try:
                    us_full = _median_us(time_case(sess, full, t_full, a.iters, 2)[0])
                except attnreg.SpecError as exc:       # e.g. over a storage-binding cap
                    print(f"{b}/{dev.slug}: full attention refused: {str(exc).splitlines()[0]}")
                    continue
                us_pre = _median_us(time_case(sess, pre, t_pre, a.iters, 2)[0])
                us_suf = _median_us(time_case(sess, suf, t_suf, a.iters, 2)[0])
                o_pre, l_pre = sess.run(pre, t_pre)
                o_suf, l_suf = sess.run(suf, t_suf)
                states = [(o_pre[0][:, :, None, :], l_pre[0].T[:, :, None]),
                          (o_suf.transpose(0, 2, 1, 3), l_suf)]
                o, _ = sess.merge_states(states)               # compiles the reduce
                us_merge, us_merge_host = _merge_times(sess, states, a.iters)
            err = float(np.max(np.abs(o.transpose(0, 2, 1, 3) - want)))
            casc = us_pre + us_suf + us_merge
            row = {"device": f"{b}/{dev.slug}", "full_us": round(us_full, 1),
                   "prefix_us": round(us_pre, 1), "suffix_us": round(us_suf, 1),
                   "merge_us": round(us_merge, 1), "merge_host_us": round(us_merge_host, 1),
                   "cascade_us": round(casc, 1),
                   "ratio": round(us_full / casc, 2), "max_err": err}
            rows.append(row)
            print(f"{row['device']:22} full {us_full:10.1f} us | cascade {casc:10.1f} us "
                  f"(prefix {us_pre:.1f} + suffix {us_suf:.1f} + merge {us_merge:.1f}) | "
                  f"merge_states with host copies {us_merge_host:.0f} us | "
                  f"{row['ratio']:.2f}x | max err vs reference {err:.1e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kv_bytes": kv_bytes, "rows": rows}, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
