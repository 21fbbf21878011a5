"""Routing rules as data: each has a name, a condition, the params it sets and a one-line why.

Route rules (stage "route") pick prefill vs split-KV for op "attention"; the first that
matches wins. Param rules (stage "params") run in order for each candidate kernel and may
each set parameters; a later rule sees what earlier ones set. Plugins append rules through
the ``attnreg_register_rules`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .caps import DeviceCaps
from .kernel import KernelInfo
from .spec import AttentionSpec
from .tuned import lookup

# Devices tried in this order: GPUs first, then by backend priority; reference last.
DEVICE_TYPE_ORDER = {"gpu": 0, "other": 1, "cpu": 2}


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
    candidates: tuple[KernelInfo, ...] = ()   # every kernel of the device's backend


@dataclass(frozen=True)
class Rule:
    name: str
    why: str
    stage: Literal["route", "route_refine", "params"]
    when: Callable[[Ctx], bool]
    sets: Callable[[Ctx], dict[str, Any]]


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
               flags: Mapping[str, Any]) -> dict[str, int]:
    """split_size: enough splits to give every compute unit work, at most max_splits (the
    planner derives the split count from it).

    Splits are laid over the capacity C (the plan never sees seqlens_k values), rounded to
    the kernel's kv tile so a split is whole tiles.
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
        size = max(size, min(_cdiv(c, tile) * tile, 4 * tile))
    return {"split_size": size}


_CORE_RULES: tuple[Rule, ...] = (
    Rule("route_flag", "the session flag `route` forces the route", "route",
         lambda c: c.flags.get("route", "auto") != "auto",
         lambda c: {"route": c.flags["route"]}),
    Rule("split_kv_few_rows", "seq_len <= 4: too few query rows to fill a device; "
         "splitting the keys (flash decoding) gives the parallelism", "route",
         lambda c: c.spec.seq_len <= 4, lambda c: {"route": "split_kv"}),
    Rule("split_kv_long_context", "seq_len < 32 and total_len > 1000: short query block over "
         "a long cache is bandwidth-bound; split-KV spreads the cache over workgroups", "route",
         lambda c: c.spec.seq_len < 32 and c.spec.total_len > 1000,
         lambda c: {"route": "split_kv"}),
    Rule("split_kv_no_subgroups", "the device has no subgroups, which the fast prefill "
         "variant needs; split-KV with m_tile rows runs well without them", "route",
         lambda c: not has_subgroups(c.caps), lambda c: {"route": "split_kv"}),
    Rule("prefill_default", "enough query rows to fill the device: one-pass flash prefill",
         "route", lambda c: True, lambda c: {"route": "prefill"}),
    Rule("m_tile_by_seq_len", "m_tile 4/2/1 by seq_len (rows sharing one K/V read; matrix "
         "kernels up to 16, the rows of their M dimension), halved "
         "until the workgroup storage fits", "params",
         lambda c: _family(c, "decode_partial", "decode_qk", "decode_fused") and _tunable(c, "m_tile"),
         _m_tile),
    Rule("split_size_fill_device", "enough splits to give every compute unit work, capped by "
         "max_splits, whole kv tiles per split", "params",
         lambda c: _family(c, "decode_partial", "decode_qk", "decode_fused")
         and "split_size" not in c.user,
         lambda c: split_size(c.spec, c.caps, {**(c.kernel.defaults if c.kernel else {}),
                                               **c.params}, c.flags)),
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
         "working set in cache; many workgroups feed every core", "params",
         lambda c: c.caps.device_type == "cpu" and _tunable(c, "q_tile")
         and _family(c, "prefill") and c.kernel is not None and c.kernel.matrix is None,
         lambda c: {"q_tile": 4}),
)


# -- matrix units --------------------------------------------------------------------------
def _matrix(ctx: Ctx) -> bool:
    return ctx.kernel is not None and ctx.kernel.matrix is not None and "mma" not in ctx.user


MATRIX_RULES: tuple[Rule, ...] = (
    Rule("matrix_units_emulate", "flag matrix_units=emulate: matrix-unit variants are built "
         "with the software polyfill of their primitive (same tiles, masking, softmax), so "
         "they run, slowly, on devices without matrix units", "params",
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
    assert ctx.kernel is not None
    entry = lookup(ctx.caps, ctx.kernel.family, ctx.spec)
    if not entry or entry.get("kernel") != ctx.kernel.id:
        return {}
    return {k: v for k, v in entry["params"].items() if k not in ctx.kernel.params}


def _fused_available(ctx: Ctx) -> bool:
    return any(k.family == "decode_fused" and k.backend == ctx.caps.backend
               and not k.not_supported_reasons(ctx.spec, ctx.caps) for k in ctx.candidates)


ROUTE_REFINE_RULES: tuple[Rule, ...] = (
    Rule("split_kv_fused_when_available", "split-KV in one launch (the last workgroup of a row "
         "merges the splits) saves the reduce launch and the barrier between the two, 5-8 us "
         "per decode on the H100 (measured: WebGPU reduce + gap ~5 us, NVIDIA OpenCL 5-8 us)",
         "route_refine", lambda c: c.params.get("route") == "split_kv"
         and c.flags.get("route", "auto") == "auto" and _fused_available(c),
         lambda c: {"route": "split_kv_fused"}),
)

TUNING_RULES: tuple[Rule, ...] = (
    Rule("tuning_cache", "flag use_tuning_cache: parameters measured fastest on this device by "
         "`attnreg tune` replace the rule defaults", "params",
         lambda c: c.kernel is not None and bool(c.flags.get("use_tuning_cache")), _tuned),
)

BUILTIN_RULES: tuple[Rule, ...] = (_CORE_RULES + ROUTE_REFINE_RULES + MATRIX_RULES + VENDOR_RULES
                                   + TUNING_RULES)


def apply(rules: list[Rule], ctx: Ctx, stage: str, *, first_only: bool = False) -> list[str]:
    """Run the rules of one stage on ctx (updating ctx.params); return what fired."""
    fired: list[str] = []
    for rule in rules:
        if rule.stage != stage or not rule.when(ctx):
            continue
        changes = {k: v for k, v in rule.sets(ctx).items() if k not in ctx.user}
        if rule.stage != "route" and not changes:
            continue
        ctx.params.update(changes)
        sets = ", ".join(f"{k}={v}" for k, v in changes.items())
        fired.append(f"{rule.name}: {rule.why}" + (f" -> {sets}" if sets else ""))
        if first_only:
            break
    return fired


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
