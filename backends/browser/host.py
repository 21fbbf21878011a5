"""One headless browser on one page, as a request/reply channel: ``call(job) -> reply``.

The host owns its server and its browser; closing it (also on a timeout, a crash or a
lost device) ends both. Nothing here knows about attention: the runtime, the probe and
the export test build on it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from attnreg import env

from . import wire
from .chromium import Chromium
from .server import PageServer

TIMEOUT_ENV = "ATTNREG_BROWSER_TIMEOUT"     # seconds one job may take (default 300)
START_TIMEOUT_S = 60.0
_T = TypeVar("_T")


class BrowserError(RuntimeError):
    """The browser or its page failed (did not start, crashed, timed out, lost the device)."""


def job_timeout() -> float:
    """Seconds one job may take: $ATTNREG_BROWSER_TIMEOUT (a SpecError naming it when it is
    not a number of seconds), default 300."""
    return env.seconds(TIMEOUT_ENV, 300.0)


class BrowserHost:
    """A browser showing ``page`` (``page.html`` unless told), served with a fresh token.

    ``mode`` is passed to the page: ``probe`` reports the adapter and stops, ``run`` also
    opens a device and serves jobs. ``static_dir`` is served under ``/x/``.
    """

    def __init__(self, mode: str = "run", *, page: str = "page.html",
                 static_dir: str | None = None, extra: Mapping[str, bytes] | None = None,
                 start_timeout: float = START_TIMEOUT_S, binary: str | None = None) -> None:
        self.server = PageServer(secrets.token_hex(16), static_dir, extra)
        self.browser: Chromium | None = None
        self._seq = 0
        self._call_lock = threading.Lock()      # one job at a time on the page
        try:
            self.browser = Chromium(self.server.url(page, mode=mode), binary)
            self.hello: dict[str, Any] = self._wait(lambda: self.server.hello, start_timeout,
                                                    "the page to report its WebGPU adapter")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self.browser.pid if self.browser is not None else None

    def alive(self) -> bool:
        return self.browser is not None and self.browser.alive()

    def _gone(self) -> str:
        """Why the host cannot take a job."""
        b = self.browser
        if b is None or b.closed:
            return "the browser host is closed"
        tail = b.log_tail()
        return (f"chromium exited (status {b.proc.poll()}) before the job was sent"
                + (f"; its log ends:\n{tail}" if tail else ""))

    def _wait(self, got: Callable[[], _T | None], timeout: float, what: str) -> _T:
        """Wait for ``got()``; fail early if the browser dies or the page reports trouble."""
        srv = self.server
        end = time.monotonic() + timeout
        with srv.cv:
            while True:
                value = got()
                if value is not None:
                    return value
                lost = [e for e in srv.events if e.get("kind") in ("lost", "fatal")]
                if lost:
                    raise BrowserError(f"the page failed while waiting for {what}: {lost[0]}")
                if self.browser is None or not self.browser.alive():
                    tail = self.browser.log_tail() if self.browser is not None else ""
                    raise BrowserError(f"chromium exited while waiting for {what}"
                                       + (f"; its log ends:\n{tail}" if tail else ""))
                left = end - time.monotonic()
                if left <= 0:
                    raise BrowserError(f"timed out after {timeout:.0f} s waiting for {what}")
                srv.cv.wait(min(left, 0.1))

    def call(self, header: Mapping[str, Any], blobs: Mapping[str, bytes | memoryview],
             timeout: float | None = None) -> tuple[dict[str, Any], dict[str, memoryview]]:
        """Send one job and return the page's reply; on timeout or crash the browser is
        ended (the host is then dead) and BrowserError raised."""
        with self._call_lock:
            if not self.alive():
                why = self._gone()
                self.close()
                raise BrowserError(why)
            self._seq += 1
            seq = self._seq
            self.server.submit(wire.encode({**header, "id": seq}, blobs))
            try:
                raw = self._wait(self.server.take_result, timeout or job_timeout(),
                                 f"job {seq} ({header.get('label', 'job')})")
                reply, out = wire.decode(raw)
            except BaseException:
                self.close()
                raise
            if reply.get("id") != seq:
                self.close()
                raise BrowserError(f"the page answered job {reply.get('id')}, expected {seq}")
            return reply, out

    def close(self) -> None:
        """End the browser and the server (idempotent)."""
        try:
            if self.browser is not None:
                self.browser.close()
        finally:
            self.server.close()

    def __enter__(self) -> BrowserHost:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
