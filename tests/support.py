"""Shared test machinery: inputs with poisoned tails, contract tolerances, device checks."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

import attnreg
from attnreg.kernel import ALL_FEATURES, KernelInfo
from attnreg.spec import AttentionSpec
from attnreg.testing import compare, expected, make_tensors
from attnreg.tools import cells as cmod
from attnreg.tools import conformance as conf
from attnreg.tools import recipes as recipes_mod

__all__ = ["IN_CI", "OPTIMIZED_MODULE", "CellRunner", "assert_covering", "backend_cells",
           "cell_module", "cell_test", "check_close", "conformance_cells", "expected",
           "make_tensors", "missing", "module_cells", "prefill_rejection_when_tint_fails",
           "require_devices"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# ATTNREG_CONFORMANCE=quick runs fewer cells per kernel (CI; the default is the full matrix).
QUICK = os.environ.get("ATTNREG_CONFORMANCE", "full") == "quick"
# The matrix's report files (what `attnreg conformance --json --markdown` writes), left by the
# test run for CI to keep: $ATTNREG_REPORT_DIR, default out/ in the checkout (ignored by git).
REPORT_DIR = Path(os.environ.get("ATTNREG_REPORT_DIR") or Path(__file__).parent.parent / "out")
# Backends whose cells run in test modules of their own, one module per group of kernel
# families: pytest-xdist's loadfile mode keeps a module on one worker, so the matrices (most of
# CI's time, nearly all of it compiling programs) spread over both workers, and each module's
# sessions reuse their compiled programs across its cells (a kernel's cells share a module).
# Every other backend's cells run in tests/conformance/test_conformance.py.
CELL_MODULES: dict[str, dict[str, str]] = {
    "opencl": {"decode_partial": "test_opencl_partial_cells",
               "decode_fused": "test_opencl_fused_cells", "*": "test_opencl_cells"},
    "webgpu": {"decode_partial": "test_webgpu_partial_cells",
               "decode_qk": "test_webgpu_unfused_cells", "decode_pv": "test_webgpu_unfused_cells",
               "*": "test_webgpu_cells"},
    "dawn": {"decode_partial": "test_dawn_partial_cells", "*": "test_dawn_cells"},
}


def check_close(spec: AttentionSpec, got: Any, tensors: dict[str, np.ndarray],
                tol: tuple[float, float] | None = None, what: str = "") -> float:
    """Assert got (out or (out, lse)) matches the reference within tolerance; return max err."""
    err, problem = compare(spec, got, expected(spec, tensors), tol)
    assert not problem, f"{what}: {problem}; spec={spec!r}"
    return err


def missing(why: str) -> NoReturn:
    """Skip a test whose machine lacks something CI has (lavapipe, PoCL); fail in CI."""
    if IN_CI:
        pytest.fail(f"missing in CI: {why}")
    pytest.skip(why)


def require_devices(backend: str) -> list[attnreg.DeviceCaps]:
    """Available devices of a backend; skip when none, but fail in CI (CI=true)."""
    devs = [d for d in attnreg.devices(backend) if d.available]
    if not devs:
        why = "; ".join(d.reason for d in attnreg.devices(backend)) or "no device"
        if IN_CI:
            pytest.fail(f"backend {backend} has no device in CI: {why}")
        pytest.skip(f"backend {backend} has no device: {why}")
    return devs


# The OpenCL device the OpenCL tests use: the first available one, or the one whose id or
# name contains $ATTNREG_OPENCL_DEVICE (e.g. ``ATTNREG_OPENCL_DEVICE=H100`` on the GPU machine).
OPENCL_DEVICE_ENV = "ATTNREG_OPENCL_DEVICE"


@functools.cache
def opencl_device() -> attnreg.DeviceCaps | None:
    """The OpenCL tests' device (OPENCL_DEVICE_ENV), None where there is none."""
    try:
        devs = [d for d in attnreg.devices("opencl") if d.available]
    except Exception:
        return None
    want = os.environ.get(OPENCL_DEVICE_ENV, "").lower()
    if want:
        devs = [d for d in devs if want in d.id.lower() or want in d.name.lower()]
    return devs[0] if devs else None


