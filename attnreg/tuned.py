"""The tuning cache: parameters measured fastest per device, which the rule ``tuning_cache``
reads (flag ``use_tuning_cache``) and `attnreg tune` (attnreg.tools.tune) writes.

The cache is a JSON file ($ATTNREG_CACHE_DIR/tuning.json, default ~/.cache/attnreg) keyed
by device (backend, name, driver) and by a spec family (kernel family, dtype, head size,
GQA group, query-row and key-count buckets), so one measurement serves nearby specs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import cache
from .caps import DeviceCaps
from .spec import AttentionSpec


def cache_path() -> Path:
    return cache.root() / "tuning.json"


def device_key(caps: DeviceCaps) -> str:
    return f"{caps.backend}|{caps.name}|{caps.driver or caps.description}"


def _bucket(n: int) -> int:
    """Next power of two: specs within a factor of two share a measurement."""
    return 1 << max(0, (n - 1).bit_length())


def family_key(family: str, spec: AttentionSpec) -> str:
    rows = spec.seq_len if spec.seq_len <= 4 else _bucket(spec.seq_len)
    return (f"{family}|{spec.dtype}|h{spec.head_size}|g{spec.group_size}|s{rows}"
            f"|c{_bucket(spec.capacity)}|b{spec.batch * spec.kv_num_heads}")


def load(path: Path | None = None) -> dict[str, Any]:
    p = path or cache_path()
    try:
        data: dict[str, Any] = json.loads(p.read_text())
        return data
    except (OSError, json.JSONDecodeError):
        return {}


def lookup(caps: DeviceCaps, family: str, spec: AttentionSpec,
           path: Path | None = None) -> dict[str, Any] | None:
    entry: dict[str, Any] | None = load(path).get(device_key(caps), {}).get(family_key(family, spec))
    return entry


def store(caps: DeviceCaps, family: str, spec: AttentionSpec, entry: Mapping[str, Any],
          path: Path | None = None) -> Path:
    p = path or cache_path()
    data = load(p)
    data.setdefault(device_key(caps), {})[family_key(family, spec)] = dict(entry)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(p)                 # atomic: a crash never leaves half a cache
    return p
