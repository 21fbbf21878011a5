"""Attention error of quantized K/V (kv_dtype int8 / int4) against float16 K/V.

For decode-like specs (GQA 32/8, H=128, one query row over L keys) the float64 reference is
run three times on the same data: K/V in float16 (the baseline), and K/V quantized with
attnreg.quantize_kv to int8 and int4 (the kernels' math on the stored codes). Each row
prints the error of the output against the float32-exact attention of the unquantized
values, as max |err| and RMS relative to the output's RMS, for two kinds of data:
  random:   q, k, v ~ N(0, 1);
  outliers: as random, but 4 of K's 128 channels scaled by 20 (as in real models, whose
            keys have a few large-magnitude channels): int4's 32-element blocks and int8's
            per-vector scale then spend their range on those channels.
Machine-independent (numpy, float64), so it runs anywhere:

  python3 -m bench.kv_quant_quality [--length 4096] [--seeds 3]
"""
from __future__ import annotations

import argparse

import numpy as np

import attnreg
from attnreg import testing
from attnreg.quant import kv_bytes_per_token


def _inputs(spec: attnreg.AttentionSpec, seed: int, outliers: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {n: rng.standard_normal(s).astype(np.float32)
         for n, s in (("q", spec.q_shape), ("k", spec.kv_shape), ("v", spec.kv_shape))}
    if outliers:
        chans = rng.choice(spec.head_size, 4, replace=False)
        t["k"][..., chans] *= 20.0
    return t


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    err = got.astype(np.float64) - want
    return float(np.abs(err).max()), float(np.sqrt((err ** 2).mean() / (want ** 2).mean()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    spec32 = attnreg.AttentionSpec(seq_len=1, past_len=args.length - 1, num_heads=32,
                                   kv_num_heads=8, head_size=128, dtype="float32",
                                   kv_layout="BSNH")
    print(f"decode GQA 32/8 H=128 L={args.length}, float64 reference, {args.seeds} seeds; "
          "error of out vs the unquantized values' attention")
    print(f"{'data':9s} {'K/V storage':12s} {'B/token':>8s} {'max |err|':>10s} "
          f"{'rel RMS err':>12s}")
    for outliers in (False, True):
        rows: dict[str, list[tuple[float, float]]] = {}
        for seed in range(args.seeds):
            t = _inputs(spec32, seed, outliers)
            want = testing.expected(spec32, t)[0].astype(np.float64)
            f16 = spec32.replace(dtype="float16")
            th = {n: a.astype(np.float16) for n, a in t.items()}
            out = attnreg.run(f16, th, backend="reference")
            rows.setdefault("float16", []).append(_errors(out, want))
            for kv in ("int8", "int4"):
                sq = f16.replace(kv_dtype=kv)
                tq = dict(th)
                for n in ("k", "v"):
                    tq[n], tq[f"{n}_scale"] = attnreg.quantize_kv(t[n], kv)
                out = attnreg.run(sq, tq, backend="reference")
                rows.setdefault(kv, []).append(_errors(out, want))
        for name, errs in rows.items():
            spec = spec32.replace(dtype="float16", kv_dtype=None if name == "float16" else name)
            nbytes = kv_bytes_per_token(spec)
            mx = max(e[0] for e in errs)
            rel = float(np.mean([e[1] for e in errs]))
            print(f"{'outliers' if outliers else 'random':9s} {name:12s} {nbytes:8d} "
                  f"{mx:10.2e} {rel:12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
