"""Dawn's adapters -> DeviceCaps. Never raises: a missing or failing wgpudawn, or a Dawn that
refuses the machine's drivers, becomes an unavailable entry with the reason.

wgpudawn is an early (alpha) package with a statically linked Dawn, so the first probe in a
process first enumerates the adapters in a child process (about half a second): a Dawn that
crashes on this machine's drivers costs that child, never the caller's process. The
process-wide Dawn instance is then made with the toggles of toggles.py and, on Debian 12's
lavapipe, the pass-through ICD of attnreg.vkshim in the Vulkan loader's driver list.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from attnreg import env, vkshim
from attnreg.backends.webgpu import probe as wprobe
from attnreg.caps import DeviceCaps, unavailable
from attnreg.errors import SpecError

from . import toggles

NAME = "dawn"
PACKAGE = "wgpudawn"
PINNED = "0.32.0.4"                 # the version the dawn extra installs and CI runs
DISABLE_ENV = "ATTNREG_DAWN"         # "0" / "off": report the backend unavailable
# Dawn's feature names -> the normalized names kernels declare.
FEATURES = {"shader-f16": "shader-f16", "subgroups": "subgroups",
            "timestamp-query": "timestamp-query",
            "chromium-experimental-subgroup-matrix": "subgroup-matrix"}
# implicit-device-synchronization: Dawn locks the device around every call, so Sessions in
# different threads can share it (without it, two threads on one device crashed the process).
REQUEST = ("shader-f16", "subgroups", "timestamp-query", "implicit-device-synchronization")
# Asked for on a device only for a Session that opts in (flag experimental_features).
EXPERIMENTAL = ("chromium-experimental-subgroup-matrix",)
_SKIP_BACKENDS = ("opengl", "opengles", "null")
# Measured (tests/core/test_soak.py, strict xfail): on Mesa 22.3 lavapipe each dispatch of Tint's
# SPIR-V of a decode kernel (decode_partial, decode_qk, decode_pv) costs ~0.6 MB that is never
# returned; prefill, reduce, the same WGSL through naga, and Dawn on the H100 do not.
LAVAPIPE_LEAK = ("known driver defect: Mesa 22.3 lavapipe keeps ~0.6 MB per decode dispatch of "
                 "Tint's SPIR-V; for long decode loops on lavapipe use the webgpu backend (ranked "
                 "first, so attnreg.run does)")
_CHILD_TIMEOUT_S = 120.0

_LOCK = threading.Lock()
_ADAPTERS: list[Any] | None = None
_FAILED: str | None = None
_SETTINGS: tuple[str, ...] = ()


def version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing() -> str | None:
    """Why the backend cannot even start here, or None."""
    if env.switch(DISABLE_ENV) is False:
        return f"disabled by {DISABLE_ENV}"
    if version() is None:
        return (f"{PACKAGE} is not installed (pip install 'attnreg[dawn]', which pins "
                f"{PACKAGE}=={PINNED}; ci/setup.sh does)")
    return None


# A malformed variable (ATTNREG_DAWN_TOGGLES, ATTNREG_VK_SHIM) is a SpecError in the child
# too: its message comes back as the reason, not the child's traceback.
_CHILD = """
import json, sys
from attnreg.backends.dawn import probe
from attnreg.errors import SpecError
try:
    ads = probe._enumerate()
except SpecError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
print(json.dumps([str(a.info.get("device", "")) for a in ads]))
"""


def _child_check() -> str | None:
    """Enumerate the adapters in a child process first; the reason it failed, or None."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                              timeout=_CHILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the Dawn probe process failed: {exc!r}"
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-6:]
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"status {done.returncode}"
        return f"Dawn crashed or failed while enumerating adapters ({how}): " + " | ".join(tail)
    lines = (done.stdout or "").strip().splitlines()
    try:
        said = json.loads(lines[-1]) if lines else None
    except ValueError:
        said = None
    return str(said["refused"]) if isinstance(said, dict) and "refused" in said else None


@contextlib.contextmanager
def _native_warnings() -> Iterator[list[str]]:
    """Dawn prints its adapter warnings ("Warning: maxDynamic... artificially reduced") on
    the process's stderr from native code: catch them (fd 2 into a file for the duration)
    and hand them back, so they land in the device's settings instead of every caller's
    terminal. Anything else written meanwhile goes back to stderr."""
    caught: list[str] = []
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield caught
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield caught
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest: list[str] = []
            for line in tmp.read().decode(errors="replace").splitlines():
                (caught if line.startswith("Warning: ") else rest).append(line)
            if rest:
                print("\n".join(rest), file=sys.stderr)
            caught[:] = [w[len("Warning: "):] for w in caught]


