"""`attnreg tune`: measure the tunable parameters of the kernel the rules pick and store the
fastest in the tuning cache (attnreg.tuned), where the rule ``tuning_cache`` finds them."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..session import Session
from ..spec import AttentionSpec
from ..tensors import check_tensors
from ..testing import make_tensors
from ..tuned import store
from .bench import time_case, time_plan


def candidates(kernel_defaults: Mapping[str, Any], choices: Mapping[str, tuple[Any, ...]],
               spec: AttentionSpec, family: str, limit: int = 48) -> list[dict[str, Any]]:
    """Parameter sets to measure: declared choices, plus split sizes for split-KV kernels
    (whole kv tiles, for 1 to 128 splits; the planner derives each one's split count)."""
    axes: dict[str, tuple[Any, ...]] = dict(choices)
    if family in ("decode_partial", "decode_fused"):   # the split-KV kernels
        tile = int(kernel_defaults.get("kv_tile", 64))
        sizes = sorted({max(tile, -(-spec.capacity // n // tile) * tile)
                        for n in (1, 2, 4, 8, 16, 32, 64, 128)})
        axes["split_size"] = tuple(sizes)
    names = sorted(axes)
    combos = [dict(zip(names, vals)) for vals in itertools.product(*(axes[n] for n in names))]
    return combos[:limit]


def tune(session: Session, spec: AttentionSpec, *, iters: int = 20, warmup: int = 3,
         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every candidate parameter set for the kernel the rules pick; store the best."""
    plan = session.plan(spec)
    k = session.registry.kernel(plan.kernel)
    inputs = check_tensors(spec, make_tensors(spec, seed=0, poison=False))
    base_t, _ = time_case(session, spec, inputs, iters, warmup)
    basis = "gpu_s" if base_t.get("gpu_s") else "wall_s"
    baseline = statistics.median(base_t[basis]) * 1e6
    log(f"baseline {plan.kernel} {dict(plan.params)}: {baseline:.1f} us")
    best = (baseline, dict(plan.params))
    for cand in candidates(k.defaults, k.choices, spec, k.family):
        params = dict(cand)
        try:
            # Re-plan with these params so every stage (the reduce's split count too) agrees.
            with Session(backend=plan.backend, device=plan.caps.id) as s2:
                p2 = s2.plan(spec, kernel=k.id, params=params)
                times = time_plan(s2, p2, inputs, iters, warmup)
        except Exception as exc:       # a candidate that cannot run is simply not a winner
            log(f"  {params}: skipped ({exc})")
            continue
        us = statistics.median(times[basis]) * 1e6
        log(f"  {params}: {us:.1f} us")
        if us < best[0]:
            best = (us, params)
    entry = {"kernel": k.id, "params": best[1], "us": round(best[0], 2),
             "rule_default_us": round(baseline, 2), "basis": basis,
             "measured": time.strftime("%Y-%m-%d"), "spec": repr(spec)}
    store(plan.caps, k.family, spec, entry)
    return entry
