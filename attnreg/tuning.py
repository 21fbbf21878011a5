"""Measured parameters per device: `attnreg tune` writes them, the rules read them
(flag ``use_tuning_cache``), and explain says when a tuned value was used.

The cache is a JSON file ($ATTNREG_CACHE_DIR/tuning.json, default ~/.cache/attnreg) keyed
by device (backend, name, driver) and by a spec family (kernel family, dtype, head size,
GQA group, query-row and key-count buckets), so one measurement serves nearby specs.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .caps import DeviceCaps
from .spec import AttentionSpec


def cache_path() -> Path:
    root = os.environ.get("ATTNREG_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "attnreg")
    return Path(root) / "tuning.json"


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


def candidates(kernel_defaults: Mapping[str, Any], choices: Mapping[str, tuple[Any, ...]],
               spec: AttentionSpec, family: str, limit: int = 48) -> list[dict[str, Any]]:
    """Parameter sets to measure: declared choices, plus split sizes for split-KV kernels."""
    axes: dict[str, tuple[Any, ...]] = dict(choices)
    if family in ("decode_partial", "decode_fused"):   # the split-KV kernels
        tile = int(kernel_defaults.get("kv_tile", 64))
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)
        sizes = sorted({max(tile, cdiv(cdiv(spec.capacity, n), tile) * tile)
                        for n in (1, 2, 4, 8, 16, 32, 64, 128)})
        axes["split_size"] = tuple(sizes)
    names = sorted(axes)
    combos = [dict(zip(names, vals)) for vals in itertools.product(*(axes[n] for n in names))]
    return combos[:limit]


def tune(session: Any, spec: AttentionSpec, *, iters: int = 20, warmup: int = 3,
         log: Callable[[str], None] = print, path: Path | None = None) -> dict[str, Any]:
    """Measure every candidate parameter set for the kernel the rules pick; store the best."""
    from .bench import time_case
    from .tensors import check_tensors
    from .testing import make_tensors

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
        if "split_size" in params:
            params["n_splits"] = -(-spec.capacity // params["split_size"])
        try:
            # Re-plan with these params so every stage (the reduce's n_splits too) agrees.
            s2 = type(session)(backend=plan.backend, device=plan.caps.id)
            with s2:
                p2 = s2.plan(spec, kernel=k.id, params=params)
                times, _ = _time_plan(s2, p2, inputs, iters, warmup)
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
    store(plan.caps, k.family, spec, entry, path)
    return entry


def _time_plan(session: Any, plan: Any, inputs: Any, iters: int, warmup: int
               ) -> tuple[dict[str, list[float]], str]:
    rt = session.runtime(plan)
    rt.launch(plan, inputs)
    timer = getattr(rt, "timings", None)
    if timer is not None:
        return timer(plan, inputs, iters=iters, warmup=warmup), plan.kernel
    wall = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rt.launch(plan, inputs)
        wall.append(time.perf_counter() - t0)
    return {"wall_s": wall}, plan.kernel
