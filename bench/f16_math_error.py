"""What packed-f16 arithmetic would do to a prefill's results (#35 must-have 3's lead).

The lead for the scalar WGSL prefill was `vec2<f16>` / `vec4<f16>` FMAs: twice f32's rate on
GPUs with shader-f16, but only if the products are *accumulated* in f16 (converting each
product to f32 to add it costs what the packed FMA saves). This script computes causal
attention of one head the way such a kernel would, in numpy, and judges it by the contract's
float16 tolerance (attnreg.kernel.TOLERANCE) against the float64 reference:

  QK: q * scale rounded to f16 (as the kernels fold the scale into q), then each lane of a
      vec2 accumulates its half of the head in f16 with fused multiply-adds (one rounding per
      FMA); the two lanes' sums meet in f32.
  PV: the weights exp(s - m) rounded to f16, each 32-key step's p * v accumulated in f16 with
      FMAs, the steps' sums added in f32 (as the kernel's running output would be).

Three kinds of data: q, k, v ~ N(0, 1); q and k ~ N(0, 4^2) (logits of std ~16, the peaked
softmax of trained models); q and k ~ N(0, 40^2) (large activations). Machine-independent
(numpy), so it runs anywhere:

  python3 -m bench.f16_math_error [--seq 512] [--head-size 128]
"""
from __future__ import annotations

import argparse

import numpy as np

from attnreg.kernel import TOLERANCE

STEP = 32           # keys per PV step, the scalar prefill's K_STEP
KINDS = (("q, k, v ~ N(0, 1)", 1.0), ("q, k ~ N(0, 4^2)", 4.0), ("q, k ~ N(0, 40^2)", 40.0))


def _f16_fma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc + a * b with one rounding to f16 (the exact sum rounded, as an FMA does)."""
    return (acc.astype(np.float64) + a.astype(np.float64) * b.astype(np.float64)).astype(
        np.float16)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, packed: bool) -> np.ndarray:
    s_len, h = q.shape
    scale = 1.0 / np.sqrt(h)
    if packed:
        qh = (q.astype(np.float32) * np.float32(scale)).astype(np.float16)
        lanes = [np.zeros((s_len, s_len), np.float16) for _ in range(2)]
        for d in range(0, h, 2):
            for lane in range(2):
                lanes[lane] = _f16_fma(lanes[lane], qh[:, None, d + lane], k[None, :, d + lane])
        s = lanes[0].astype(np.float64) + lanes[1].astype(np.float64)
    else:
        s = (q.astype(np.float64) * scale) @ k.astype(np.float64).T
    s = np.where(np.tril(np.ones((s_len, s_len), bool)), s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    if not packed:
        return (p @ v.astype(np.float64)) / p.sum(1, keepdims=True)
    ph = p.astype(np.float16)
    out = np.zeros((s_len, v.shape[1]), np.float64)
    for j0 in range(0, s_len, STEP):
        part = np.zeros((s_len, v.shape[1]), np.float16)
        for j in range(j0, min(s_len, j0 + STEP)):
            part = _f16_fma(part, ph[:, j:j + 1], v[None, j, :])
        out += part.astype(np.float64)
    return out / p.sum(1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--head-size", type=int, default=128)
    args = ap.parse_args(argv)
    atol, rtol = TOLERANCE["float16"]
    rng = np.random.default_rng(0)
    print(f"causal attention, one head, S={args.seq} H={args.head_size}; float16 tolerance "
          f"atol {atol} + rtol {rtol} against the float64 reference")
    for name, mag in KINDS:
        q, k = ((rng.standard_normal((args.seq, args.head_size)) * mag).astype(np.float16)
                for _ in range(2))
        v = rng.standard_normal((args.seq, args.head_size)).astype(np.float16)
        want = _attention(q, k, v, packed=False)
        with np.errstate(over="ignore", invalid="ignore"):
            got = _attention(q, k, v, packed=True)
        err = np.abs(got - want)
        over = np.mean(~(err <= atol + rtol * np.abs(want)))
        print(f"  {name:20s} packed f16: max err {np.nanmax(err):.3g}, "
              f"{over:.2%} of values outside the tolerance, "
              f"{np.mean(~np.isfinite(got)):.2%} non-finite")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