def require_opencl_device() -> attnreg.DeviceCaps:
    """opencl_device(); skip where OpenCL has no device (fail in CI), fail where none matches
    $ATTNREG_OPENCL_DEVICE."""
    require_devices("opencl")
    dev = opencl_device()
    if dev is None:
        pytest.fail(f"no OpenCL device matches ${OPENCL_DEVICE_ENV}="
                    f"{os.environ.get(OPENCL_DEVICE_ENV)!r}")
    return dev


def prefill_rejection_when_tint_fails(monkeypatch: pytest.MonkeyPatch, backend: str,
                                      spec: AttentionSpec, seed: int) -> str:
    """Break flash_prefill's WGSL for Tint, run ``spec`` on ``backend`` (checked against the
    reference if something else ran it) and return why ``<backend>.prefill.f32.sg`` was
    rejected: a compile failure must become a reason, and the plan go on past prefill."""
    from attnreg.backends.webgpu import program
    from attnreg.errors import NoKernelError

    real = program.load
    monkeypatch.setattr(program, "load", lambda name: real(name) + (
        "\nfn broken() -> f32 { return undefined_in_tint; }\n" if name == "flash_prefill" else ""))
    t = make_tensors(spec, seed=seed)
    with attnreg.Session(backend=backend) as s:
        try:
            out, plan = s.run_with_plan(spec, t)
            check_close(spec, out, t, what=plan.kernel)
            assert plan.route != "prefill"                         # re-planned past prefill
            rejected = s.explain(spec).rejected
        except NoKernelError as exc:        # nothing else compiled here either
            rejected = exc.rejected
    return " ".join(rejected[f"{backend}.prefill.f32.sg"])


def assert_covering(cells: list[cmod.Case], kernels: list[KernelInfo]) -> None:
    """The axis coverage the backends' hand-written case lists had, checked on the unified
    generator's cells of one backend's device: every seq_len, GQA ratio and layout pair per
    family; every head size and page size per backend, and per family as many as its
    kernels' new shapes hold; total lengths 1, > 1000 and +-1 around each of a kernel's kv
    tiles per variant; every contract feature and recipe per (kernel, dtype); document masks
    on block-skipping kernels; partial-state and reduce checks where the family has them."""
    assert cells, "no cells"
    covering = [c for c in cells if c.kind == "covering"]
    families: dict[str, list[cmod.Case]] = {}
    for c in covering:
        families.setdefault(c.family, []).append(c)
    for fam, mine in families.items():
        # each (kernel, dtype) brings new head sizes and KV kinds; a family's take
        # consecutive values, so they repeat only once all have been met
        heads = {c.spec.head_size for c in mine}
        valid = {h for h in cmod.HEAD_SIZES if any(k.head_size_ok(h) for k in kernels
                                                   if k.family == fam)}
        n_new = cmod.NEW_SHAPES * len({(c.kernel, c.spec.dtype) for c in mine})
        assert len(heads) >= min(len(valid), 1 + n_new), (fam, heads)
        assert {c.spec.group_size for c in mine} == set(cmod.GQA), fam
        seqs = {c.spec.seq_len for c in mine}
        assert seqs >= {s for s in cmod.SEQ_LENS if all(
            k.max_seq_len is None or s <= k.max_seq_len for k in kernels if k.family == fam)}, fam
        flat = {(c.spec.q_layout, c.spec.kv_layout) for c in mine if c.spec.kv_layout != "paged"}
        assert flat == set(cmod.LAYOUTS), (fam, flat)
        if all("paged" in k.kv_layouts for k in kernels if k.family == fam) and \
                n_new >= len(cmod.KV_KINDS):
            pages = {c.spec.page_size for c in mine if c.spec.kv_layout == "paged"}
            assert pages == set(cmod.PAGE_SIZES), (fam, pages)
    assert {c.spec.head_size for c in covering} >= set(cmod.HEAD_SIZES)
    if any("paged" in k.kv_layouts for k in kernels):
        assert {c.spec.page_size for c in covering} >= set(cmod.PAGE_SIZES)
    for k in kernels:
        mine = [c for c in cells if c.kernel == k.id]
        assert mine, f"{k.id}: no cells"
        recipes = recipes_mod.document_features if k.params.get("block_skip") \
            else recipes_mod.contract_features
        for dtype in k.dtypes:
            cov = [c for c in covering if c.kernel == k.id and c.spec.dtype == dtype]
            assert {c.feature for c in cov} == {r[0] for r in recipes(1, 1, 1, 1)}, (k.id, dtype)
            feats = set().union(*(c.spec.features for c in mine if c.spec.dtype == dtype))
            assert feats >= k.supports & ALL_FEATURES, (k.id, dtype, k.supports - feats)
        # totals rotate through a variant's dtypes (fewer recipes: the f16 kernel of a
        # block-skipping variant goes on where its f32 kernel stopped)
        totals = {c.spec.total_len for c in cells
                  if (c.family, c.variant) == (mine[0].family, mine[0].variant)}
        assert 1 in totals and any(t > 1000 for t in totals), (k.id, totals)
        for t in cmod.kv_tiles(k):
            assert {L % t for L in totals} >= {t - 1, 0, 1}, (k.id, t, totals)
        if k.params.get("block_skip"):
            assert any(c.docs for c in mine), k.id
        checks = {c.check for c in mine}
        if k.family == "reduce":
            assert checks == {"reduce"}, k.id
        elif k.family in cmod.PARTIAL_FAMILIES and not k.params.get("block_skip"):
            assert checks == {"attention", "partial"}, (k.id, checks)
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids)), "cell ids repeat"
    assert all(" " not in i for i in ids)


