"""The prepared-launch cache the GPU runtimes share (backends/launch_cache.py): past its size
the least recently used entry goes, an entry answers only for its own plan, and the entries
binding a buffer that goes away are forgotten. (The runtimes' use of it: the resident tests
of each backend count prepares and hits.)"""

from __future__ import annotations

import attnreg
from attnreg.backends.launch_cache import SIZE, LaunchCache, buffers_key


def _plans(n: int) -> list[attnreg.Plan]:
    return [attnreg.explain(attnreg.AttentionSpec(seq_len=1, past_len=i, num_heads=2,
                                                  kv_num_heads=1, head_size=16),
                            backend="reference") for i in range(n)]


def test_least_recently_used_goes_first() -> None:
    plans = _plans(SIZE + 1)
    cache: LaunchCache[int] = LaunchCache()
    for i, plan in enumerate(plans[:SIZE]):
        assert cache.put(plan, "k", i) == i
    assert cache.get(plans[0], "k") == 0          # now the most recently used
    cache.put(plans[SIZE], "k", SIZE)
    assert len(cache) == SIZE
    assert cache.get(plans[1], "k") is None       # the least recently used went
    assert cache.get(plans[0], "k") == 0 and cache.get(plans[SIZE], "k") == SIZE


def test_an_entry_answers_only_for_its_plan_and_key() -> None:
    a, b = _plans(2)
    cache: LaunchCache[str] = LaunchCache()
    cache.put(a, ("bias", 1), "a")
    assert cache.get(b, ("bias", 1)) is None
    assert cache.get(a, ("bias", 2)) is None
    assert cache.get(a, ("bias", 1)) == "a"


def test_entries_binding_a_freed_buffer_are_forgotten() -> None:
    a, b = _plans(2)
    kept, freed = bytearray(4), bytearray(4)
    cache: LaunchCache[tuple[bytearray, ...]] = LaunchCache()
    cache.put(a, 1, (kept, freed))
    cache.put(b, 1, (kept,))
    cache.drop(lambda bound: any(x is freed for x in bound))
    assert cache.get(a, 1) is None and cache.get(b, 1) == (kept,)
    cache.clear()
    assert len(cache) == 0 and not list(cache.values())


def test_buffers_key_is_by_name_and_identity() -> None:
    x, y = bytearray(4), bytearray(4)
    assert buffers_key({"q": x, "k": y}) == buffers_key({"k": y, "q": x, "bias": None})
    assert buffers_key({"q": x, "k": y}) != buffers_key({"q": y, "k": x})
    assert buffers_key({"q": x}) != buffers_key({"q": bytearray(4)})
