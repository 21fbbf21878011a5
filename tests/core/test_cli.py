"""CLI smoke tests, each in a subprocess as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def attnreg(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnreg.tools.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_devices_lists_every_backend() -> None:
    r = attnreg("devices")
    assert r.returncode == 0, r.stderr
    for backend in ("reference", "webgpu", "opencl"):
        assert backend in r.stdout


def test_explain_decode_prints_plan_and_rules() -> None:
    r = attnreg("explain", "--batch", "1", "--seq-len", "1", "--past-len", "2047",
                "--heads", "32/8", "--head-size", "128", "--dtype", "float16", "--causal")
    assert r.returncode == 0, r.stderr
    assert "route: split_kv" in r.stdout and "split_kv_few_rows" in r.stdout
    assert "rejected:" in r.stdout


def test_explain_from_json_spec(tmp_path: Path) -> None:
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"batch": 1, "seq_len": 64, "num_heads": 4, "head_size": 32,
                             "dtype": "float32"}))
    r = attnreg("explain", "--spec", str(f), "--backend", "reference")
    assert r.returncode == 0, r.stderr
    assert "backend: reference" in r.stdout


def test_explain_unsupported_spec_prints_every_reason() -> None:
    r = attnreg("explain", "--heads", "4", "--head-size", "64", "--backend", "reference",
                "--kernel", "reference.prefill", "--flag", "route=split_kv")
    assert r.returncode == 0       # forcing beats the route flag; still a valid plan
    r = attnreg("explain", "--heads", "4", "--head-size", "64", "--kernel", "no.such")
    assert r.returncode == 2 and "kernel='no.such'" in r.stderr


def test_bad_spec_option_names_the_field() -> None:
    r = attnreg("explain", "--heads", "6/4")
    assert r.returncode == 2 and "kv_num_heads=4" in r.stderr
    r = attnreg("explain", "--heads", "x")
    assert r.returncode == 2 and "--heads" in r.stderr
    r = attnreg("explain", "--flag", "bogus=1")
    assert r.returncode == 2 and "known flags" in r.stderr


@pytest.mark.slow
def test_demo_runs_every_available_backend() -> None:
    r = attnreg("demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reference" in r.stdout and "max err vs reference" in r.stdout
    assert "OVER TOLERANCE" not in r.stdout and "FAILED" not in r.stdout


def test_flags_and_kernels_tables() -> None:
    assert "apple_tuned_flash" in attnreg("flags").stdout
    assert "reference.prefill" in attnreg("kernels").stdout
