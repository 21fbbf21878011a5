"""Split-count sweep for decode on one GPU: are the rule's splits (about 4 workgroups per
compute unit, at most 64 per head) enough to fill the device? Times the bench suite's decode
cases with the session flag split_size forcing 32..512 splits, per backend, side by side in
one run (GPU time, median), and prints the ratio to the rules' default.
Usage (device tool): python3 bench/split_sweep.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics

import attnreg
from attnreg.testing import random_qkv
from attnreg.tools.bench import time_case
from attnreg.tools.bench_suites import SUITES

CASES = ("decode-f16-L8192", "decode-f32-L8192", "decode-f16-L32768", "decode-f16-L2048")
SPLITS = (0, 32, 64, 128, 256, 512)      # 0: the rules' choice


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    specs = {c.name: c.spec for cases in SUITES.values() for c in cases if c.name in CASES}
    rows = []
    for dev in attnreg.devices():
        if not dev.available or dev.device_type == "cpu" or dev.backend == "reference":
            continue
        for name, spec in specs.items():
            inputs = random_qkv(spec)
            base = None
            for n in SPLITS:
                size = spec.capacity // n if n else 0
                if n and size < 16:
                    continue
                flags = {"split_size": size, "max_splits": max(n, 64)} if n else {}
                with attnreg.Session(backend=dev.backend, device=dev.id, flags=flags) as s:
                    t, kernels = time_case(s, spec, inputs, args.iters, 10)
                    p = s.plan(spec)
                key = "gpu_s" if t.get("gpu_s") else "wall_s"
                us = statistics.median(t[key]) * 1e6
                base = base or us
                row = {"backend": dev.backend, "case": name, "split_size": p.params.get("split_size"),
                       "n_splits": p.params.get("n_splits"), "us": round(us, 2),
                       "vs_default": round(base / us, 3), "kernels": kernels}
                rows.append(row)
                print(f"{dev.backend:7} {name:18} split_size={row['split_size']:5} "
                      f"n_splits={row['n_splits']:4} {us:8.1f} us  x{row['vs_default']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
