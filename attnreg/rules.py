"""Routing rules as data: each has a name, a condition, the params it sets, a one-sentence
why and the ci/results/ files that measured it.

Route rules (stage "route") pick the route of op "attention" or "partial"; the first that
matches wins. Route-refining rules (stage "route_refine") may then change it, unless the
caller fixed the route (Ctx.route_fixed). Fallback rules (stage "fallback", first match) set
the routes tried, in order, when the chosen one finds no kernel on a device. Param rules
(stage "params") run in order for each candidate kernel and may each set parameters; a later
rule sees what earlier ones set. Plugins append rules through the ``attnreg_register_rules``
hook.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .caps import DeviceCaps
from .errors import CacheWarning, SpecError
from .kernel import KernelInfo
from .params import check as check_params
from .spec import AttentionSpec
from .tuned import cache_path, lookup

# Devices tried in this order: GPUs first, then by backend priority; reference last.
DEVICE_TYPE_ORDER = {"gpu": 0, "other": 1, "cpu": 2}

# The route a forced kernel runs on, by op and the kernel's family. A family not listed for
# an op (op "partial": every family but the unfused pair) leaves the route to the other rules.
FORCED_ROUTES: Mapping[str, Mapping[str, str]] = {
    "attention": {"prefill": "prefill", "decode_partial": "split_kv", "reduce": "split_kv",
                  "decode_qk": "split_kv_unfused", "decode_pv": "split_kv_unfused",
                  "decode_fused": "split_kv_fused"},
    "partial": {"decode_qk": "partial_unfused", "decode_pv": "partial_unfused"},
}
# The routes tried, in this order, after the chosen one finds no kernel on a device.
FALLBACK_ORDER: Mapping[str, tuple[str, ...]] = {
    "attention": ("split_kv", "prefill", "split_kv_unfused", "split_kv_fused"),
    "partial": ("partial", "partial_unfused"),
}


@dataclass
class Ctx:
    """What a rule may look at."""

    spec: AttentionSpec
    caps: DeviceCaps
    flags: Mapping[str, Any]
    op: str
    kernel: KernelInfo | None = None
    params: dict[str, Any] = field(default_factory=dict)
    user: frozenset[str] = frozenset()        # params the caller fixed; rules leave them
    fixed: frozenset[str] = frozenset()       # params a rule fixed (Rule.fixes); so do later ones
    candidates: tuple[KernelInfo, ...] = ()   # every kernel of the device's backend
    forced: KernelInfo | None = None          # the kernel the caller forced, if any

    @property
    def forced_route(self) -> str | None:
        """The route the forced kernel's family runs on for this op (None: no such route)."""
        if self.forced is None:
            return None
        return FORCED_ROUTES.get(self.op, {}).get(self.forced.family)

    @property
    def route_fixed(self) -> bool:
        """Whether the caller fixed the route: by a forced kernel with a route of its own, or
        (op "attention") by the flag ``route``. Such a route is not refined, and no other
        route is tried in its place."""
        return self.forced_route is not None or (
            self.op == "attention" and self.flags.get("route", "auto") != "auto")


@dataclass(frozen=True)
class Rule:
    """One rule. ``why`` is one sentence; ``measured`` names the files under ci/results/
    whose measurements the rule rests on (empty for a rule that rests on none, such as a
    caller's flag or a device limit)."""

    name: str
    why: str
    stage: Literal["route", "route_refine", "fallback", "params"]
    when: Callable[[Ctx], bool]
    sets: Callable[[Ctx], dict[str, Any]]
    measured: tuple[str, ...] = ()
    # What it sets stands as a caller's params do: later rules leave it (the tuning cache's
    # measured parameters, which a plugin's rules, run after the built-in ones, would
    # otherwise override).
    fixes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.measured, str):            # one file, given as a plain string
            object.__setattr__(self, "measured", (self.measured,))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def has_subgroups(caps: DeviceCaps) -> bool:
    return "subgroups" in caps.features


