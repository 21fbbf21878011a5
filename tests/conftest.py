"""Per-module hygiene: the process-wide default Sessions (attnreg.run(..., backend=...),
attnreg.merge_states(..., backend=...)) are closed when a module ends, so a browser or
device they opened never outlives the module that asked for it (pytest-xdist runs several
modules in one worker, and tests/test_browser.py checks that no browser is left running)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from attnreg import api


@pytest.fixture(scope="module", autouse=True)
def _close_default_sessions() -> Iterator[None]:
    yield
    with api._LOCK:
        sessions = list(api._DEFAULT.values())
        api._DEFAULT.clear()
    for s in sessions:
        s.close()
