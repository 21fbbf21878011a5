"""`attnreg bench --quick` runs on the CI devices (a smoke: no timing asserts): every row,
its back-to-back time and its fraction of the device's limit, the GEMM probe's refusal
where Dawn has no subgroup matrices, and the torch peer's wall-clock row where torch runs on
the CPU (no CUDA graph there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnreg
from attnreg.tools import bench, bench_suites
from tests.support import missing, require_devices


def test_bench_quick_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "attnreg.tools.cli", "bench", "--quick", "--suite", "decode",
                        "--iters", "2", "--warmup", "1", "--no-peers", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    backends = {row["backend"] for row in rows}
    assert {d.backend for d in attnreg.devices() if d.available} <= backends
    measured = set()
    for row in rows:
        if row["suite"] == "roof" or row["kernels"].startswith("n/a"):
            continue          # n/a: the device cannot run that case (e.g. no shader-f16)
        assert not row["kernels"].startswith("FAILED"), row
        assert row["max_err"] is not None and row["max_err"] < 4e-3, row
        assert row["wall_us"] > 0
        # fraction of the limit: a decode is bounded by the copy roof
        assert row["limit"] > 0 and row["limit_of"].startswith("copy "), row
        if row["backend"] in ("webgpu", "dawn", "opencl"):
            assert row["b2b_us"] > 0, row
        measured.add(row["backend"])
    assert {"reference", "webgpu", "opencl"} <= measured
    assert "ratios" in r.stdout and "b2b us" in r.stdout and "of limit" in r.stdout
    for dev in attnreg.devices("dawn"):      # the GEMM probe: a rate, or why there is none
        if not dev.available:
            continue
        probed = [x for x in rows if x["case"] == "matrix-gemm" and x["backend"] == "dawn"]
        if "subgroup-matrix" in dev.features:
            assert probed and probed[0]["tflops"] > 0
        else:
            assert not probed and f"dawn/{dev.slug}: matrix units: no subgroup matrices on this " \
                "device" in r.stderr, r.stderr


def test_torch_peer_row_on_the_cpu() -> None:
    """Without CUDA the torch peer has no graph to replay: its row has wall time only, says
    so, and is compared wall against wall."""
    from attnreg.tools import bench, bench_report, peers

    why = peers.torch_status()
    if why:
        missing(why)              # CI installs torch (CPU) with the clients extra
    spec = attnreg.AttentionSpec(seq_len=1, past_len=31, num_heads=2, kv_num_heads=1,
                                 head_size=16, dtype="float32", causal=True)
    case = bench_suites.Case("tiny-decode", spec)
    rows = bench.peer_rows("decode", case, iters=2, warmup=1, log=lambda _: None)
    torch_row = next(r for r in rows if r.backend == "torch")
    if torch_row.device.startswith("cuda"):
        pytest.skip("torch has CUDA here: the CPU row is not made")
    assert torch_row.gpu_us is None and torch_row.b2b_us is None and torch_row.wall_us > 0
    assert "no CUDA graph" in torch_row.extra["timing"]
    assert torch_row.limit and torch_row.limit_of.startswith("copy ")
    mine = bench_report.Row("decode", "tiny-decode", "opencl", "x", "k", 5.0, 50.0, None, None,
                            0.0, b2b_us=4.0)
    assert "us wall = " in bench_report.ratios([mine, torch_row])
    assert "no CUDA graph" in bench_report.limits([torch_row])


@pytest.mark.parametrize("backend", ["webgpu", "opencl"])
def test_decode_loop_engine_row(backend: str) -> None:
    """The decode-loop suite's engine row: attention recorded into the engine's stream over
    its buffers moves nothing between host and device; today's loop beside it reads out back."""
    dev = require_devices(backend)[0]
    (row,) = bench.engine_loop(dev, length=40, steps=2, log=lambda m: None)
    assert row.case == "decode-loop-f16-L40-engine" and row.backend == backend
    assert row.extra["transfers_per_step"] == 0 and row.extra["session_transfers_per_step"] >= 1
    assert row.wall_us > row.extra["record_us"] > 0 and row.extra["session_step_us"] > 0


def test_traffic_counts_visible_pairs() -> None:
    spec = attnreg.AttentionSpec(seq_len=4, past_len=0, head_size=8, causal=True)
    assert bench_suites.visible_pairs(spec) == 1 + 2 + 3 + 4
    assert bench_suites.visible_pairs(spec.replace(causal=False)) == 16
    nbytes, flops = bench_suites.traffic(spec)
    assert flops == 4.0 * 8 * 10 and nbytes > 0


def test_kv_quant_quality_orders_the_storages() -> None:
    """bench/kv_quant_quality.py: on random data int8 stays within 2% RMS of the exact output
    and int4 within 25%; the error grows float16 < int8 < int4, and outlier channels in K
    hurt int4 more than random data does."""
    r = subprocess.run([sys.executable, "-m", "bench.kv_quant_quality", "--length", "512",
                        "--seeds", "1"], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stdout + r.stderr
    rel = {(ln.split()[0], ln.split()[1]): float(ln.split()[4]) for ln in r.stdout.splitlines()
           if ln.split()[:1] in (["random"], ["outliers"])}
    for data in ("random", "outliers"):
        assert rel[(data, "float16")] < rel[(data, "int8")] < rel[(data, "int4")], rel
    assert rel[("random", "int8")] < 2e-2 and rel[("random", "int4")] < 0.25, rel
    assert rel[("outliers", "int4")] > rel[("random", "int4")], rel


def test_f16_math_error_fails_the_tolerance_only_on_peaked_attention() -> None:
    """bench/f16_math_error.py: float16 sums of products stay inside the float16 tolerance on
    N(0, 1) data and leave it on a peaked softmax (q, k ~ N(0, 4^2)), packed FMAs more than
    4-element dots; its exact mode is the float64 reference's."""
    from bench import f16_math_error as f16

    q, k, v = f16.inputs(128, 64, 1.0)
    assert all(f16.outside(q, k, v, mode)[1] == 0.0 for mode in f16.MODES)
    q, k, v = f16.inputs(128, 64, 4.0)
    packed, dot4 = (f16.outside(q, k, v, mode)[1] for mode in ("packed", "dot4"))
    assert packed > 0.01 and packed > dot4 > 0.001, (packed, dot4)
    spec = attnreg.AttentionSpec(seq_len=128, past_len=0, num_heads=1, kv_num_heads=1,
                                 head_size=64, dtype="float16", causal=True)
    t = {"q": q[None, :, None], "k": k[None, None], "v": v[None, None]}
    want = attnreg.run(spec, t, backend="reference")[0, :, 0].astype(np.float64)
    exact = f16.attention(q, k, v, "exact")
    assert np.abs(exact - want).max() < 1e-3
