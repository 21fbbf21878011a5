"""The lavapipe pass-through Vulkan ICD that lets Dawn use Debian 12's Mesa 22.3 lavapipe.

Dawn (the dawn backend's wgpudawn, and onnxruntime-webgpu's Dawn) refuses a Vulkan device
without two image-array dynamic-indexing features that Mesa 22.3's lavapipe lacks; compute
over storage buffers never uses them. ``data/vkshim.c`` is an ICD that reports them present
and forwards everything else to lavapipe. This module builds it (gcc and the Vulkan headers:
Debian's ``gcc`` and ``libvulkan-dev``; ``attnreg vk-shim`` or the README's set-up does it)
into the user cache, and gives the Vulkan loader's driver list with lavapipe swapped for it.

Nothing here imports a GPU API; it only compiles a file and edits environment variables.
``ATTNREG_VK_SHIM`` overrides: a path to an ICD manifest to use, or ``0`` for never.

The cache directory is data, never code (attnreg/cache.py): a built shim is handed to the
Vulkan loader only after its library's bytes match the SHA-256 that attnreg recorded when it
built it, and its manifest names that library; anything else there is rebuilt (or, without
a compiler, not used).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from . import cache, env
from .errors import SpecError

ENV = "ATTNREG_VK_SHIM"
LOADER_VARS = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES")     # the newer name wins in the loader
ICD_DIRS = ("/usr/share/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/etc/vulkan/icd.d")
LIBRARY = "libattnreg_vkshim.so"
MANIFEST = "attnreg_vkshim_icd.json"
RECORD = "libattnreg_vkshim.so.sha256"     # the library's hash, written when attnreg built it
_ENV_LOCK = threading.Lock()


def source() -> str:
    return resources.files("attnreg").joinpath("data/vkshim.c").read_text()


def cache_dir() -> Path:
    return cache.root() / "vkshim"


def _key(real: str) -> str:
    return hashlib.sha256(f"{source()}\0{real}".encode()).hexdigest()[:16]


def is_lavapipe(manifest: str) -> bool:
    return "lvp_icd" in os.path.basename(manifest)


def system_manifests() -> list[str]:
    """The ICD manifests the loader would find by itself (no variable set)."""
    found: list[str] = []
    for d in ICD_DIRS:
        found += sorted(glob.glob(os.path.join(d, "*.json")))
    return found


def _named() -> list[str] | None:
    for var in LOADER_VARS:
        val = os.environ.get(var)
        if val:
            return [p for p in val.split(os.pathsep) if p]
    return None


def lavapipe_manifest() -> str | None:
    """This machine's lavapipe ICD manifest for its own architecture, or None."""
    arch = platform.machine()
    cands = [m for m in (_named() or system_manifests()) if is_lavapipe(m)]
    mine = [m for m in cands if arch in os.path.basename(m)] or \
        [m for m in cands if not any(a in os.path.basename(m) for a in ("i686", "aarch64",
                                                                          "x86_64", "armv7"))]
    return mine[0] if mine else None


def real_library(manifest: str) -> str:
    """The driver library a manifest names (a bare name is left for dlopen to find)."""
    with open(manifest) as fh:
        path = str(json.load(fh)["ICD"]["library_path"])
    if os.sep in path and not os.path.isabs(path):
        path = os.path.join(os.path.dirname(manifest), path)
    return path


def _target(real: str) -> Path:
    return cache_dir() / _key(real)


