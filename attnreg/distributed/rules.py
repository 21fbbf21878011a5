"""The policy of a sharded call, as named rules (each with a one-sentence why and the
ci/results/ file that measured it): where the states are merged, and how the ranks of a
process group exchange them. A ShardedKVCache takes "auto" (the first rule that holds) or a
setting the caller fixes; ``cache.last_merge`` (the last call's) and ``cache.gather_rule``
name what chose."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEASURED = ("ci/results/h100_context_parallel.txt",)
# Where a call's states are merged: "device" (one reduce on this process's device) or
# "host" (numpy).
MERGES = ("auto", "device", "host")
# How a group's ranks exchange the first round of states: one torch.distributed.all_gather,
# or each rank's isend to, and irecv from, every other rank.
GATHERS = ("auto", "all_gather", "point_to_point")
# The states (every shard's o and lse, float32) up to which numpy merges them.
HOST_MERGE_BYTES = 512 << 10
# The most ranks that exchange point to point (each sends and receives ranks - 1 messages),
# and the host's cores per rank they need (gloo's transport thread must wake at once).
POINT_TO_POINT_RANKS = 8
POINT_TO_POINT_CORES = 4


@dataclass(frozen=True)
class CallRule:
    """One rule: ``choice`` when ``when(facts)`` holds."""

    name: str
    why: str
    choice: str
    when: Callable[[dict[str, Any]], bool]
    measured: tuple[str, ...] = MEASURED


MERGE_RULES: tuple[CallRule, ...] = (
    CallRule("cp_merge_small_states_on_host",
             "states of a few rows merge faster in numpy than through a device's upload, "
             "reduce launch and read-back, whose fixed costs dominate there", "host",
             lambda f: f["state_bytes"] <= HOST_MERGE_BYTES),
    CallRule("cp_merge_large_states_on_device",
             "a long prefill's states merge faster in one reduce on the device than in "
             "numpy, whose passes over them grow with their size", "device", lambda f: True),
)

GATHER_RULES: tuple[CallRule, ...] = (
    CallRule("cp_gather_point_to_point_few_ranks",
             "a few ranks' isend and irecv go straight to gloo's transport, where all_gather "
             "first hands its ring to the process group's worker thread", "point_to_point",
             lambda f: f["ranks"] <= POINT_TO_POINT_RANKS
             and f["cores"] >= POINT_TO_POINT_CORES * f["ranks"]),
    CallRule("cp_gather_all_gather", "many ranks, or a host whose cores the ranks' devices "
             "keep busy (CPU devices): one all_gather, which waits for its transport less",
             "all_gather", lambda f: True),
)


def choose(rules: tuple[CallRule, ...], fixed: str, setting: str, **facts: Any
           ) -> tuple[str, str]:
    """(the choice, the rule or setting that made it): ``fixed`` unless it is "auto"."""
    if fixed != "auto":
        return fixed, f"{setting}={fixed!r}"
    rule = next(r for r in rules if r.when(facts))
    return rule.choice, rule.name


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                  # not Linux
        return os.cpu_count() or 1
