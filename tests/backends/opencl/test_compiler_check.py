"""The OpenCL compiler check (backends/opencl/compiler_check.py): a device whose optimizer
miscompiles attnreg's kernels builds every program with -cl-opt-disable, and says so.

PoCL 5.0 (LLVM 16) on the GPU machine's Xeon miscompiled every dense work-group-memory decode
with its optimizer on and built them right with it off (ci/results/cpu_pocl5_miscompile.txt);
CI's PoCL 3.1 builds them right. A miscompiling optimizer is stood in for here by a source
that is wrong only where the compiler defines __OPTIMIZE__ (an optimized build), so the check,
its fix and its cache are exercised on the real CI device.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import attnreg
from attnreg.backends.opencl import compiler_check, device, probe, program
from attnreg.spec import AttentionSpec
from tests.support import check_close, make_tensors, pocl_cl_device, require_devices

# The check kernel's partial outputs, scaled by SABOTAGE (decode_core.cl's store of o).
STORE = "vstore4(live ? finite_or_nan4(acc[pm][dv] * inv)"


def _sabotaged(header: str) -> str:
    src = program.source(compiler_check.FAMILY, "")
    assert src.count(STORE) == 1
    return header + src.replace(STORE, "vstore4(live ? SABOTAGE * finite_or_nan4(acc[pm][dv] * inv)")


# Wrong only where the compiler optimizes (it defines __OPTIMIZE__), or always.
WRONG_WHEN_OPTIMIZED = ("#ifdef __OPTIMIZE__\n#define SABOTAGE 0.5f\n#else\n#define SABOTAGE 1.0f\n"
                        "#endif\n")
WRONG_ALWAYS = "#define SABOTAGE 0.5f\n"


_pocl = pocl_cl_device


def test_the_ci_compiler_builds_the_check_kernel_right_optimized() -> None:
    cl, dev = _pocl()
    assert compiler_check.run_once(cl, dev, ()) <= compiler_check.TOLERANCE
    got = compiler_check.verdict(cl, dev)
    assert got["fix"] == [] and "optimized build right" in got["why"]


def test_a_miscompiling_optimizer_gets_every_build_unoptimized() -> None:
    cl, dev = _pocl()
    src = _sabotaged(WRONG_WHEN_OPTIMIZED)
    assert compiler_check.run_once(cl, dev, (), src) > 0.01         # wrong optimized ...
    assert compiler_check.run_once(cl, dev, compiler_check.FIX, src) <= 1e-4   # ... right off
    got = compiler_check.verdict(cl, dev, src)
    assert got["fix"] == ["-cl-opt-disable"] and "miscompiled" in got["why"]


def test_a_kernel_wrong_either_way_is_not_fixed_by_options() -> None:
    cl, dev = _pocl()
    got = compiler_check.verdict(cl, dev, _sabotaged(WRONG_ALWAYS))
    assert got["fix"] == [] and "with and without" in got["why"]


def test_a_device_that_cannot_run_the_check_is_not_judged() -> None:
    cl, dev = _pocl()
    got = compiler_check.verdict(cl, dev, "this is not OpenCL C")
    assert got["fix"] == [] and got["why"].startswith("not checked")


def test_the_verdict_is_cached_per_device_and_driver(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path) -> None:
    cl, dev = _pocl()
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    plat = dev.platform
    fix, why = compiler_check.check(cl, dev, plat)
    assert fix == () and "cached" not in why
    stored = json.loads((tmp_path / compiler_check.CACHE_FILE).read_text())
    (entry,) = stored.values()                  # the measurement only, never the options
    assert set(entry) == {"optimized", "unoptimized", "failure"}
    assert entry["optimized"] <= compiler_check.TOLERANCE and entry["failure"] is None
    monkeypatch.setattr(compiler_check, "measure", lambda *a: pytest.fail("not cached"))
    assert compiler_check.check(cl, dev, plat) == ((), why + " (cached)")


def test_probed_devices_report_the_check() -> None:
    for d in require_devices("opencl"):
        assert d.extra["cl_optimizer"] and d.extra["cl_build_fix"] == []


def test_sessions_build_with_the_fix_and_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the caps carry a fix, every program of the device is built with it (the build
    cache keys on the options) and the results stay within tolerance."""
    require_devices("opencl")
    monkeypatch.setattr(program, "build_fix", lambda caps: compiler_check.FIX)
    spec = AttentionSpec(batch=1, seq_len=3, past_len=61, num_heads=4, kv_num_heads=2,
                         head_size=32, dtype="float32", causal=True)
    t = make_tensors(spec, seed=3)
    pocl = next(d for d in require_devices("opencl") if d.vendor == "pocl")
    before = set(device.build_logs())
    with attnreg.Session(backend="opencl", device=pocl.id) as s:
        for kernel in ("opencl.decode_partial.f32.m2", "opencl.prefill.f32.wgmem"):
            got, plan = s.run_with_plan(spec, t, kernel=kernel)
            check_close(spec, got, t, what=plan.kernel)
            assert np.isfinite(got).all()
    built = set(device.build_logs()) - before
    assert len(built) >= 3                      # decode_partial, reduce, prefill
    assert all("-cl-opt-disable" in k.options for k in built)


