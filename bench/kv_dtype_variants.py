"""Which kernel and tiles read each K/V storage fastest: the long decode (GQA 32/8 H=128,
L=32768 by default) in float16, bfloat16, int8 and int4 K/V on one backend, through every
decode kernel that reads it and the tensor-core decode's tile choices, side by side in one
run (median GPU time, max error against the float64 reference). One JSON line per plan::

    python3 -m bench.kv_dtype_variants --backend opencl --out opencl.jsonl
    python3 -m bench.kv_dtype_variants --backend webgpu --L 512 --quick
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import attnreg
from attnreg.tools.bench import _inputs
from attnreg.tools.bench_suites import decode_spec

from .opencl_variants import DEADLINE, _safe, _want, time_plan

# (label, storage, flags, params): None params = the rules' choice
MMA_TILES: list[dict[str, Any]] = [
    {}, {"kv_tile": 32}, {"kv_tile": 64}, {"prefetch": 1}, {"wg": 256}, {"wg": 64},
    {"kv_tile": 32, "prefetch": 1}, {"kv_tile": 32, "wg": 256}, {"kv_tile": 64, "wg": 256}]

MMA_SPLITS: list[dict[str, Any]] = [
    {**t, "split_size": n} for n in (256, 512) for t in (
        {"kv_tile": 32}, {"prefetch": 1}, {"kv_tile": 64}, {"kv_tile": 32, "prefetch": 1})]


def plans(backend: str, quick: bool) -> list[tuple[str, str, str | None, dict[str, Any] | None,
                                                     dict[str, Any] | None]]:
    out: list[tuple[str, str, str | None, dict[str, Any] | None, dict[str, Any] | None]] = []
    for dtype, kv in (("float16", None), ("bfloat16", None), ("float16", "int8"),
                      ("float16", "int4")):
        tag = f"{dtype}/{kv or 'same'}"
        out.append((f"{tag} auto", dtype, kv, None, None))
        out.append((f"{tag} matrix_units=off", dtype, kv, {"matrix_units": "off"}, None))
        if backend == "opencl" and not quick:
            out += [(f"{tag} mma {p}", dtype, kv, {"matrix_units": "on"}, p)
                    for p in MMA_TILES + (MMA_SPLITS if kv else [])]
    return out


def check_heads(s: attnreg.Session, log: Any) -> None:
    """Max error against the float64 reference of the tensor-core decode (hardware build) on
    quantized K/V at each head size, with a window, softcap and ALiBi (edge chunks)."""
    from attnreg.spec import AttentionSpec
    for h in (64, 128, 192, 256):
        for kv in ("int8", "int4"):
            if (h, kv) == (192, "int4"):
                continue
            spec = AttentionSpec(batch=2, seq_len=2, past_len=3000, num_heads=8, kv_num_heads=2,
                                 head_size=h, dtype="float16", kv_dtype=kv, causal=True,
                                 local_window=2000, softcap=20.0, alibi_max_bias=8.0)
            x = _inputs(spec)
            want = _want(spec, x)

            def one(spec: AttentionSpec = spec, x: Any = x, want: Any = want) -> dict[str, Any]:
                got = s.run(spec, x, kernel="opencl.decode_partial.f16.mma",
                            params={"mma": "hardware"})
                err = float(abs(got.astype("float64") - want).max())
                return {"max_err": err, "ref_max": float(abs(want).max())}
            _safe(log, f"heads h{h} {kv}", one)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="opencl")
    ap.add_argument("--device", default=None)
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=math.inf, help="stop after this long")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="only plans whose label contains this text")
    ap.add_argument("--tiles", default=None,
                    help="JSON list of tensor-core decode params to time instead of the sweep")
    ap.add_argument("--check-heads", action="store_true",
                    help="first: the tensor-core decode's quantized reads at every head size")
    a = ap.parse_args()
    DEADLINE["t"] = time.perf_counter() + a.seconds
    if a.tiles:
        import json
        MMA_TILES[:] = json.loads(a.tiles)
        MMA_SPLITS.clear()
    f = open(a.out, "w") if a.out else None    # noqa: SIM115 (lines flushed as they come)

    def log(line: str) -> None:
        print(line, flush=True)
        if f:
            f.write(line + "\n")

    s = attnreg.Session(backend=a.backend, device=a.device)
    if a.check_heads:
        check_heads(s, log)
    cache: dict[tuple[str, str | None], Any] = {}
    for label, dtype, kv, flags, params in plans(a.backend, a.quick):
        if a.only not in label and "float16/same auto" not in label:
            continue
        if (dtype, kv) not in cache:
            spec = decode_spec(a.L, dtype, kv)
            x = _inputs(spec)
            cache[(dtype, kv)] = (spec, x, _want(spec, x))
        spec, x, want = cache[(dtype, kv)]
        _safe(log, label, time_plan, s, spec, x, flags=flags, params=params, iters=a.iters,
              want=want)
    if a.backend == "opencl":
        registers(log)


def registers(log: Any) -> None:
    """ptxas' registers and spills per built tensor-core decode (with -cl-nv-verbose in
    ATTNREG_OPENCL_BUILD_OPTIONS)."""
    from attnreg.backends.opencl import device
    for key, text in device.build_logs().items():
        opts = " ".join(o for o in key.options if o.split("=")[0][2:] in (
            "KV_Q", "TK", "PF", "WG", "IS_BF16", "MMA"))
        lines = [ln.strip() for ln in text.splitlines() if "registers" in ln or "spill" in ln]
        if lines and "MMA=1" in opts:
            log(f"build {opts}: {' | '.join(lines)[:300]}")


if __name__ == "__main__":
    main()
