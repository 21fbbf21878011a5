"""Signals between, not inside, device operations.

An exception raised halfway through a device operation can leave a read-back buffer mapped
(the next read aborts the process on wgpu), a lock of the GPU library held (the next submit
hangs: an exception from a SIGALRM handler did that inside wgpu-py's map) or a KV cache whose
host lengths and device seqlens disagree. Session operations therefore run inside
``deferred()``: every signal that has a Python handler (SIGINT's KeyboardInterrupt, a
caller's SIGALRM timeout, a SIGTERM handler ...) is held while the operation runs and
delivered, through the handler that was installed before, as soon as it is complete, so the
caller still gets the handler's effect (its exception), a moment later, with the Session
consistent.

A long wait for the device (a read-back) does not hold them for its whole length: it waits in
slices, and between slices ``pending()`` says whether a signal came; the waiter then cancels
what it waits for (the map) and calls ``deliver()``, which runs the handlers at once.

Only the main thread receives signals in Python, so other threads need no deferral.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

try:                     # the C module behind signal: its getsignal is 20x faster (no enum)
    import _signal

    _getsignal: Callable[[int], Any] = _signal.getsignal
    _setsignal: Callable[[int, Any], Any] = _signal.signal
except (ImportError, AttributeError):   # pragma: no cover - not CPython
    _getsignal, _setsignal = signal.getsignal, signal.signal

# Signals a Python handler may be installed for (SIGKILL and SIGSTOP cannot be caught).
_SIGNALS: tuple[int, ...] = tuple(sorted(int(s) for s in signal.valid_signals()
                                         if s not in (signal.SIGKILL, signal.SIGSTOP)))
_depth = 0                       # nesting of deferred() in the main thread
_held: list[int] = []            # signals that arrived inside, in order
_previous: dict[int, Any] = {}   # the handlers deferred() replaced


def _hold(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold every Python-handled signal for the duration of the block (main thread;
    elsewhere a no-op), then deliver the held ones."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    _depth = 1
    try:
        for num in _SIGNALS:
            handler = _getsignal(num)
            if callable(handler):        # not SIG_DFL / SIG_IGN / set outside Python
                _previous[num] = handler
                _setsignal(num, _hold)
        yield
    finally:
        _depth = 0
        for num, handler in _previous.items():
            _setsignal(num, handler)
        _previous.clear()
        held = list(dict.fromkeys(_held))
        _held.clear()
        for num in held:                 # now through the restored handlers, as Python would
            signal.raise_signal(num)


def pending() -> bool:
    """Whether a held signal waits for delivery (a waiter should stop and deliver it)."""
    return bool(_held)


def deliver() -> None:
    """Inside deferred(): run the held signals' handlers now, in order. The first that
    raises ends the call; the signals after it stay held until the block ends."""
    while _held:
        s = _held.pop(0)
        handler = _previous.get(s)
        if callable(handler):
            handler(s, None)             # the default SIGINT handler raises KeyboardInterrupt
