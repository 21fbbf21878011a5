"""One OpenCL context per device, shared by every Session in the process, and the program
build cache.

A program is built once per (device, driver, source hash, build options) and shared by
every Session in the process; a failed build is remembered too and surfaces as
:class:`attnreg.KernelUnavailable` carrying the build log, so the Session re-plans and the
next candidate runs. The sources and options come from program.py.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass

import pyopencl as cl

from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable

_CTX_LOCK = threading.Lock()
_CONTEXTS: dict[str, tuple[cl.Context, cl.Device]] = {}


def context(caps: DeviceCaps) -> tuple[cl.Context, cl.Device]:
    """The one context per device in this process (programs are shared through it)."""
    with _CTX_LOCK:
        got = _CONTEXTS.get(caps.id)
        if got is None:
            pi, di = int(caps.extra["platform_index"]), int(caps.extra["device_index"])
            dev = cl.get_platforms()[pi].get_devices()[di]
            got = _CONTEXTS[caps.id] = (cl.Context([dev]), dev)
        return got


@dataclass(frozen=True)
class Key:
    device: str
    driver: str
    source_sha: str
    options: tuple[str, ...]


_LOCK = threading.Lock()
_PROGRAMS: dict[Key, cl.Program] = {}
_FAILED: dict[Key, str] = {}
BUILDS = {"count": 0}          # builds actually run (tests check that Sessions share them)


def build(ctx: cl.Context, device: cl.Device, kernel_id: str, source: str,
          opts: tuple[str, ...]) -> cl.Program:
    """The built program for this device, source and options (cached process-wide)."""
    key = Key(f"{device.platform.name}|{device.name}|ctx{ctx.int_ptr:x}", device.driver_version,
              hashlib.sha256(source.encode()).hexdigest(), opts)
    with _LOCK:
        prog = _PROGRAMS.get(key)
        if prog is not None:
            return prog
        if key in _FAILED:
            raise KernelUnavailable(kernel_id, _FAILED[key])
        BUILDS["count"] += 1
        try:
            with warnings.catch_warnings():
                # Successful builds may log unroll hints a compiler could not apply.
                warnings.simplefilter("ignore", cl.CompilerWarning)
                prog = cl.Program(ctx, source).build(options=list(opts), devices=[device])
        except (cl.RuntimeError, cl.LogicError) as exc:
            why = f"OpenCL build failed ({' '.join(opts)}): {_log(exc)}"
            _FAILED[key] = why
            raise KernelUnavailable(kernel_id, why) from None
        _PROGRAMS[key] = prog
        return prog


def _log(exc: Exception) -> str:
    """The compiler's log, trimmed to what a person reads first."""
    text = str(exc)
    for marker in ("Build on <pyopencl.Device", "build log"):
        pos = text.find(marker)
        if pos >= 0:
            text = text[pos:]
            break
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:40])


def clear() -> None:
    """Forget built programs and remembered failures (tests)."""
    with _LOCK:
        _PROGRAMS.clear()
        _FAILED.clear()


def binaries() -> dict[Key, bytes]:
    """Device binaries of the built programs (PTX on NVIDIA), for inspection."""
    with _LOCK:
        out: dict[Key, bytes] = {}
        for k, p in _PROGRAMS.items():
            blobs: list[bytes] = p.get_info(cl.program_info.BINARIES)  # type: ignore[assignment]
            out[k] = bytes(blobs[0])
        return out


def build_logs() -> dict[Key, str]:
    """The compiler's log of every built program (ptxas statistics with -cl-nv-verbose)."""
    with _LOCK:
        out: dict[Key, str] = {}
        for k, p in _PROGRAMS.items():
            dev = p.get_info(cl.program_info.DEVICES)[0]  # type: ignore[index]
            out[k] = str(p.get_build_info(dev, cl.program_build_info.LOG))
        return out
