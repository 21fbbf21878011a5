#!/usr/bin/env bash
# The README's test command (and CI's, through .ci/run): set up, lint, type-check, test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh test
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PATH="$PWD/.venv/bin:$PATH"
# CI runs the registry-generated matrix in quick mode: every registered variant on every CI
# device, every contract feature; the head-size / length / row sweeps are covered by the
# per-backend test files. ATTNREG_CONFORMANCE=full runs the whole matrix (about twice the
# cells), as does `attnreg conformance` without --quick.
export ATTNREG_CONFORMANCE="${ATTNREG_CONFORMANCE:-quick}"
# One BLAS thread per process: the two workers already fill both cores, and OpenBLAS's
# spinning threads only took CPU from them (the float64 reference's matmuls are small).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
start=$(date +%s)
echo "[test] ruff";  ruff check attnreg backends tests bench
bash ci/view.sh      # the installed layout, for the tools that read packages from disk
echo "[test] mypy";  mypy
echo "[test] import layering"; (cd .view && PYTHONPATH=. lint-imports --config ../pyproject.toml --no-cache)
echo "[test] pytest"
set +e
# Two workers (CI has two cores); each device-bound test module stays on one worker, so a
# session's compiled pipelines and programs are reused across its tests.
python -m pytest -q --durations=15 -n "${ATTNREG_TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ -f out/conformance.md ]; then
  echo "[test] conformance report: out/conformance.json, out/conformance.md ($(grep -m1 -o '[0-9]*/[0-9]* cells pass' out/conformance.md || true))"
fi
# pytest's exit 5 means no tests were collected: for us that is a failure too.
if [ "$rc" = 5 ]; then echo "[test] no tests collected: failing"; exit 1; fi
echo "[test] finished in $(( $(date +%s) - start )) s with exit status $rc"
exit "$rc"
