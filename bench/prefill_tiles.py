"""Tile sweep and phase account of the scalar WGSL flash prefill on a GPU (Dawn and webgpu).

Times the `prefill` kernel (shaders/flash_prefill.wgsl, matrix units off) under each tile
variant of VARIANTS for the bench's prefill cases, and the default tiles again with one phase
compiled out (PHASES: source edits; those builds compute wrong results, their error is
printed to show the phase really went). Each variant's max error against the float64
reference is printed beside its GPU time (median per launch, launches back to back), so a
fast variant that is wrong shows as wrong. Variants are timed in alternating rounds.

  python3 -m bench.prefill_tiles [--backend dawn,webgpu] [--rounds 2] [--iters 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attnreg
from attnreg import testing
from attnreg.backends.webgpu import program, unroll
from attnreg.tools import bench_suites
from bench.wgsl_mma_phases import Edit, source_with

# Tile variants (params of the prefill kernel, over its defaults).
VARIANTS: list[dict[str, Any]] = [
    {},
    {"kv_tile": 16, "max_k_step": 16},
    {"q_tile": 64, "rows_per_thread": 2, "row_lanes": 8},
    {"q_tile": 64, "rows_per_thread": 4, "row_lanes": 16},
]
# Variants also timed with the shader's @unroll loops left as loops (backends/webgpu/unroll.py).
ROLLED: list[dict[str, Any]] = [{}, {"q_tile": 64, "rows_per_thread": 4, "row_lanes": 8}]
# Variants timed with float16 K/V tiles staged as f32 (converted once when staged instead of
# at every use); their tiles are given explicitly, since the storage rule counts 2 bytes.
TS32: list[dict[str, Any]] = [
    {"kv_tile": 16, "max_k_step": 16},
    {"kv_tile": 16, "max_k_step": 16, "row_lanes": 8},
    {"q_tile": 16, "rows_per_thread": 1, "row_lanes": 16},
    {"q_tile": 16, "rows_per_thread": 2, "row_lanes": 8},
]
_TS16 = ("alias TS = vec4<f16>;\nfn ts_part(g: GV, s: u32) -> TS {\n  return g[s];\n}\n"
         "fn ts_f32(x: TS) -> vec4<f32> {\n  return vec4<f32>(x);\n}")
_TS32 = ("alias TS = vec4<f32>;\nfn ts_part(g: GV, s: u32) -> TS {\n  return vec4<f32>(g[s]);\n}\n"
         "fn ts_f32(x: TS) -> vec4<f32> {\n  return x;\n}")

PF = "flash_prefill"
_NO_QK = [(PF, "for (var g = 0u; g < QK_GRANULES; g++) {", "for (var g = 0u; g < 0u; g++) {"),
          (PF, "for (var c = 0u; c < QK_VEC4S; c++) {", "for (var c = 0u; c < 0u; c++) {")]
_NO_PV = [(PF, "for (var jj = 0u; jj < K_STEP; jj++) {", "for (var jj = 0u; jj < 0u; jj++) {")]
PHASES: dict[str, list[Edit]] = {
    "no PV (both loops)": _NO_PV,
    "no QK": _NO_QK,
    "neither product (the skeleton)": _NO_QK + _NO_PV,
    "skeleton without logits": _NO_QK + _NO_PV + [
        (PF, "x = logit_b(sc[a][e], b, h, i, j, pos, wb);", "x = sc[a][e];"),
        (PF, "x = plain_logit(sc[a][e]);", "x = sc[a][e];")],
    "skeleton without K/V staging stores": _NO_QK + _NO_PV + [
        (PF, "stage_k(lid + u * THREADS, kr[u]);", ""),
        (PF, "stage_v(lid + u * THREADS, vr[u]);", "")],
}


unroll_on = unroll.unroll


def rolled(wgsl: str, names: Any = None) -> str:
    """The unroller switched off: marked loops stay loops (the A/B scripts' baseline)."""
    return wgsl


def _staged_f32(wgsl: str, names: Any = None) -> str:
    # only float16 programs hold the piece (others, such as a probe's, pass unchanged)
    return unroll_on(wgsl.replace(_TS16, _TS32))


def _time(sess: attnreg.Session, backend: str, spec: attnreg.AttentionSpec, t: Mapping[str, Any],
          want: Any, params: Mapping[str, Any], iters: int) -> tuple[float, float, str]:
    kernel = f"{backend}.prefill.f16.sg"
    plan = sess.plan(spec, kernel=kernel, params=dict(params) or None)
    err, _ = testing.compare(spec, sess.run(spec, t, kernel=kernel, params=dict(params) or None),
                             want)
    rt: Any = sess.runtime(plan)
    tm = rt.timings(plan, t, iters=iters, warmup=5, warmup_s=0.1)
    return statistics.median(tm["gpu_s"] or tm["wall_s"]) * 1e6, err, str(plan.stages[0].params)


def sweep(backend: str, rounds: int, iters: int, quick: bool = False, phases: bool = False,
          log: Any = print) -> None:
    devs = [d for d in attnreg.devices(backend) if d.device_type != "cpu"] or \
        attnreg.devices(backend)
    dev = devs[0]
    log(f"\n## {backend}: {dev.name} ({dev.id}); GPU us per launch, median of {iters}")
    flags = {"matrix_units": "off"}
    for _, case in bench_suites.suite_cases(["prefill"], quick):
        spec = case.spec
        t = testing.make_tensors(spec, 0)
        want = testing.expected(spec, t)
        _, flops = bench_suites.traffic(spec)
        runs: list[tuple[str, dict[str, Any], list[Edit], Callable[[str], str]]] = \
            [(str(v), v, [], unroll_on) for v in VARIANTS] + \
            [(f"{v} rolled", v, [], rolled) for v in ROLLED] + \
            [(f"{v} K/V staged f32", v, [], _staged_f32) for v in TS32] + \
            [(p, {}, e, unroll_on) for p, e in (PHASES.items() if phases else ())]
        best: dict[str, list[float]] = {}
        info: dict[str, str] = {}
        original = program.load
        for _ in range(rounds):
            for label, params, edits, hook in runs:
                program.load = source_with(edits) if edits else original
                unroll.unroll = hook
                program._BUILT.clear()
                try:
                    with attnreg.Session(backend=backend, device=dev.id, flags=flags) as s:
                        us, err, shown = _time(s, backend, spec, t, want, params, iters)
                    best.setdefault(label, []).append(us)
                    info[label] = f"err {err:.2g}  {shown}"
                except Exception as exc:   # a variant that does not fit is reported, not fatal
                    info[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                finally:
                    program.load = original
                    unroll.unroll = unroll_on
        log(f"{case.name}:")
        for label, *_ in runs:
            us_s = best.get(label)
            if us_s:
                m = min(us_s)
                log(f"  {label:70s} {' '.join(f'{u:8.1f}' for u in us_s)} us"
                    f"  {flops / m / 1e6:6.1f} TFLOP/s  {info[label]}")
            else:
                log(f"  {label:70s} {info.get(label)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="dawn,webgpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="the small case (lavapipe)")
    ap.add_argument("--phases", action="store_true", help="also the phase account (PHASES)")
    a = ap.parse_args(argv)
    for b in a.backend.split(","):
        sweep(b, a.rounds, a.iters, a.quick, a.phases)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
