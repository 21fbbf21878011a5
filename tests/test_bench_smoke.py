"""`attnreg bench --quick` runs on the CI devices (a smoke: no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attnreg
from attnreg.tools import bench


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
        measured.add(row["backend"])
    assert {"reference", "webgpu", "opencl"} <= measured
    assert "ratios" in r.stdout


def test_traffic_counts_visible_pairs() -> None:
    spec = attnreg.AttentionSpec(seq_len=4, past_len=0, head_size=8, causal=True)
    assert bench.visible_pairs(spec) == 1 + 2 + 3 + 4
    assert bench.visible_pairs(spec.replace(causal=False)) == 16
    nbytes, flops = bench.traffic(spec)
    assert flops == 4.0 * 8 * 10 and nbytes > 0
