"""The fuzz's hostile families (issue [trust]): one call of attnreg.tools.fuzz made in a
hostile setting, and what the call must do there.

- ``cache``: a fresh ATTNREG_CACHE_DIR holding something planted (a tuning file of the wrong
  shape, a symlink to a victim file, a FIFO, a sparse 17 MB file, tuned parameters no kernel
  takes, a directory others may write, one full of foreign files) and the flag
  use_tuning_cache: a right result or a SpecError (CacheWarnings expected); the victim is
  never written.
- ``environment``: one attnreg variable that a call reads set to a malformed value: a right
  result, or a SpecError (naming the variable when it is the variable that is refused).
- ``signals``: a valid run with a SIGALRM due within 3 ms of its start, its handler raising
  FuzzAlarm, as a caller's timeout would: the call completes or raises it, and the
  session's next call (a fixed small run) must be right.
- ``magnitudes``: float32 / bfloat16 q and k scaled so every score overflows float32 (the
  rows turn NaN, docs/contract.md "Overflow"), or all of q, k and v made tiny; checked
  against the reference like any run.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import attnreg

from .. import cache, tuned
from ..errors import CacheWarning, SpecError
from ..spec import F32_MAX
from ..testing import compare, expected, make_tensors

FAMILIES = ("cache", "environment", "signals", "magnitudes")
# Variables a call reads, with malformed values (never a valid one: a valid tiny read-back
# bound could time a call out, which is what it is for).
ENV_VALUES: dict[str, tuple[str, ...]] = {
    "ATTNREG_FLAGS": ("route", "nope=1", "split_size=lots", "=", ",,,=x", "m_tile=" + "9" * 5000),
    "ATTNREG_WGSL_CHECKS": ("paranoid", "x" * 5000, "\x01"),
    "ATTNREG_DEVICE_TIMEOUT": ("abc", "-1", "nan", "inf", "1e309", "0", "1e-9"),
    "ATTNREG_BROWSER_TIMEOUT": ("abc", "-5", "nan"),
    "ATTNREG_CACHE_DIR": ("relative", "/tmp/\x01", "x" * 5000),
}
VERIFY = attnreg.AttentionSpec(batch=1, seq_len=1, past_len=11, num_heads=2, kv_num_heads=1,
                               head_size=16)


class FuzzAlarm(Exception):
    """Raised by the signals family's SIGALRM handler inside a call."""


class Finding(Exception):
    """A call whose result (or what it left behind) is wrong."""


# -- cache -------------------------------------------------------------------------------------
def _plant(rnd: random.Random, root: Path, victim: Path, s: attnreg.Session,
           spec: attnreg.AttentionSpec) -> None:
    """One hostile thing in the cache directory ``root`` (made by attnreg, empty)."""
    target = root / tuned.FILE
    how = rnd.randrange(8)
    if how == 0:
        target.write_text(rnd.choice(('[1, 2]', '{"a": 5}', '{"a": {"b": {"kernel": 1}}}',
                                      "not json", "\x00" * 64, '{"a": ' * 500)))
    elif how == 1:
        os.symlink(victim, target)
    elif how == 2:
        os.mkfifo(target)
    elif how == 3:
        with open(target, "wb") as fh:
            fh.truncate(cache.MAX_BYTES + 1)
    elif how == 4:
        os.chmod(root, 0o777)
    elif how == 5:
        (root / cache.TAG).unlink()
        (root / "foreign").write_text("not attnreg's")
    else:                              # tuned parameters only the checks of params refuse
        with contextlib.suppress(SpecError):
            plan = s.plan(spec)
            bad = rnd.choice(({"kv_tile": 0}, {"split_size": -5}, {"split_size": "x"},
                              {"split_size": 2**40}, {"zzz": 1}, {"m_tile": 3}))
            tuned.store(plan.caps, plan.stages[0].family, plan.spec,
                        {"kernel": plan.kernel, "params": bad, "us": 1.0,
                         "rule_default_us": 2.0})
    for p in root.iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o600)


@contextlib.contextmanager
def hostile_cache(rnd: random.Random, s: attnreg.Session,
                  spec: attnreg.AttentionSpec) -> Iterator[None]:
    """A fresh cache directory with one planted thing, for the duration of a call."""
    tmp = Path(tempfile.mkdtemp(prefix="attnreg-fuzz-"))
    victim = tmp / "victim"
    victim.write_text("precious")
    root = tmp / "cache"
    with _env(cache.ENV, str(root)), warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        try:
            cache.directory(create=True)
            _plant(rnd, root, victim, s, spec)
            yield
        finally:
            if victim.read_text() != "precious":
                raise Finding(f"the cache wrote through a planted symlink: {victim}")
            os.chmod(root, 0o700)
            shutil.rmtree(tmp, ignore_errors=True)


# -- environment -------------------------------------------------------------------------------
@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def hostile_environment(rnd: random.Random) -> tuple[str, contextlib.AbstractContextManager[None]]:
    """(variable, the setting of one malformed value for a call)."""
    name = rnd.choice(sorted(ENV_VALUES))
    return name, _env(name, rnd.choice(ENV_VALUES[name]))


# -- signals -----------------------------------------------------------------------------------
INTERRUPTED = "interrupted"


def with_alarm(delay: float, call: Callable[[], Any]) -> Any:
    """call() with a SIGALRM due after ``delay`` seconds whose handler raises FuzzAlarm (once;
    main thread only): what it returns, or INTERRUPTED."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    armed = [True]

    def handler(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise FuzzAlarm

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, delay)
        return call()
    except FuzzAlarm:
        return INTERRUPTED
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def verify(s: attnreg.Session) -> None:
    """The session's next call after an interrupted one is right."""
    t = make_tensors(VERIFY, seed=3, poison=False)
    _, problem = compare(VERIFY, s.run(VERIFY, t), expected(VERIFY, t))
    if problem:
        raise Finding(f"the session after an interrupt: {problem}")


# -- magnitudes --------------------------------------------------------------------------------
def extreme_magnitudes(rnd: random.Random, spec: attnreg.AttentionSpec,
                       t: dict[str, Any]) -> None:
    """q and k so large that every score overflows float32 (float32 / bfloat16 storage, same
    signs everywhere: no cancellation, so whether a score overflows does not depend on the
    order of the sum), or q, k and v tiny. In place."""
    floats = [n for n in ("q", "k", "v") if isinstance(t.get(n), np.ndarray)
              and t[n].dtype.name in ("float32", "float16", "bfloat16")]
    wide = spec.dtype != "float16" and spec.kv_dtype is None
    if wide and rnd.random() < 0.7:
        big = math.sqrt(10 * F32_MAX / (spec.effective_scale * spec.head_size * 0.6))
        for n in ("q", "k"):
            if n in floats:
                a = np.abs(t[n].astype(np.float32)) + np.float32(0.25)
                t[n] = (a * np.float32(min(big, 1e38))).astype(t[n].dtype)
    else:
        for n in floats:
            t[n] = (t[n].astype(np.float32) * np.float32(1e-20)).astype(t[n].dtype)
