"""Random, mostly invalid calls on every CI backend (attnreg.tools.fuzz, driven by
hypothesis): each returns a finite result that matches the reference, or raises SpecError
naming a field. Bounded for CI (FUZZ_EXAMPLES per backend); the local profile is
`python -m attnreg.tools.fuzz --calls 2000`."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnreg
from attnreg.tools import fuzz

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
FUZZ_EXAMPLES = int(os.environ.get("ATTNREG_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def sessions() -> Iterator[dict[str, attnreg.Session]]:
    opened: dict[str, attnreg.Session] = {}
    yield opened
    for s in opened.values():
        s.close()


@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_random_calls_end_in_a_result_or_a_spec_error(
        dev: attnreg.DeviceCaps, sessions: dict[str, attnreg.Session]) -> None:
    s = sessions.setdefault(dev.id, attnreg.Session(backend=dev.backend, device=dev.id))
    outcomes: list[str] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rnd=st.randoms(use_true_random=False))
    def one(rnd: random.Random) -> None:
        outcome, detail = fuzz.classify(lambda: fuzz.one_call(rnd, s))
        outcomes.append(outcome)
        assert outcome in ("ok", "spec_error"), f"{outcome}: {detail}"

    one()
    # The generator must reach both ends: valid runs checked against the reference, and
    # rejections.
    assert outcomes.count("ok") >= FUZZ_EXAMPLES // 20, outcomes
    assert outcomes.count("spec_error") >= FUZZ_EXAMPLES // 4, outcomes
