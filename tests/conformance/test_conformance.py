"""The conformance matrix, generated from the registry (attnreg.tools.cases): every kernel
variant on every available device, forced, against the float64 reference. The WebGPU, Dawn
and OpenCL cells run in modules of their own (tests.support.CELL_MODULES), the others here;
together they write out/conformance.{json,md}.

ATTNREG_CONFORMANCE=quick runs fewer cells per kernel (the default is the full matrix).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import attnreg
from attnreg.tools import conformance as conf
from tests.support import IN_CI, CellRunner, conformance_cells, module_cells, parametrize_cells, quick_keeps
from tests.toy_plugin import ToyPlugin

REQUIRED = conf.load_required(str(Path(__file__).parents[2] / "ci" / "required_matrix.json"))
DEVICES = attnreg.devices()
CASES = module_cells("test_conformance")


@parametrize_cells(CASES)
def test_cell(runner: CellRunner, case: conf.Case) -> None:
    runner.check(case)


def test_cells_are_distinct() -> None:
    """No two cells are the same test (spec, kernel, params and input recipe), and ids are
    unique; every kernel with cells gets covering cells too."""
    everything = conformance_cells()
    assert len({c.key for c in everything}) == len(everything)
    assert len({c.id for c in everything}) == len(everything)
    kernels = {c.kernel for c in everything}
    assert kernels == {c.kernel for c in everything if c.kind == "covering"}


def test_quick_matrix_keeps_every_kernels_covering_and_nonfinite_cells() -> None:
    """What CI leaves out never takes a kernel's own proof on a device: every (kernel, device)
    keeps every non-finite cell and at least one covering cell, and a kernel that is not a
    dtype twin or an emulated build keeps every covering recipe (its twins' recipes are the
    same source's, checked through this kernel)."""
    full = [c for c in conformance_cells() if c.kind in ("covering", "nonfinite")]
    kept = {c.id for c in full if quick_keeps(c)}
    pairs: dict[tuple[str, str], list[conf.Case]] = {}
    for c in full:
        pairs.setdefault((c.kernel, c.device), []).append(c)
    for (kernel, device), cells in pairs.items():
        assert any(c.kind == "covering" and c.id in kept for c in cells), (kernel, device)
        lost = [c.id for c in cells if c.id not in kept
                and (c.kind == "nonfinite" or (c.spec.dtype == "float16" and not c.emulated))]
        assert not lost, (kernel, device, lost[:5])


def test_required_devices_present() -> None:
    missing = conf.missing_required(REQUIRED, DEVICES)
    if missing and not IN_CI:
        pytest.skip(f"not on this machine: {missing}")
    assert not missing, f"required CI devices missing: {missing}"


def test_every_registered_kernel_has_cells() -> None:
    allowed = REQUIRED.get("uncoverable", {})
    gaps = {k: why for k, why in conf.uncovered(conformance_cells(), DEVICES).items()
            if k not in allowed}
    unavailable = {d.backend for d in DEVICES if not d.available}
    if not IN_CI:  # locally a backend without a device cannot be covered; CI must cover it
        gaps = {k: w for k, w in gaps.items() if k.split(".")[0] not in unavailable}
    assert not gaps, "registered kernels no CI device ran:\n" + "\n".join(
        f"  {k}: {w}" for k, w in sorted(gaps.items()))
    stale = set(allowed) - {k.id for k in attnreg.kernels()}
    assert not stale, f"ci/required_matrix.json exempts kernels that no longer exist: {stale}"


def test_matrix_catches_a_vendor_path_that_skips_keys() -> None:
    plugin = ToyPlugin()
    attnreg.register_plugin(plugin, name="toy-conformance")
    try:
        toy = [d for d in attnreg.devices("toy") if d.available]
        cells = conf.cases(toy, kernels=[attnreg.registry.get().kernel(
            "toy.prefill.f32.nvidia_skip16")])
        assert cells, "the vendor variant must get cells on a non-vendor device (forced)"
        results = conf.run_matrix(cells)
        failed = [r for r in results if r.status == "fail"]
        # Every cell with more than 16 visible keys must catch the dropped keys.
        assert len(failed) >= len(results) // 2, [r.case.id for r in results]
        assert all("values off" in r.message for r in failed)
    finally:
        attnreg.unregister_plugin(name="toy-conformance")


def test_report_formats(tmp_path: Path) -> None:
    cells = conf.cases([d for d in DEVICES if d.backend == "reference"], quick=True)[:6]
    results = conf.run_matrix(cells)
    md = conf.markdown(results)
    assert "| reference.prefill |" in md and "6/6 cells pass" in md
    rows = [r.as_dict() for r in results]
    assert set(rows[0]) >= {"backend", "device", "kernel", "case", "dtype", "status",
                            "max_abs_err", "atol", "rtol", "seconds"}
