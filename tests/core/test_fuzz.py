"""Random, mostly invalid calls on every CI backend (attnreg.tools.fuzz, driven by
hypothesis): each returns a result that matches the reference, or raises SpecError naming a
field. A third are made in a hostile setting (attnreg.tools.fuzz_hostile: planted cache
files, malformed environment variables, a SIGALRM whose handler raises mid-call, scores
that overflow float32); an interrupt is an allowed outcome, after which the session must be
right. Bounded for CI (FUZZ_EXAMPLES per backend); the local profile is
`python -m attnreg.tools.fuzz --calls 2000` (or ATTNREG_FUZZ_EXAMPLES=2000 here)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnreg
from attnreg.tools import fuzz, fuzz_hostile

DEVICES = [d for d in attnreg.devices() if d.available]
IDS = [f"{d.backend}-{d.slug}" for d in DEVICES]
# 100 per backend in CI (CI time): the draws are seeded afresh each run, so the runs add up.
# The first calls take each hostile family in turn, so every run meets them all; after that
# each has p = 1/(3 x families) a call.
FUZZ_EXAMPLES = int(os.environ.get("ATTNREG_FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def sessions() -> Iterator[dict[str, attnreg.Session]]:
    opened: dict[str, attnreg.Session] = {}
    yield opened
    for s in opened.values():
        s.close()


# The signals family's alarm may land in a garbage-collector callback between calls, where
# Python reports and ignores it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("dev", DEVICES, ids=IDS)
def test_random_calls_end_in_a_result_or_a_spec_error(
        dev: attnreg.DeviceCaps, sessions: dict[str, attnreg.Session]) -> None:
    s = sessions.setdefault(dev.id, attnreg.Session(backend=dev.backend, device=dev.id))
    outcomes: list[str] = []
    families: list[str] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    # A seed, not hypothesis' randoms: the signals family's interrupt may land in any draw,
    # and hypothesis' own bookkeeping of its randoms must not be interrupted.
    @given(seed=st.integers(0, 2**32 - 1))
    def one(seed: int) -> None:
        n = len(outcomes)
        first = fuzz_hostile.FAMILIES[n] if n < len(fuzz_hostile.FAMILIES) else None
        outcome, detail = fuzz.classify(
            lambda: fuzz.one_call(random.Random(seed), s, seen=families, family=first))
        outcomes.append(outcome)
        assert outcome in ("ok", "spec_error", "interrupted"), f"seed {seed}: {outcome}: {detail}"

    one()
    # The generator must reach both ends: valid runs checked against the reference, and
    # rejections; and every hostile family.
    assert outcomes.count("ok") >= FUZZ_EXAMPLES // 20, outcomes
    assert outcomes.count("spec_error") >= FUZZ_EXAMPLES // 4, outcomes
    assert set(fuzz_hostile.FAMILIES) <= set(families), families
