"""Where attnreg keeps what it measured or built on this machine: $ATTNREG_CACHE_DIR, default
~/.cache/attnreg (the tuning cache, the Vulkan shim, the OpenCL probes' verdicts).

The directory is data, never code or flags (docs/errors.md "The cache directory"):

- it must be owned by the user and not writable by group or others, as ssh asks of ~/.ssh;
  anything else is a SpecError naming ATTNREG_CACHE_DIR;
- attnreg writes only into a directory that is its own: the default one, one it made, or one
  that holds its CACHEDIR.TAG (an empty directory is adopted); ATTNREG_CACHE_DIR=/etc is
  refused, never written;
- every write goes to a fresh temporary file (mkstemp, in the same directory) renamed over
  the target, so a planted symlink is replaced, never followed, and a reader sees the old
  file or the new one;
- every read opens the file without following a symlink, checks its owner, mode and size,
  and validates it against its schema (pydantic): a file of the wrong shape is ignored with
  a CacheWarning naming it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from . import env
from .errors import CacheWarning, SpecError, clip

ENV = "ATTNREG_CACHE_DIR"
TAG = "CACHEDIR.TAG"                     # https://bford.info/cachedir/ (backup tools skip it)
TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
            "# attnreg's cache: measured verdicts, tuning and the Vulkan shim it built.\n")
MAX_BYTES = 16 << 20                     # no cache file of attnreg's is near this
_LOCK = threading.Lock()
M = TypeVar("M", bound=BaseModel)


def root() -> Path:
    """The cache directory's path ($ATTNREG_CACHE_DIR, else ~/.cache/attnreg); not checked."""
    given = env.text(ENV)
    if not given:
        return Path(os.path.expanduser("~")) / ".cache" / "attnreg"
    if not os.path.isabs(given):
        raise SpecError(ENV, given, "an absolute path")
    return Path(given)


def _refuse(path: Path | str, why: str) -> SpecError:
    given = env.text(ENV)
    return SpecError(ENV, given or str(path), why + ("" if given else
                     f" (the default cache directory {path})"))


def _check_dir(path: Path) -> None:
    """The directory is the user's and only the user's (symlinks to it are followed)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "a directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _refuse(path, f"a directory owned by you (uid {os.geteuid()}) and not writable "
                      f"by group or others (it is uid {st.st_uid}, mode {st.st_mode & 0o777:o}: "
                      f"chmod go-w {path}), as ssh asks of ~/.ssh")


def directory(create: bool = False) -> Path | None:
    """The checked cache directory; None when it does not exist and ``create`` is False.
    Made (mode 0700, with its CACHEDIR.TAG) when asked to create it."""
    path = root()
    if not os.path.exists(path):
        if not create:
            return None
        os.makedirs(path, mode=0o700, exist_ok=True)
        _write_bytes(path / TAG, TAG_TEXT.encode())
    _check_dir(path)
    if env.text(ENV) and not _is_tagged(path):
        with os.scandir(path) as entries:
            foreign = any(entries)
        if foreign:
            raise _refuse(path, f"a directory of attnreg's own (one it made, which holds its "
                          f"{TAG}) or an empty one: attnreg does not write among other files")
        if create:
            _write_bytes(path / TAG, TAG_TEXT.encode())
    return path


def _is_tagged(path: Path) -> bool:
    raw = _read_bytes(path / TAG)
    return raw is not None and raw.startswith(TAG_TEXT.split("\n")[0].encode())


def subdir(*parts: str) -> Path:
    """A directory under the cache (made, mode 0700), each level checked like the cache."""
    path = directory(create=True)
    assert path is not None
    for part in parts:
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        if os.path.islink(path):
            raise _refuse(path, "a directory, not a symlink")
        _check_dir(path)
    return path


# -- files ---------------------------------------------------------------------------------
def _read_bytes(path: Path) -> bytes | None:
    """The file's bytes; None when it does not exist. A symlink, another owner, a mode
    writable by others or a size past MAX_BYTES: a CacheWarning, and None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:                        # ELOOP: a symlink; EACCES ...
        _warn(path, f"cannot be opened as a plain file ({exc.strerror})")
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}, not you" if st.st_uid != os.geteuid() else
               f"writable by group or others (mode {st.st_mode & 0o777:o})"
               if st.st_mode & 0o022 else
               f"larger than {MAX_BYTES} bytes" if st.st_size > MAX_BYTES else "")
        if why:
            _warn(path, why)
            return None
        return fh.read(MAX_BYTES + 1)


def _warn(path: Path, why: str) -> None:
    warnings.warn(f"attnreg ignores the cache file {clip(str(path), 300)}: {why}", CacheWarning,
                  stacklevel=3)


def _write_bytes(path: Path, data: bytes) -> None:
    """Write through a fresh temporary file in the same directory, renamed over ``path``
    (a symlink there is replaced, never followed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_file(path: Path) -> bytes | None:
    """A file of the cache (bytes), read with the checks above."""
    return _read_bytes(path)


def write_file(path: Path, data: bytes) -> None:
    """A file of the cache, written atomically (its directory must be checked already)."""
    _write_bytes(path, data)


def read_json(name: str, schema: TypeAdapter[Any]) -> Any | None:
    """The cache file ``name`` validated against ``schema``; None when absent or ignored (a
    CacheWarning names it)."""
    path = directory()
    if path is None:
        return None
    raw = _read_bytes(path / name)
    if raw is None:
        return None
    try:
        return schema.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the top level"
        _warn(path / name, f"not of attnreg's shape ({where}: {first['msg']})")
        return None


def write_json(name: str, schema: TypeAdapter[Any], data: Any) -> Path:
    """Store ``data`` (of ``schema``) as the cache file ``name``; returns its path."""
    path = directory(create=True)
    assert path is not None
    _write_bytes(path / name, schema.dump_json(data, indent=1))
    return path / name


def verdict(name: str, key: str, model: type[M], compute: Callable[[], M]) -> tuple[M, bool]:
    """A probe's measurement for ``key`` from the JSON file ``name`` under the cache,
    computed (and stored) when absent; also whether it came from the file. An unwritable
    cache only costs the probe once per process; a refused one is a SpecError."""
    schema = TypeAdapter(dict[str, model])           # type: ignore[valid-type]
    with _LOCK:
        stored = read_json(name, schema) or {}
        if key in stored:
            return stored[key], True
        got = compute()
        stored[key] = got
        with contextlib.suppress(OSError):
            write_json(name, schema, stored)
        return got, False