@functools.cache
def conformance_cells() -> tuple[cmod.Case, ...]:
    """The unified generator's cells on every available device (once per process)."""
    return tuple(conf.cases(attnreg.devices(), quick=QUICK))


# CI time (the quick matrix, cold PoCL / Mesa shader caches on a 2-core machine). Dawn and the
# browser run the very WGSL programs the webgpu backend runs (one program builder), so there
# the quick matrix keeps what proves the host: covering cells (every contract recipe) for the
# float16 kernels, non-finite and profile cells, and the feature cells that put every feature
# together ("all", the model shapes, big heads). On webgpu and opencl the one-feature-at-a-
# time cells run for the float16 kernels. A float32 / bfloat16 kernel (the same source with
# another element type) keeps, besides its covering cells on webgpu and opencl (every contract
# recipe, two-sided windows among them), its "all" and head-padding cells and its non-finite
# cells; so does a kernel run emulated on a device without its feature (OpenCL sub-group and
# tensor-core kernels on PoCL), whose float16 twin takes every recipe. The twins' quantized
# K/V readers and model shapes are the storage x family tests' (tests/backends/opencl/ and
# tests/backends/wgsl/ test_kv_dtypes.py read f32+int8 and bf16+int4 K/V per family; both
# test_model_shapes.py run the model shapes through float32 and bfloat16 kernels); dropping
# the twins' int8-all, int4-all, model-all and window2-all cells here saved 107 of OpenCL's
# 529 and 98 of webgpu's 356 quick-matrix programs. On the hosts a twin keeps its covering
# "all" cell and its non-finite cells: that the host's compiler takes the element type; the
# K/V readers and model shapes of the twin's WGSL are the webgpu twin's cells (dropping them
# there saved 101 of Dawn's 276 quick-matrix programs, ~1/3 of its CI time). The hosts' float16
# kernels read quantized K/V in tests/backends/wgsl/test_kv_dtypes.py (every family, each
# host) and in the webgpu kernels' cells, through the same WGSL: their int8-all / int4-all
# cells are not in the quick matrix (26 of Dawn's 175 programs).
ALL_FEATURE_CELLS = ("all", "model-all", "right-padded", "h320", "h512", "mla", "padded")
QUICK_FEATURE_DTYPES: dict[str, tuple[str, ...]] = {
    "dawn": (), "browser": (), "webgpu": ("float16",), "opencl": ("float16",)}
HOST_BACKENDS = ("dawn", "browser")
# The hosts' shape sweeps (model shapes, MLA's 576/512 heads, 320-wide heads, right-padded
# batches) are the webgpu kernels' cells on the same lavapipe, through the same WGSL, and
# tests/backends/wgsl/test_model_shapes.py runs model and MLA shapes through Dawn and the
# browser themselves; leaving them out of the hosts' quick matrix saved 46 of Dawn's cells
# (42 of its 149 programs) and 22 of the browser's (ci/results/cpu_ci_time.txt).
HOST_LEAVES = ("model-all", "mla", "h320", "right-padded")


