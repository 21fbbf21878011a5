"""What packed-f16 arithmetic would do to a prefill's results (#35 must-have 3's lead).

The lead for the scalar WGSL prefill was `vec2<f16>` / `vec4<f16>` FMAs: twice f32's rate on
GPUs with shader-f16, but only if the products are *accumulated* in f16 (converting each
product to f32 to add it costs what the packed FMA saves). This script computes causal
attention of one head the way such a kernel would, in numpy, and judges it by the contract's
float16 tolerance (attnreg.kernel.TOLERANCE) against the float64 reference:

Two forms (MODES):
  packed: QK: q * scale rounded to f16 (as the kernels fold the scale into q), then each
          lane of a vec2 accumulates its half of the head in f16 with fused multiply-adds
          (one rounding per FMA); the two lanes' sums meet in f32. PV: the weights
          exp(s - m) rounded to f16, each 32-key step's p * v accumulated in f16 with FMAs,
          the steps' sums added in f32 (as the kernel's running output would be).
  dot4:   QK only: `dot(vec4<f16>, vec4<f16>)` of q * scale (rounded to f16) and k, each
          4-element dot rounded to f16 and added to an f32 logit; PV exact. No 2x FMA rate,
          but no f16 -> f32 conversion per element either.

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
MODES = ("packed", "dot4")
KINDS = (("q, k, v ~ N(0, 1)", 1.0), ("q, k ~ N(0, 4^2)", 4.0), ("q, k ~ N(0, 40^2)", 40.0))


def _f16_fma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """acc + a * b with one rounding to f16 (the exact sum rounded, as an FMA does)."""
    return (acc.astype(np.float64) + a.astype(np.float64) * b.astype(np.float64)).astype(
        np.float16)


def _logits(q: np.ndarray, k: np.ndarray, mode: str) -> np.ndarray:
    """scale * q k^T: exact ("exact"); each lane of a vec2 accumulating its half of the head
    in f16 FMAs ("packed"); or f16 dot products of 4 elements, each rounded to f16, summed
    in f32 ("dot4": `dot(vec4<f16>, vec4<f16>)` into an f32 accumulator)."""
    s_len, h = q.shape
    scale = 1.0 / np.sqrt(h)
    if mode == "exact":
        return (q.astype(np.float64) * scale) @ k.astype(np.float64).T
    qh = (q.astype(np.float32) * np.float32(scale)).astype(np.float16)
    if mode == "dot4":
        out = np.zeros((s_len, s_len), np.float32)
        for d in range(0, h, 4):
            part = np.zeros((s_len, s_len), np.float16)
            for e in range(d, d + 4):
                part = _f16_fma(part, qh[:, None, e], k[None, :, e])
            out += part.astype(np.float32)
        return out.astype(np.float64)
    lanes = [np.zeros((s_len, s_len), np.float16) for _ in range(2)]
    for d in range(0, h, 2):
        for lane in range(2):
            lanes[lane] = _f16_fma(lanes[lane], qh[:, None, d + lane], k[None, :, d + lane])
    return lanes[0].astype(np.float64) + lanes[1].astype(np.float64)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mode: str) -> np.ndarray:
    """Causal attention with the logits of _logits(mode); "packed" also accumulates PV in
    f16 over each STEP keys (the other modes: in float64)."""
    s_len = q.shape[0]
    packed = mode == "packed"
    s = _logits(q, k, mode)
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


def outside(q: np.ndarray, k: np.ndarray, v: np.ndarray, mode: str) -> tuple[float, float]:
    """(max |error|, fraction of output values outside the float16 tolerance) of attention
    computed in ``mode`` against the exact one."""
    atol, rtol = TOLERANCE["float16"]
    want = attention(q, k, v, "exact")
    with np.errstate(over="ignore", invalid="ignore"):
        got = attention(q, k, v, mode)
    err = np.abs(got - want)
    return float(np.nanmax(err)), float(np.mean(~(err <= atol + rtol * np.abs(want))))


def inputs(seq: int, head_size: int, mag: float, seed: int = 0) -> list[np.ndarray]:
    """q, k ~ N(0, mag^2), v ~ N(0, 1), float16, [seq, head_size] each."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((seq, head_size)) * m).astype(np.float16)
            for m in (mag, mag, 1.0)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--head-size", type=int, default=128)
    args = ap.parse_args(argv)
    atol, rtol = TOLERANCE["float16"]
    print(f"causal attention, one head, S={args.seq} H={args.head_size}; float16 tolerance "
          f"atol {atol} + rtol {rtol} against the float64 reference")
    for name, mag in KINDS:
        q, k, v = inputs(args.seq, args.head_size, mag)
        for mode in MODES:
            err, frac = outside(q, k, v, mode)
            print(f"  {name:20s} {mode:6s}: max err {err:.3g}, {frac:.2%} of values outside "
                  "the tolerance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
