"""The tuning cache: parameters measured fastest per device, which the rule ``tuning_cache``
reads (flag ``use_tuning_cache``) and `attnreg tune` (attnreg.tools.tune) writes.

The cache is a JSON file ($ATTNREG_CACHE_DIR/tuning.json, default ~/.cache/attnreg) keyed
by device (backend, name, driver) and by a spec family (kernel family, dtype, head size,
GQA group, query-row and key-count buckets), so one measurement serves nearby specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter

from . import cache
from .caps import DeviceCaps
from .spec import AttentionSpec

FILE = "tuning.json"
_Text = Annotated[str, Field(max_length=2000)]


class Entry(BaseModel):
    """One measurement: the kernel, the parameters measured fastest (checked again, like a
    caller's ``params``, where the rule uses them) and the times."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    kernel: Annotated[str, Field(max_length=200)]
    params: dict[Annotated[str, Field(max_length=100)], StrictBool | StrictInt | StrictStr]
    us: float = Field(ge=0)
    rule_default_us: float = Field(ge=0)
    basis: _Text = ""
    measured: _Text = ""
    spec: _Text = ""


SCHEMA: TypeAdapter[dict[str, dict[str, Entry]]] = TypeAdapter(dict[str, dict[str, Entry]])


def cache_path() -> Path:
    return cache.root() / FILE


def device_key(caps: DeviceCaps) -> str:
    return f"{caps.backend}|{caps.name}|{caps.driver or caps.description}"


def _bucket(n: int) -> int:
    """Next power of two: specs within a factor of two share a measurement."""
    return 1 << max(0, (n - 1).bit_length())


def family_key(family: str, spec: AttentionSpec) -> str:
    rows = spec.seq_len if spec.seq_len <= 4 else _bucket(spec.seq_len)
    return (f"{family}|{spec.dtype}|h{spec.head_size}|g{spec.group_size}|s{rows}"
            f"|c{_bucket(spec.capacity)}|b{spec.batch * spec.kv_num_heads}")


def load() -> dict[str, dict[str, Entry]]:
    """The tuning cache ({} when absent, or ignored with a CacheWarning)."""
    got: dict[str, dict[str, Entry]] | None = cache.read_json(FILE, SCHEMA)
    return got or {}


def lookup(caps: DeviceCaps, family: str, spec: AttentionSpec) -> Entry | None:
    return load().get(device_key(caps), {}).get(family_key(family, spec))


def store(caps: DeviceCaps, family: str, spec: AttentionSpec, entry: Mapping[str, Any]) -> Path:
    """Add one measurement (validated) to the tuning cache; returns the file's path."""
    data = load()
    new = Entry.model_validate(dict(entry))
    data.setdefault(device_key(caps), {})[family_key(family, spec)] = new
    return cache.write_json(FILE, SCHEMA, data)