def verified(out: Path) -> bool:
    """Whether the shim in ``out`` is the one attnreg built: the library's bytes hash to the
    recorded SHA-256 and the manifest names that library (every file read without following
    a symlink, owned by the user, not writable by others)."""
    lib, record, man = (cache.read_file(out / n) for n in (LIBRARY, RECORD, MANIFEST))
    if lib is None or record is None or man is None:
        return False
    if hashlib.sha256(lib).hexdigest() != record.decode(errors="replace").strip():
        return False
    try:
        named = json.loads(man)["ICD"]["library_path"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(named == str(out / LIBRARY))


def built(real: str | None = None) -> Path | None:
    """The manifest of an up-to-date shim for this lavapipe that attnreg built (verified),
    or None."""
    if real is None:
        lvp = lavapipe_manifest()
        if lvp is None:
            return None
        real = real_library(lvp)
    out = _target(real)
    if not os.path.isdir(out):
        return None
    cache.subdir("vkshim", _key(real))            # the directories' owner and mode
    return out / MANIFEST if verified(out) else None


def build(force: bool = False) -> Path:
    """Compile the shim for this machine's lavapipe (idempotent) and return its manifest.
    Raises RuntimeError saying what is missing (lavapipe, gcc, the Vulkan headers)."""
    lvp = lavapipe_manifest()
    if lvp is None:
        raise RuntimeError("no lavapipe ICD manifest (lvp_icd.*.json) found: install Debian's "
                           "mesa-vulkan-drivers")
    real = real_library(lvp)
    have = built(real)
    if have is not None and not force:
        return have
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("no C compiler (gcc) to build the Vulkan shim: apt install gcc")
    out = cache.subdir("vkshim", _key(real))
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        src = Path(tmp) / "vkshim.c"
        src.write_text(source())
        lib = Path(tmp) / LIBRARY
        define = "-DATTNREG_REAL_ICD=" + json.dumps(real)
        cmd = [cc, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", define, "-o", str(lib),
               str(src), "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            hint = " (the Vulkan headers: apt install libvulkan-dev)" \
                if "vulkan/vulkan.h" in done.stderr else ""
            raise RuntimeError(f"building the Vulkan shim failed{hint}:\n{done.stderr.strip()}")
        with open(lvp) as fh:
            api = str(json.load(fh)["ICD"].get("api_version", "1.1.0"))
        data = lib.read_bytes()
        # atomic, each through a fresh temporary file: a concurrent reader sees old or new
        cache.write_file(out / LIBRARY, data)
        cache.write_file(out / RECORD, hashlib.sha256(data).hexdigest().encode())
        cache.write_file(out / MANIFEST, json.dumps({"file_format_version": "1.0.0", "ICD": {
            "library_path": str(out / LIBRARY), "api_version": api}}, indent=1).encode())
    return out / MANIFEST


def manifest() -> str | None:
    """The shim manifest to use here: ``$ATTNREG_VK_SHIM`` (a path, or ``0`` for none; a
    SpecError naming it when it is neither), else the one attnreg built for this machine's
    lavapipe, verified, and rebuilt when it does not verify; None when there is none."""
    given = env.text(ENV)
    if given == "0":
        return None
    if given:
        return _named_manifest(given)
    got = built()
    if got is None and _target_exists():
        try:                        # there, but not what attnreg built: build it again
            got = build(force=True)
        except (RuntimeError, OSError):
            return None
    return str(got) if got is not None else None


def _target_exists() -> bool:
    lvp = lavapipe_manifest()
    return lvp is not None and os.path.isdir(_target(real_library(lvp)))


def _named_manifest(path: str) -> str:
    """$ATTNREG_VK_SHIM's manifest, checked: a readable ICD manifest (JSON with
    ICD.library_path)."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read(1 << 20))
        ok = isinstance(data["ICD"]["library_path"], str)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise SpecError(ENV, path, "0 (no shim) or the path of a Vulkan ICD manifest (JSON with "
                        "ICD.library_path)")
    return path


def driver_files() -> str | None:
    """The loader's driver list with lavapipe replaced by the shim: the user's list when one
    is named (VK_DRIVER_FILES / VK_ICD_FILENAMES), else the system's. None when nothing
    changes (no lavapipe in the list, or no shim)."""
    shim = manifest()
    named = _named()
    listed = named if named is not None else system_manifests()
    if shim is None or not any(is_lavapipe(m) for m in listed):
        return None
    out = [shim if is_lavapipe(m) else m for m in listed]
    return os.pathsep.join(dict.fromkeys(out))


@contextlib.contextmanager
def loader_env() -> Iterator[str | None]:
    """Within the block, the Vulkan loader sees the shim instead of lavapipe (it reads the
    variables at each vkCreateInstance, so only instances made inside are affected). Yields
    the driver list in force, or None when nothing was changed."""
    files = driver_files()
    if files is None:
        yield None
        return
    with _ENV_LOCK:
        saved = {v: os.environ.get(v) for v in LOADER_VARS}
        for v in LOADER_VARS:
            os.environ[v] = files
        try:
            yield files
        finally:
            for v, old in saved.items():
                if old is None:
                    os.environ.pop(v, None)
                else:
                    os.environ[v] = old
