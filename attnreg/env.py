"""attnreg's environment variables, read and checked in one place: a malformed value is a
SpecError naming the variable (docs/errors.md "Environment variables" lists them), never
silently a default.

Where a variable is read inside a probe (which never raises), the error's message becomes
the unavailable device's reason.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from .errors import SpecError

TEXT_LIMIT = 4096            # no variable of attnreg's needs more characters
ON = ("1", "on", "yes", "true")
OFF = ("0", "off", "no", "false")


def text(name: str, default: str = "") -> str:
    """The variable's value (stripped), or ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if len(raw) > TEXT_LIMIT or any(ord(c) < 32 and c not in "\t\n" for c in raw):
        raise SpecError(name, raw, f"at most {TEXT_LIMIT} printable characters")
    return raw.strip()


def switch(name: str) -> bool | None:
    """True for 1 / on / yes / true, False for 0 / off / no / false, None when unset."""
    value = text(name).lower()
    if not value:
        return None
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SpecError(name, os.environ.get(name), f"one of {', '.join(ON + OFF)} (or unset)")


def seconds(name: str, default: float, lo: float = 0.001, hi: float = 7 * 86400.0) -> float:
    """A duration in seconds in [lo, hi], ``default`` when unset."""
    value = text(name)
    if not value:
        return default
    try:
        got = float(value)
    except ValueError:
        got = math.nan
    if not lo <= got <= hi:                   # NaN and inf included
        raise SpecError(name, value, f"a number of seconds in [{lo:g}, {hi:g}]")
    return got


def choice(name: str, default: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (case-insensitive), ``default`` when unset."""
    value = text(name).lower()
    if not value:
        return default
    if value not in choices:
        raise SpecError(name, os.environ.get(name), f"one of {list(choices)} (or unset)")
    return value


def file_path(name: str) -> str | None:
    """The path of an existing regular file, None when unset."""
    value = text(name)
    if not value:
        return None
    if not os.path.isfile(value):
        raise SpecError(name, value, "the path of an existing file")
    return value


def items(name: str, sep: str = ",") -> list[str]:
    """The non-empty items of a ``sep``-separated list."""
    return [x.strip() for x in text(name).split(sep) if x.strip()]
