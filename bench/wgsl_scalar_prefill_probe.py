"""A feasibility probe for a scalar WGSL flash prefill laid out as a register-tiled GEMM (no
subgroup matrices), before any of it is built into the library (#35's `matrix_units=off`
target: causal f16 S=2048 <= 1200 us).

Only the plain case: float16 BNSH q/k/v, causal, GQA, H=128, S a multiple of the tiles, one
batch. A workgroup owns BR query rows of one head; its (BR/TR) x NL lanes form row groups of
NL lanes, each lane TR rows. Per tile of BC keys:
  - K and V staged to workgroup memory (as f16, or f32 converted once), the next tile's
    16-byte words loaded into registers while this one is computed;
  - S = Q K^T: each lane TR rows x TC = BC/NL keys (keys tx, tx+NL, ...), Q pre-scaled by
    scale * log2(e) in workgroup memory (f32), a register tile of TR x TC dot products;
  - the online softmax in registers: row maxima over the row group by subgroup shuffles,
    p = exp2(s - m), the lane's share of the row sum kept per lane (summed once at the end);
  - P to workgroup memory key-major (a lane reads its TR rows of one key as one vector);
  - O += P V: each lane TR rows x H/NL columns (vec4 columns tx, tx+NL, ...) in registers.
Three barriers a tile (staging done, P written, readers done). Grid heavy-first (the row tiles
with the most keys start first). Output f32, checked against float64 attention on the host.

What it answers: what this layout reaches against the library's scalar prefill, and (its
flags) which phase costs what. On the H200 (ci/results/h200_wgsl_scalar_prefill.txt): at best
1682 us at S=2048 on Dawn (32x32x4x16:fh), against the library's 2243 then (2110 after the
changes that probe's phase account led to), and far from the 1200 us target: 48 KiB of
workgroup storage holds Q as f32 and one f32 K tile of 32 keys, and no larger tile fits.

The sliced layout (kernel_sliced, a config starting "s"): a row group's NL lanes split the
head dimension instead of the keys, q in registers, the partial dots reduce-scattered by
shuffles; flag "pair" interleaves the row groups of a subgroup so that lanes n and n^1 read the
same K/V address. At best 1364 us at S=2048 on Dawn (s64x16x2x8:ff:pair), which led the
library's qk_layout "sliced" (ci/results/h200_wgsl_sliced_prefill.txt).

  python3 -m bench.wgsl_scalar_prefill_probe [--seq 512,2048] [--configs 32x32x4x16:kh,...]
      [--backends dawn,webgpu]
A config is [s]BRxBCxTRxNL:KV[:FLAGS] where KV names K's and V's staged types (h: f16, f: f32)
and FLAGS joins names of wgsl_scalar_prefill_kernels.FLAGS with "+" (the kernels' generators
live there). PROBE_SUBGROUP sets the subgroup width that "pair"
assumes (32, NVIDIA's; 8 checks the script on lavapipe).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import numpy as np

import attnreg
from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import gemm_probe
from attnreg.backends.webgpu import device as wdevice

from . import wgsl_probe_io
from .wgsl_scalar_prefill_kernels import Config, H, kernel, kernel_sliced

STORAGE = 48 * 1024          # NVIDIA's workgroup storage


def _median(dev: Any, pipe: Any, group: Any, grid: tuple[int, int, int], repeats: int,
            samples: int) -> float:
    return statistics.median(gemm_probe.pass_times(dev, pipe, group, grid, repeats, samples))


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: list[int]) -> np.ndarray:
    """float64 causal attention of the listed heads."""
    g = q.shape[0] // k.shape[0]
    s_len = q.shape[1]
    mask = np.triu(np.ones((s_len, s_len), dtype=bool), 1)
    outs = []
    for h in heads:
        qf, kf, vf = (x.astype(np.float64) for x in (q[h], k[h // g], v[h // g]))
        s = qf @ kf.T / math.sqrt(H)
        s[mask] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        outs.append((p / p.sum(1, keepdims=True)) @ vf)
    return np.stack(outs)


def run(dev: Any, c: Config, seq: int, heads: int = 32, kv_heads: int = 8,
        iters: int = 20) -> str:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((heads, seq, H)).astype(np.float16)
    k = rng.standard_normal((kv_heads, seq, H)).astype(np.float16)
    v = rng.standard_normal((kv_heads, seq, H)).astype(np.float16)
    src = (kernel_sliced if c.sliced else kernel)(c, seq, heads, kv_heads,
                                                   isinstance(dev, ddevice.DawnDevice))
    pipe = dev.compile(f"sprefill_probe[{c.text()},{seq}]", src, ("read",) * 3 + ("rw",))
    n_out = heads * seq * H * 4
    bufs, bg = wgsl_probe_io.bind(dev, (q, k, v), (n_out,))
    grid = (seq // c.br, heads, 1)
    gemm_probe.pass_times(dev, pipe, bg, grid, 1, 1)
    got = np.frombuffer(dev.read_buffer(bufs[3], n_out), np.float32).reshape(heads, seq, H)
    check = sorted({0, heads // 2 + 1, heads - 1})
    err = float(np.abs(got[check] - reference(q, k, v, check)).max())
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        _median(dev, pipe, bg, grid, 5, 1)
    one = _median(dev, pipe, bg, grid, 1, iters) * 1e6
    for b in bufs:
        b.destroy()
    flops = 4 * heads * H * seq * (seq + 1) / 2
    return (f"{c.text():16s} S={seq:5d} thr {c.threads:3d} smem {c.storage() / 1024:5.1f} KiB: "
            f"{one:8.1f} us  {flops / one / 1e6:5.1f} TFLOP/s  err {err:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", default="512,2048")
    ap.add_argument("--configs", default="32x32x4x16:hh,32x32x4x16:fh,32x32x2x16:hh")
    ap.add_argument("--backends", default="dawn,webgpu")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--heads", default="32,8", help="query heads, kv heads")
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split(","))
    for backend in a.backends.split(","):
        for caps in attnreg.devices(backend):
            if not caps.available:
                continue
            dev = ddevice.get(caps) if backend == "dawn" else wdevice.get(caps)
            print(f"{caps.id} {caps.name}: causal f16 GQA {hq}/{hkv} H={H}, GPU us a launch, "
                  f"median of {a.iters}", flush=True)
            for seq in (int(x) for x in a.seq.split(",")):
                for c in (Config.parse(x) for x in a.configs.split(",")):
                    if c.storage() > STORAGE or seq % c.br or seq % c.bc:
                        print(f"  {c.text()}: does not fit ({c.storage()} bytes)")
                        continue
                    try:
                        print("  " + run(dev, c, seq, hq, hkv, a.iters), flush=True)
                    except Exception as exc:
                        print(f"  {c.text()} S={seq}: {type(exc).__name__}: {str(exc)[:600]}",
                              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
