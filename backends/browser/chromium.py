"""The headless Chromium process: found, started with its own temporary profile, and ended.

The browser starts in a session of its own, so its zygotes, GPU, renderer and utility
processes share its process group; the crashpad handlers detach into sessions of their own
but inherit an environment variable holding a random tag. Ending the browser ends exactly
those processes, by pid, so nothing leaks and nothing of anyone else's is touched. The main
process also gets PR_SET_PDEATHSIG (forked from a thread that lives as long as the
process), so that it dies with the Python process even when that is killed. Linux only
(/proc); elsewhere only the main process is tracked.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from attnreg import env

BINARY_ENV = "ATTNREG_CHROMIUM"          # path of a Chromium/Chrome binary to use
TAG_ENV = "ATTNREG_BROWSER_TAG"           # marks every process of one browser instance
CANDIDATES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome", "chrome")
# The flags the issue found to work on Debian 12 (SwiftShader adapter, no sandbox as root).
FLAGS = ("--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-default-browser-check", "--disable-extensions", "--mute-audio")
_PR_SET_PDEATHSIG = 1
_T = TypeVar("_T")


def find() -> str | None:
    """The browser binary: $ATTNREG_CHROMIUM, else the first candidate on PATH."""
    given = env.text(BINARY_ENV)
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _stat(pid: int) -> tuple[str, int]:
    """(state, process group) of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return fields[0].decode(), int(fields[2])


def _members(group: int, tag: str) -> list[int]:
    """Live (non-zombie) processes of one browser: those in its process group (the browser
    leads a session of its own; zygotes, GPU, renderer and utility processes stay in it)
    and those carrying its tag in their environment (crashpad handlers, which detach)."""
    needle = f"{TAG_ENV}={tag}".encode()
    out: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            state, pgrp = _stat(pid)
            if state == "Z":
                continue
            if pgrp != group:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if needle not in fh.read().split(b"\0"):
                        continue
        except OSError:
            continue
        out.append(pid)
    return out


class _Launcher:
    """Starts browsers from one daemon thread. PR_SET_PDEATHSIG fires when the *thread*
    that forked the child ends, so forking from whatever thread opened a Session (a worker
    thread that may finish early) would kill its browser; this thread lives as long as the
    process."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def run(self, fn: Callable[[], _T]) -> _T:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="attnreg-chromium",
                                                daemon=True)
                self._thread.start()
        fut: Future[_T] = Future()
        self._jobs.put((fn, fut))
        return fut.result()


_LAUNCHER = _Launcher()
_DIR_PREFIX = "attnreg-chromium-"


def _sweep_stale_dirs() -> None:
    """Remove the profiles of browsers whose Python process died without closing them
    (killed, or crashed: atexit never ran). The owner's pid is in the directory name."""
    if not os.path.isdir("/proc/self"):
        return                         # no way to tell a live owner from a dead one
    base = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            if not name.startswith(_DIR_PREFIX):
                continue
            owner = name[len(_DIR_PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


_LIVE: weakref.WeakSet[Chromium] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class Chromium:
    """One headless browser opened on ``url``; :meth:`close` ends it and all its processes."""

    # Zombies of its children may linger a moment after close(): the browser exits before
    # reaping them, and init reaps them (they hold no memory and run nothing).

    def __init__(self, url: str, binary: str | None = None) -> None:
        exe = binary or find()
        if exe is None:
            raise FileNotFoundError(
                "no Chromium found: install Debian's `chromium` package (ci/setup.sh does) or "
                f"set {BINARY_ENV} to a Chrome/Chromium binary")
        self.binary = exe
        self.tag = uuid.uuid4().hex
        _sweep_stale_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        self.log_path = os.path.join(self.dir, "chromium.log")
        profile = os.path.join(self.dir, "profile")
        child_env = {**os.environ, TAG_ENV: self.tag}
        self._closed = False
        args = [exe, *FLAGS, f"--user-data-dir={profile}", url]

        def spawn() -> subprocess.Popen[bytes]:
            with open(self.log_path, "wb") as log:
                return subprocess.Popen(args, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        self.proc = _LAUNCHER.run(spawn)
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this browser (the main one first)."""
        rest = [p for p in _members(self.proc.pid, self.tag) if p != self.proc.pid]
        return ([self.proc.pid] if self.proc.poll() is None else []) + rest

    def log_tail(self, n: int = 1500) -> str:
        """The end of the browser's own log, minus the D-Bus noise of a headless machine."""
        try:
            with open(self.log_path, errors="replace") as fh:
                lines = [ln for ln in fh.read().splitlines() if "dbus" not in ln.lower()]
        except OSError:
            return ""
        return "\n".join(lines)[-n:]

    def close(self, grace: float = 3.0) -> None:
        """End the browser: SIGTERM to the main process (it takes its children down), then
        SIGTERM, then SIGKILL, to any of its processes still alive; remove the profile."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            left = _members(self.proc.pid, self.tag)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            end = time.monotonic() + wait
            while _members(self.proc.pid, self.tag) and time.monotonic() < end:
                time.sleep(0.02)
        shutil.rmtree(self.dir, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        # Also runs at interpreter shutdown, when module globals may already be gone.
        if getattr(self, "_closed", True):
            return
        try:  # noqa: SIM105
            self.close(grace=1.0)
        except Exception:
            pass


@atexit.register
def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for b in live:
        with contextlib.suppress(Exception):
            b.close(grace=1.0)