def _enumerate() -> list[Any]:
    """Make the Dawn instance (toggles, shim) and list its adapters. Not cached."""
    global _SETTINGS
    wprobe.ensure_env()
    from wgpudawn.backends.dawn import extras

    known = {n: v["stage"] for n, v in extras.all_toggles().items()}
    chosen = toggles.in_force(known)
    lines = [t.line() for t in chosen]
    enable = [t.name for t in chosen if t.enable]
    disable = [t.name for t in chosen if not t.enable]
    try:
        extras.set_instance_extras(enable_toggles=enable, disable_toggles=disable)
    except RuntimeError as exc:        # someone made Dawn's instance before us
        lines = [f"dawn toggles not set: {exc}"]
    found, shimmed, warned = _listed()
    lines += [f"dawn said: {w}" for w in warned]
    if shimmed:
        lines.append(f"vulkan drivers: lavapipe through attnreg's pass-through ICD "
                     f"({vkshim.manifest()}): Dawn refuses Mesa 22.3 lavapipe without it")
    _SETTINGS = tuple(lines)
    return found


def _listed() -> tuple[list[Any], bool, list[str]]:
    """The instance's compute adapters, whether the shim stood in for lavapipe, and Dawn's
    native warnings while it listed them."""
    import wgpudawn

    with vkshim.loader_env() as files, _native_warnings() as warned:
        found = wgpudawn.gpu.enumerate_adapters_sync()
    return ([a for a in found if str(a.info.get("backend_type", "")).lower()
             not in _SKIP_BACKENDS], files is not None, warned)


def adapters() -> list[Any]:
    """The process's Dawn adapters (cached: an id names the same adapter later). Raises
    RuntimeError with the reason when Dawn cannot be used here."""
    global _ADAPTERS, _FAILED
    with _LOCK:
        if _ADAPTERS is not None:
            return _ADAPTERS
        try:
            if _FAILED is None:
                _FAILED = _missing()
            if _FAILED is None:
                toggles.edits()                 # a malformed variable: no child for it
                _FAILED = _child_check()
            if _FAILED is None:
                _ADAPTERS = _enumerate()
        except SpecError as exc:                # a malformed variable: its message
            _FAILED = str(exc)
        except Exception as exc:
            _FAILED = f"Dawn could not enumerate adapters: {exc!r}"
        if _FAILED is not None:
            raise RuntimeError(_FAILED)
        assert _ADAPTERS is not None
        return _ADAPTERS


def fresh_adapter(index: int) -> Any:
    """A new adapter object for the probed adapter ``index``: Dawn lets an adapter make one
    device, and a second device of the same GPU (the experimental one) needs another."""
    adapters()                                      # the instance, toggles and shim first
    with _LOCK:
        found = _listed()[0]
    # Dawn lists a process's adapters in one order; check that index still names that GPU.
    want = _ADAPTERS[index].info if _ADAPTERS is not None and index < len(_ADAPTERS) else {}
    got = found[index] if index < len(found) else None
    if got is None or got.info.get("device") != want.get("device"):
        raise RuntimeError(f"Dawn no longer lists adapter {index} ({want.get('device')})")
    return got


def _no_adapter_reason() -> str:
    lvp = vkshim.lavapipe_manifest()
    if lvp is not None and vkshim.manifest() is None:
        return ("Dawn found no adapter: it refuses Debian 12's lavapipe unless attnreg's "
                "pass-through Vulkan ICD is built (`attnreg vk-shim`; needs gcc and "
                "libvulkan-dev; ci/setup.sh does it)")
    return "Dawn found no Vulkan/Metal/D3D12 adapter"


def caps_of(index: int, adapter: Any, view: Any = None) -> DeviceCaps:
    """An adapter's caps; with ``view`` (a device the caller opened on it: its info,
    features and limits), that device's."""
    from wgpudawn.backends.dawn import extras

    caps = wprobe.caps_of(index, view if view is not None else adapter, backend=NAME,
                          features=FEATURES)
    props = extras.get_adapter_properties(adapter)
    extra = dict(caps.extra)
    extra["wgpudawn"] = version()
    extra["experimental_features"] = [f for f in EXPERIMENTAL if f in adapter.features]
    if "subgroup_matrix_configs" in props:
        extra["subgroup_matrix_configs"] = props["subgroup_matrix_configs"]
    settings = list(_SETTINGS)
    if caps.slug == "llvmpipe":
        settings.append(LAVAPIPE_LEAK)
    if version() != PINNED:
        settings.append(f"{PACKAGE} {version()} is not the pinned {PINNED}: results may differ")
    return caps.model_copy(update={
        "driver": f"{caps.driver} (Dawn/Tint via {PACKAGE} {version()})".strip(),
        "extra": extra, "settings": tuple(settings)})


def probe() -> list[DeviceCaps]:
    """Every usable Dawn adapter; never raises."""
    try:
        found = adapters()
    except Exception as exc:
        return [unavailable(NAME, str(exc))]
    return wprobe.describe(NAME, found, caps_of, _no_adapter_reason())


def configs_text(caps: DeviceCaps) -> str:
    """The subgroup-matrix shapes, e.g. 'f16 16x16x16->f32, ...' (for devices listings)."""
    cfgs = caps.extra.get("subgroup_matrix_configs") or []
    return ", ".join(f"{c['component_type']} {c['m']}x{c['n']}x{c['k']}->"
                     f"{c['result_component_type']}" for c in cfgs)

