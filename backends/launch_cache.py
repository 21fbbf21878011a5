"""The prepared-launch cache of the GPU runtimes (plan once, run many): what a launch binds
(kernel objects with their arguments set, bind groups, parameter blocks) is prepared once per
plan and set of bound buffers, and a later launch with the same plan and buffers reuses it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from attnreg.plan import Plan

V = TypeVar("V")

# Entries a runtime keeps, the least recently used dropped first. A decode step prepares one
# launch per layer (each binds that layer's own cache tensors): with fewer entries than a
# step's launches, each launch evicts the one the next step needs and nothing is ever reused.
# 64 keeps the step of a 64-layer model (or 32 layers with two plans each); an entry holds
# kernel objects or bind groups and a parameter block, and keeps the buffers it binds alive.
SIZE = 64


def buffers_key(buffers: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """Which buffer each name is bound to, by identity: an entry keeps its buffers alive, so
    their ids are not reused while it lives."""
    return tuple(sorted((name, id(buf)) for name, buf in buffers.items() if buf is not None))


class LaunchCache(Generic[V]):
    """Prepared launches by (plan, key). An entry holds its plan, so the plan's id, which the
    lookup uses, is not reused while the entry lives."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[int, Hashable], tuple[Plan, V]] = OrderedDict()

    def get(self, plan: Plan, key: Hashable) -> V | None:
        """The entry prepared for ``plan`` and ``key`` (now the most recently used), or None."""
        hit = self._entries.get((id(plan), key))
        if hit is None or hit[0] is not plan:
            return None
        self._entries.move_to_end((id(plan), key))
        return hit[1]

    def put(self, plan: Plan, key: Hashable, value: V) -> V:
        self._entries[(id(plan), key)] = (plan, value)
        self._entries.move_to_end((id(plan), key))
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def drop(self, holds: Callable[[V], bool]) -> None:
        """Forget the entries ``holds`` is true of (those binding a buffer that goes away)."""
        for k in [k for k, (_, v) in self._entries.items() if holds(v)]:
            del self._entries[k]

    def values(self) -> Iterator[V]:
        return (v for _, v in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
