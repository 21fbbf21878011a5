"""The conformance matrix, generated from the registry: every kernel variant on every
available device, forced, against the float64 reference.

ATTNREG_CONFORMANCE=quick runs fewer cells per kernel (the default is the full matrix).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import attnreg
from attnreg.tools import conformance as conf
from tests.support import IN_CI
from tests.toy_plugin import ToyPlugin

QUICK = os.environ.get("ATTNREG_CONFORMANCE", "full") == "quick"
REQUIRED = conf.load_required(str(Path(__file__).parent.parent / "ci" / "required_matrix.json"))
DEVICES = attnreg.devices()
CASES = conf.cases(DEVICES, quick=QUICK)
_SESSIONS: dict[str, attnreg.Session] = {}
_RESULTS: list[conf.Result] = []
# The matrix's report files (what `attnreg conformance --json --markdown` writes), left by the
# test run for CI to keep: $ATTNREG_REPORT_DIR, default out/ in the checkout (ignored by git).
REPORT_DIR = Path(os.environ.get("ATTNREG_REPORT_DIR") or Path(__file__).parent.parent / "out")


@pytest.fixture(scope="module", autouse=True)
def _close_sessions() -> Iterator[None]:
    yield
    for s in _SESSIONS.values():
        s.close()
    _SESSIONS.clear()
    if _RESULTS:
        REPORT_DIR.mkdir(parents=True, exist_ok=True)
        (REPORT_DIR / "conformance.json").write_text(
            json.dumps([r.as_dict() for r in _RESULTS], indent=1))
        (REPORT_DIR / "conformance.md").write_text(conf.markdown(_RESULTS))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cell(case: conf.Case) -> None:
    s = _SESSIONS.get(case.device)
    if s is None:
        s = _SESSIONS[case.device] = attnreg.Session(backend=case.backend, device=case.device)
    r = conf.run_case(case, s)
    _RESULTS.append(r)
    assert r.status == "pass", f"{case.id}: {r.message}\nspec: {case.spec!r}"


def test_required_devices_present() -> None:
    missing = conf.missing_required(REQUIRED, DEVICES)
    if missing and not IN_CI:
        pytest.skip(f"not on this machine: {missing}")
    assert not missing, f"required CI devices missing: {missing}"


def test_every_registered_kernel_has_cells() -> None:
    allowed = REQUIRED.get("uncoverable", {})
    gaps = {k: why for k, why in conf.uncovered(CASES, DEVICES).items() if k not in allowed}
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
