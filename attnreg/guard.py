"""One Session's lock and open state, shared with everything that works on its device memory
(its DeviceTensors, KV caches and prepared runs), so that they need nothing private of the
Session: one operation at a time, Ctrl-C held while the device is mid-update
(interrupts.py), and nothing after close."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import ClosedError
from .interrupts import deferred


class Guard:
    """The lock (re-entrant: a Session operation calls its tensors' methods) and whether the
    Session was closed."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("session", "closed", "an open Session (it was closed)")

    @contextmanager
    def held(self, *, check_open: bool = True) -> Iterator[None]:
        """The lock, with Ctrl-C deferred; a ClosedError first if the Session was closed
        (``check_open=False``: callers that check their own tensors, or free them)."""
        with self.lock, deferred():
            if check_open:
                self.check_open()
            yield