def quick_keeps(c: cmod.Case) -> bool:
    dtypes = QUICK_FEATURE_DTYPES.get(c.backend)
    if dtypes is None or c.kind not in ("feature", "covering"):
        return True
    twin = c.spec.dtype != "float16"
    if c.kind == "covering":
        return not (twin and (c.backend in HOST_BACKENDS or c.emulated)) or c.feature == "all"
    if c.spec.dtype in dtypes:
        return True
    if twin:
        return c.backend not in HOST_BACKENDS and c.label in ("all", "padded")
    if c.backend in HOST_BACKENDS and c.label in HOST_LEAVES:
        return False
    return c.label.endswith(ALL_FEATURE_CELLS) and c.spec.kv_dtype is None


# The cells built with PoCL's optimizer on (the rest of the suite builds without it:
# tests/conftest.py): the float16 OpenCL kernels' non-finite cells.
OPTIMIZED_MODULE = "test_opencl_optimized_cells"


def cell_module(c: cmod.Case) -> str:
    """The test module of tests/conformance/ that runs a cell (CELL_MODULES, OPTIMIZED_MODULE)."""
    if c.backend == "opencl" and c.kind == "nonfinite" and c.spec.dtype == "float16":
        return OPTIMIZED_MODULE
    modules = CELL_MODULES.get(c.backend)
    return "test_conformance" if modules is None else modules.get(c.family, modules["*"])


def backend_cells(backend: str) -> list[cmod.Case]:
    """Every cell this run gives a backend, whichever module runs it."""
    return [c for c in conformance_cells()
            if c.backend == backend and (not QUICK or quick_keeps(c))]


def module_cells(module: str) -> list[cmod.Case]:
    """The cells a test module of tests/conformance/ runs (CELL_MODULES)."""
    return [c for c in conformance_cells()
            if cell_module(c) == module and (not QUICK or quick_keeps(c))]


def cell_test(module: str) -> Callable[..., None]:
    """A matrix module's test_cell: one test a cell of ``module``, named by the cell's id."""
    @parametrize_cells(module_cells(module))
    def test_cell(runner: CellRunner, case: cmod.Case) -> None:
        runner.check(case)
    return test_cell


def parametrize_cells(cells: list[cmod.Case]) -> pytest.MarkDecorator:
    """A matrix module's test_cell, one test a cell, named by the cell's id."""
    return pytest.mark.parametrize("case", cells, ids=[c.id for c in cells])


class CellRunner:
    """Runs a module's cells, one Session per device, and adds the module's results to the
    run's report (out/conformance.json and .md) when it closes."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.sessions: dict[tuple[str, bool], attnreg.Session] = {}
        self.results: list[conf.Result] = []

    def run(self, case: cmod.Case) -> conf.Result:
        s = self.sessions.get(conf.session_key(case))
        if s is None:
            s = self.sessions[conf.session_key(case)] = conf.session_for(case)
        r = conf.run_case(case, s)
        self.results.append(r)
        return r

    def check(self, case: cmod.Case) -> None:
        """Run a cell; it must pass."""
        r = self.run(case)
        assert r.status == "pass", f"{case.id}: {r.message}\nspec: {case.spec!r}"

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        if self.results:
            add_to_report(self.part, self.results)


def add_to_report(part: str, results: list[conf.Result]) -> None:
    """Store this module's results and rewrite the report from every module's of this run
    (pytest-xdist workers share its run id; a run without xdist is one process). The lock
    makes the last module to finish write the whole report."""
    parts = REPORT_DIR / ".conformance-parts"
    parts.mkdir(parents=True, exist_ok=True)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    with open(parts / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for old in parts.glob("*.pickle"):
            if not old.name.startswith(f"{run}-"):
                old.unlink()             # an earlier run's
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (parts / f"{run}-{worker}-{part}.pickle").write_bytes(pickle.dumps(results))
        merged = [r for f in sorted(parts.glob(f"{run}-*.pickle"))
                  for r in pickle.loads(f.read_bytes())]
        (REPORT_DIR / "conformance.json").write_text(
            json.dumps([r.as_dict() for r in merged], indent=1))
        (REPORT_DIR / "conformance.md").write_text(conf.markdown(merged))


def pocl_cl_device() -> tuple[Any, Any]:
    """(pyopencl, PoCL's device) for tests that build their own programs on CI's OpenCL."""
    require_devices("opencl")
    import pyopencl as cl

    for p in cl.get_platforms():
        if "portable" in p.name.lower():
            return cl, p.get_devices()[0]
    missing("no PoCL platform")