def _family(ctx: Ctx, *families: str) -> bool:
    return ctx.kernel is not None and ctx.kernel.family in families


def _tunable(ctx: Ctx, name: str) -> bool:
    """A rule may set ``name`` unless the caller fixed it or the kernel has no such knob."""
    k = ctx.kernel
    return (k is not None and name not in ctx.user
            and (name in k.defaults or name in k.params))


def _m_tile(ctx: Ctx) -> dict[str, Any]:
    assert ctx.kernel is not None
    want = int(ctx.flags.get("m_tile") or 0)
    m = want or (4 if ctx.spec.seq_len >= 4 else 2 if ctx.spec.seq_len >= 2 else 1)
    if not want and ctx.kernel.matrix is not None:
        # a matrix unit's M dimension is 16 rows: up to 16 query rows share one K/V read
        m = min(16, 1 << max(0, ctx.spec.seq_len - 1).bit_length())
    limit = ctx.caps.limit("workgroup_storage")
    def need(m: int) -> int:
        assert ctx.kernel is not None
        return ctx.kernel.storage_need(ctx.spec, {**ctx.params, "m_tile": m})
    # halved only while that saves storage (a matrix kernel's tiles do not grow with m_tile)
    while m > 1 and limit is not None and need(m) > limit and need(m // 2) < need(m):
        m //= 2
    return {"m_tile": m}


# Keys per inner step held in private memory (max_k_step) must fit this budget.
PRIVATE_BYTES = 16 * 1024


def default_max_k_step(spec: AttentionSpec, budget: int = PRIVATE_BYTES // 2) -> int:
    """Largest of 64/32/16/8 keys whose K rows (at this head size and dtype) fit ``budget``.

    The default budget is half of the 16 KiB private memory, leaving the rest for the query
    row and the accumulators; the Apple-tuned path spends all of it."""
    for step in (64, 32, 16, 8):
        if step * spec.head_size * spec.itemsize <= budget:
            return step
    return 8


def split_size(spec: AttentionSpec, caps: DeviceCaps, params: Mapping[str, Any],
               flags: Mapping[str, Any], min_tiles: int = 4) -> dict[str, int]:
    """split_size: enough splits to give every compute unit work, at most max_splits (the
    planner derives the split count from it).

    Splits are laid over the capacity C (the plan never sees seqlens_k values), rounded to
    the kernel's kv tile so a split is whole tiles, and hold at least ``min_tiles`` tiles
    (a backend's rule may measure fewer worth their reduce).
    """
    tile = int(params.get("kv_tile", 64))
    c = spec.capacity
    forced = int(flags.get("split_size") or 0)
    if forced:
        size = forced
    else:
        units = caps.compute_units or 8
        # A GPU wants several workgroups per compute unit; a CPU one per core is enough.
        target = units * (1 if caps.device_type == "cpu" else 4)
        rows = _cdiv(spec.seq_len, int(params.get("m_tile", 1)))
        groups = spec.batch * spec.kv_num_heads * rows
        want = max(1, min(int(flags.get("max_splits") or 64), _cdiv(target, groups)))
        size = max(tile, _cdiv(_cdiv(c, want), tile) * tile)
        # Each split should hold at least a few tiles, or the reduce costs more than it saves.
        size = max(size, min(_cdiv(c, tile) * tile, min_tiles * tile))
    return {"split_size": size}


# Where the numbers of rules whose own outputs were not kept are written down.
RULE_NUMBERS = "ci/results/rule_measurements.md"

_SPLIT_FAMILIES = ("decode_partial", "decode_qk", "decode_fused")

_CORE_RULES: tuple[Rule, ...] = (
    Rule("forced_kernel", "a forced kernel runs on the route of its family", "route",
         lambda c: c.forced_route is not None, lambda c: {"route": c.forced_route}),
    Rule("partial_states", "partial states come from decode_partial, the one-kernel split-KV "
         "stage", "route", lambda c: c.op == "partial", lambda c: {"route": "partial"}),
    Rule("route_flag", "the session flag `route` forces the route", "route",
         lambda c: c.flags.get("route", "auto") != "auto",
         lambda c: {"route": c.flags["route"]}),
    Rule("split_kv_few_rows", "with at most 4 query rows, splitting the keys (flash decoding) "
         "rather than the rows gives the device its parallelism", "route",
         lambda c: c.spec.seq_len <= 4, lambda c: {"route": "split_kv"}),
    Rule("split_kv_long_context", "a short query block (under 32 rows) over a long cache (over "
         "1000 keys) is bandwidth-bound, and split-KV spreads the cache over workgroups", "route",
         lambda c: c.spec.seq_len < 32 and c.spec.total_len > 1000,
         lambda c: {"route": "split_kv"}),
    Rule("split_kv_no_subgroups", "the fast prefill needs subgroups, which the device lacks, "
         "while split-KV with m_tile rows runs well without them", "route",
         lambda c: not has_subgroups(c.caps), lambda c: {"route": "split_kv"}),
    Rule("prefill_default", "enough query rows to fill the device: one-pass flash prefill",
         "route", lambda c: True, lambda c: {"route": "prefill"}),
    Rule("m_tile_by_seq_len", "query rows sharing one K/V read, 4/2/1 by seq_len (a matrix "
         "kernel's M dimension: up to 16), halved until the workgroup storage fits", "params",
         lambda c: _family(c, *_SPLIT_FAMILIES) and _tunable(c, "m_tile"), _m_tile),
    Rule("split_size_fill_device", "enough splits to give every compute unit work, capped by "
         "max_splits, whole kv tiles per split", "params",
         lambda c: _family(c, *_SPLIT_FAMILIES) and "split_size" not in c.user,
         lambda c: split_size(c.spec, c.caps, {**(c.kernel.defaults if c.kernel else {}),
                                               **c.params}, c.flags),
         measured=("ci/results/h100_split_sweep.txt",)),
)

FALLBACK_RULES: tuple[Rule, ...] = (
    Rule("fallback_none_for_fixed_route", "a route the caller fixed (flag route, or a forced "
         "kernel's) is the only one tried", "fallback",
         lambda c: c.route_fixed, lambda c: {"fallback": ()}),
    Rule("fallback_other_routes", "when the chosen route finds no kernel on the device, the "
         "others are tried in a fixed order (split-KV, prefill, unfused, fused, and for "
         "partial states the unfused pair)", "fallback",
         lambda c: c.op in FALLBACK_ORDER, lambda c: {"fallback": FALLBACK_ORDER[c.op]}),
)


VENDOR_RULES: tuple[Rule, ...] = (
    Rule("max_k_step_fits_private", "keys per inner step sized so their K rows take at most "
         "half of 16 KiB of private memory at this head size and dtype (the rest holds the "
         "query row and accumulators)", "params",
         lambda c: _family(c, "prefill") and _tunable(c, "max_k_step"),
         lambda c: {"max_k_step": default_max_k_step(c.spec)}),
    Rule("apple_tuned_max_k_step", "opt-in (flag apple_tuned_flash) on Apple GPUs: K rows may "
         "fill the whole 16 KiB, which Apple's large register file holds without spilling",
         "params", lambda c: _family(c, "prefill") and _tunable(c, "max_k_step")
         and bool(c.flags.get("apple_tuned_flash")) and c.caps.vendor == "apple",
         lambda c: {"max_k_step": default_max_k_step(c.spec, PRIVATE_BYTES)}),
    Rule("nvidia_kv_in_workgroup_memory", "NVIDIA: stage K/V tiles in workgroup (shared) memory, "
         "read once per workgroup instead of once per subgroup", "params",
         lambda c: _family(c, "prefill") and _tunable(c, "kv_staging") and c.caps.vendor == "nvidia",
         lambda c: {"kv_staging": "workgroup"}),
    Rule("qualcomm_half_out_tile", "Qualcomm Adreno: keep half of the output tile in workgroup "
         "memory to relieve register pressure", "params",
         lambda c: _family(c, "prefill") and _tunable(c, "out_tile") and c.caps.vendor == "qualcomm",
         lambda c: {"out_tile": "half_workgroup"}),
    Rule("cpu_small_tiles", "CPU adapters (lavapipe, PoCL): small query tiles keep a workgroup's "
         "working set in cache, and many workgroups feed every core", "params",
         lambda c: c.caps.device_type == "cpu" and _tunable(c, "q_tile")
         and _family(c, "prefill") and c.kernel is not None and c.kernel.matrix is None,
         lambda c: {"q_tile": 4}),
)


# -- matrix units --------------------------------------------------------------------------
def _matrix(ctx: Ctx) -> bool:
    return ctx.kernel is not None and ctx.kernel.matrix is not None and "mma" not in ctx.user


MATRIX_RULES: tuple[Rule, ...] = (
    Rule("matrix_units_emulate", "flag matrix_units=emulate: matrix-unit variants are built "
         "with the software polyfill of their primitive (same tiles, masking, softmax) and "
         "run, slowly, on devices without matrix units", "params",
         lambda c: _matrix(c) and c.flags.get("matrix_units") == "emulate",
         lambda c: {"mma": "emulate"}),
    Rule("matrix_units_on", "flag matrix_units=on: matrix-unit variants run wherever the "
         "device has their primitive", "params",
         lambda c: _matrix(c) and c.flags.get("matrix_units") == "on",
         lambda c: {"mma": "hardware"}),
)


def matrix_reasons(kernel: KernelInfo, params: Mapping[str, Any], user: frozenset[str],
                   flags: Mapping[str, Any]) -> list[str]:
    """Why automatic selection passes over a matrix-unit kernel (empty: it may be chosen).
    Under 'auto' a backend rule must have set ``mma`` (where it measured the matrix variant
    faster); the caller may also set it."""
    if kernel.matrix is None:
        return []
    mode = flags.get("matrix_units", "auto")
    if mode == "off" and "mma" not in user:
        return ["matrix_units=off: matrix-unit variants are not used"]
    if "mma" not in params:
        return ["matrix_units=auto: no rule measured this matrix-unit variant faster for this "
                "spec on this device (flag matrix_units=on runs it where the device can)"]
    return []


def _tuned(ctx: Ctx) -> dict[str, Any]:
    """The stored parameters of this kernel, through the checks of a caller's ``params``: a
    value no kernel may take (kv_tile 0, split_size -5) is ignored with a CacheWarning."""
    assert ctx.kernel is not None
    entry = lookup(ctx.caps, ctx.kernel.family, ctx.spec)
    if entry is None or entry.kernel != ctx.kernel.id:
        return {}
    try:
        params = check_params(entry.params, ctx.candidates)
    except SpecError as exc:
        warnings.warn(f"attnreg ignores the tuning cache's entry for {ctx.kernel.id} in "
                      f"{cache_path()}: {exc}", CacheWarning, stacklevel=2)
        return {}
    return {k: v for k, v in params.items() if k not in ctx.kernel.params}


def _fused_available(ctx: Ctx) -> bool:
    return any(k.family == "decode_fused" and k.backend == ctx.caps.backend
               and not k.not_supported_reasons(ctx.spec, ctx.caps) for k in ctx.candidates)


ROUTE_REFINE_RULES: tuple[Rule, ...] = (
    Rule("split_kv_fused_when_available", "split-KV in one launch (the last workgroup of a row "
         "merges the splits) saves the reduce's launch and the barrier before it",
         "route_refine", lambda c: c.params.get("route") == "split_kv"
         and c.flags.get("route", "auto") == "auto" and _fused_available(c),
         lambda c: {"route": "split_kv_fused"}, measured=(RULE_NUMBERS,)),
)

TUNING_RULES: tuple[Rule, ...] = (
    Rule("tuning_cache", "flag use_tuning_cache: parameters measured fastest on this device by "
         "`attnreg tune` replace the rule defaults", "params",
         lambda c: c.kernel is not None and bool(c.flags.get("use_tuning_cache")), _tuned,
         fixes=True),
)

BUILTIN_RULES: tuple[Rule, ...] = (_CORE_RULES + ROUTE_REFINE_RULES + FALLBACK_RULES
                                   + MATRIX_RULES + VENDOR_RULES + TUNING_RULES)


def describe(rule: Rule, changes: Mapping[str, Any], note: str = "") -> str:
    """A fired rule as explain shows it: "name: why (measured in) -> what it set [note]"."""
    sets = ", ".join(f"{k}={v}" for k, v in changes.items())
    return (f"{rule.name}: {rule.why}"
            + (f" (measured: {', '.join(rule.measured)})" if rule.measured else "")
            + (f" -> {sets}" if sets else "") + (f" ({note})" if note else ""))


def fire(rules: list[Rule], ctx: Ctx, stage: str, *, first_only: bool = False
         ) -> list[tuple[Rule, dict[str, Any]]]:
    """Run the rules of one stage on ctx (updating ctx.params); return those that fired, each
    with what it set. A route the caller fixed is not refined."""
    if stage == "route_refine" and ctx.route_fixed:
        return []
    fired: list[tuple[Rule, dict[str, Any]]] = []
    for rule in rules:
        if rule.stage != stage or not rule.when(ctx):
            continue
        changes = {k: v for k, v in rule.sets(ctx).items()
                   if k not in ctx.user and k not in ctx.fixed}
        if rule.stage != "route" and not changes:
            continue
        ctx.params.update(changes)
        if rule.fixes:
            ctx.fixed = ctx.fixed | frozenset(changes)
        fired.append((rule, changes))
        if first_only:
            break
    return fired


def apply(rules: list[Rule], ctx: Ctx, stage: str, *, first_only: bool = False) -> list[str]:
    """Run the rules of one stage on ctx (updating ctx.params); return what fired, as text."""
    return [describe(r, ch) for r, ch in fire(rules, ctx, stage, first_only=first_only)]


def device_order(caps: DeviceCaps, priority: int) -> tuple[int, int, int, str]:
    return (0 if caps.available else 1, DEVICE_TYPE_ORDER.get(caps.device_type, 1), -priority,
            caps.id)


def head_padding(spec: AttentionSpec, kernels: tuple[KernelInfo, ...] | list[KernelInfo]
                 ) -> list[tuple[int, int]]:
    """The (head_size, v_head_size) pairs to try, nearest first, when no kernel of a backend
    runs ``spec`` at its own head sizes: each size rounded up to the next one some kernel
    declares (attnreg/headpad.py pads q, k, v with zero columns, which changes no result).
    int4 K/V never pad: their head sizes are whole q4_0 blocks of 32, which every kernel's
    step divides."""
    if spec.kv_dtype == "int4":
        return []

    def sizes(h: int, v: bool) -> set[int]:
        out = {h}
        for k in kernels:
            lo, hi, step = (k.v_head_sizes or k.head_sizes) if v else k.head_sizes
            up = max(lo, -(-h // step) * step)
            if up <= hi:
                out.add(up)
        return out

    h, hv = spec.head_size, spec.head_size_v
    pairs = [(a, b) for a in sizes(h, False) for b in sizes(hv, True) if (a, b) != (h, hv)]
    return sorted(pairs, key=lambda p: (p[0] - h + p[1] - hv, p))
