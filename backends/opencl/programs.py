"""OpenCL C sources and the process-wide program build cache.

Sources are read with importlib.resources from the ``kernels_cl`` package (never from a
path relative to the checkout). A program is built once per (device, driver, source
hash, build options) and shared by every Session in the process; a failed build is
remembered too and surfaces as :class:`attnreg.KernelUnavailable` carrying the build log,
so the Session re-plans and the next candidate runs.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from dataclasses import dataclass
from functools import cache
from importlib import resources

import pyopencl as cl

from attnreg.errors import KernelUnavailable
from backends import common

# family -> source files, in include order (the Params struct is generated in front)
_DECODE = ("common.cl", "flash_core.cl", "subgroups.cl", "decode_core.cl")
FILES = {
    "prefill": ("common.cl", "flash_core.cl", "subgroups.cl", "flash_prefill.cl"),
    "decode_partial": (*_DECODE, "decode_partial.cl"),
    "decode_fused": (*_DECODE, "decode_fused.cl"),
    "decode_qk": ("common.cl", "flash_core.cl", "decode_qk.cl"),
    "decode_pv": ("common.cl", "flash_core.cl", "decode_pv.cl"),
    "reduce": ("common.cl", "reduce.cl"),
}
ENTRY = {"prefill": "flash_prefill", "reduce": "reduce",
         **{f: f for f in ("decode_partial", "decode_fused", "decode_qk", "decode_pv")}}
BASE_OPTIONS = ("-cl-std=CL1.2",)


@cache
def read_file(name: str) -> str:
    return resources.files("kernels_cl").joinpath(name).read_text(encoding="utf-8")


def load_source(family: str) -> str:
    """The complete OpenCL C text of one family (tests may monkeypatch this)."""
    return common.opencl_struct() + "".join(read_file(f) for f in FILES[family])


EXTRA_ENV = "ATTNREG_OPENCL_BUILD_OPTIONS"   # e.g. -cl-nv-verbose, for diagnosis


def options(defines: dict[str, int], extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    env = tuple(os.environ.get(EXTRA_ENV, "").split())
    return BASE_OPTIONS + extra + env + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


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
