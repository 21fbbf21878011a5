"""The matrix modules' shared fixture: one CellRunner a module (its Sessions reuse their
compiled programs across the module's cells; it adds the module's results to the report)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import CellRunner


@pytest.fixture(scope="module")
def runner(request: pytest.FixtureRequest) -> Iterator[CellRunner]:
    cell_runner = CellRunner(request.module.__name__.rsplit(".", 1)[-1])
    yield cell_runner
    cell_runner.close()
