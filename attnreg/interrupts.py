"""Ctrl-C between, not inside, device operations.

A KeyboardInterrupt raised halfway through a device operation can leave a read-back buffer
mapped (the next read aborts the process on wgpu) or a KV cache whose host lengths and
device seqlens disagree. Session operations therefore run inside ``deferred()``: a SIGINT
that arrives meanwhile is held and delivered (through the handler that was installed
before) as soon as the operation is complete, so the caller still gets its
KeyboardInterrupt, a moment later, with the Session consistent.

Only the main thread receives signals in Python, so other threads need no deferral.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

_depth = 0                       # nesting of deferred() in the main thread
_held: list[int] = []            # signals that arrived inside


def _hold(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT for the duration of the block (main thread; elsewhere a no-op)."""
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
    previous: Any = signal.getsignal(signal.SIGINT)
    if not callable(previous):          # SIG_IGN / SIG_DFL / set outside Python: leave it
        yield
        return
    signal.signal(signal.SIGINT, _hold)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        signal.signal(signal.SIGINT, previous)
        if _held:
            _held.clear()
            previous(signal.SIGINT, None)   # the default handler raises KeyboardInterrupt