# -- the sub-group width (backends/opencl/probe.py) ---------------------------------------
def test_subgroups_count_only_when_32_wide() -> None:
    """PoCL 5.0 reports cl_intel_subgroups and cl_khr_subgroups with sub-groups as wide as the
    work-group (128 at 128, even under intel_reqd_sub_group_size(32)): the sub-group kernels'
    native build was refused at run time there; now the probe leaves them to their emulated
    build."""
    assert probe.subgroup_verdict([32, 32, 32])["ok"]
    got = probe.subgroup_verdict([64, 128, 256])
    assert not got["ok"] and "emulated" in got["why"] and "[64, 128, 256]" in got["why"]


def test_subgroup_width_query_failure_is_a_reason() -> None:
    cl, dev = _pocl()
    got = probe.subgroup_widths(cl, dev, frozenset({"cl_khr_subgroups"}))   # PoCL 3.1: none
    assert not got["ok"] and got["why"].startswith("sub-group size query failed")


# -- the cache holds measurements, never options (issue [trust]) ------------------------------
def test_a_planted_verdict_never_becomes_build_options(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path) -> None:
    """"fix": ["-cl-fast-relaxed-math"] in cl_optimizer.json went into every build (rows that
    must be 0 / -inf turned NaN). The file now holds the check's measured errors: a file of
    another shape is ignored with a warning naming it (and measured again); measurements,
    whatever they say, choose among attnreg's own fixes only."""
    cl, dev = _pocl()
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(cache_dir))
    key = f"{dev.name}|{dev.driver_version}|{dev.platform.version}"
    fixes = []
    for planted in ({key: {"fix": ["-cl-fast-relaxed-math"], "why": "planted"}},
                    {key: {"optimized": 1.0, "unoptimized": 0.0, "failure": None}},
                    {key: {"optimized": None, "unoptimized": None, "failure": "-cl-no-way"}}):
        cache_dir.mkdir(mode=0o700, exist_ok=True)
        (cache_dir / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
        (cache_dir / compiler_check.CACHE_FILE).write_text(json.dumps(planted))
        (cache_dir / compiler_check.CACHE_FILE).chmod(0o600)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fix, why = compiler_check.check(cl, dev, dev.platform)
        fixes.append(fix)
        if "fix" in planted[key]:
            assert any(compiler_check.CACHE_FILE in str(w.message) for w in seen), why
            assert fix == () and "cached" not in why          # measured again
    assert fixes[1] == compiler_check.FIX and fixes[2] == ()
    assert all(set(f) <= set(compiler_check.FIX) for f in fixes)


def test_environment_build_options_are_checked_and_shown(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """ATTNREG_OPENCL_BUILD_OPTIONS went into every build unseen by `attnreg devices`: now the
    probe records them (settings, program.device_options), and options that let the compiler
    assume no NaN / inf make the backend unavailable with a reason naming the variable."""
    require_devices("opencl")
    monkeypatch.setenv(program.EXTRA_ENV, "-cl-fast-relaxed-math")
    (caps,) = probe.probe()
    assert not caps.available and program.EXTRA_ENV in caps.reason
    monkeypatch.setenv(program.EXTRA_ENV, "-DATTNREG_TRUST_PROBE=1")
    pocl = next(d for d in probe.probe() if d.available and d.vendor == "pocl")
    assert any(program.EXTRA_ENV in line and "-DATTNREG_TRUST_PROBE=1" in line
               for line in pocl.settings), pocl.settings
    assert "-DATTNREG_TRUST_PROBE=1" in program.device_options(pocl)
    monkeypatch.delenv(program.EXTRA_ENV)
    assert not program.env_options()
