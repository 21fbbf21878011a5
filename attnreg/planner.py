"""The planner of one request on one device: the route, a kernel per stage, their
parameters from the rules, the split geometry, and why every other kernel was not chosen.
The registry runs it device by device (registry.Registry.plan)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import flags as flagmod
from . import rules
from .caps import DeviceCaps
from .errors import SpecError
from .kernel import PARTIAL_ROUTES, ROUTES, SPLIT_FAMILIES, KernelInfo
from .plan import SplitGeometry, Stage
from .spec import AttentionSpec


class DevicePlanner:
    """Plans one request on one device; records rejections as it goes."""

    def __init__(self, rule_list: list[rules.Rule], kernels: list[KernelInfo],
                 spec: AttentionSpec, op: str, caps: DeviceCaps,
                 flags: Mapping[str, Any], forced: KernelInfo | None, params: dict[str, Any],
                 exclude: Mapping[tuple[str, str], str]) -> None:
        self.spec, self.op, self.caps, self.flags = spec, op, caps, flags
        self.forced, self.params, self.exclude = forced, params, exclude
        self.rules = rule_list
        self.kernels = kernels

    def run(self, rejected: dict[str, list[str]], tag: Any
            ) -> tuple[str, tuple[Stage, ...], tuple[str, ...], dict[str, str],
                       SplitGeometry | None] | None:
        fired: list[str] = []
        kernels = self.kernels
        routes, fallback = self._routes(fired)
        for n, (route, families) in enumerate(routes):
            stages: list[Stage] = []
            stage_fired: list[str] = []
            for pos, fam in enumerate(families):
                st = self._pick(fam, primary=pos == 0, prev=stages, rejected=rejected, tag=tag,
                                fired=stage_fired, kernels=kernels)
                if st is None:
                    break
                stages.append(st)
            for fam in families[len(stages) + 1:]:
                for k in kernels:
                    if k.family == fam:
                        rejected.setdefault(tag(k.id), [f"not tried: route {route} found no "
                                                        f"{families[len(stages)]} kernel"])
            if len(stages) == len(families):
                if n > 0 and fallback is not None:
                    fired.append(rules.describe(fallback, {"route": route}, f"route {routes[0][0]} "
                                                "found no kernel on this device"))
                for fam in {f for _, fs in routes for f in fs} - set(families):
                    for k in kernels:
                        if k.family == fam and tag(k.id) not in rejected:
                            rejected[tag(k.id)] = [f"route is {route}; {fam} kernels are not used"]
                return (route, tuple(stages), tuple(fired + stage_fired), self._ignored(),
                        self._split(stages))
        return None

    def _split(self, stages: list[Stage]) -> SplitGeometry | None:
        """The plan's split geometry: from its first split stage, or for a reduce of given
        partial states their count (the caller's n_splits)."""
        first = next((st for st in stages if "split_size" in st.params
                      and st.family in SPLIT_FAMILIES), None)
        if first is not None:
            return SplitGeometry(int(first.params["n_splits"]), int(first.params["split_size"]))
        if self.op == "reduce" and "n_splits" in self.params:
            return SplitGeometry(int(self.params["n_splits"]))
        return None

    def _routes(self, fired: list[str]
                ) -> tuple[list[tuple[str, tuple[str, ...]]], rules.Rule | None]:
        """The routes to try in order, as the rules choose them (the route, then the fallback
        rule's order), and that fallback rule, said in explain when a later route runs."""
        if self.op == "reduce":
            return [("reduce", ("reduce",))], None
        table = ROUTES if self.op == "attention" else PARTIAL_ROUTES
        ctx = rules.Ctx(self.spec, self.caps, self.flags, self.op, candidates=tuple(self.kernels),
                        forced=self.forced)
        fired += rules.apply(self.rules, ctx, "route", first_only=True)
        fired += rules.apply(self.rules, ctx, "route_refine")
        route = ctx.params.get("route", "prefill")
        if route not in table:
            raise SpecError("route", route, f"one of {sorted(table)} (set by a rule)")
        fallback = rules.fire(self.rules, ctx, "fallback", first_only=True)
        order = [route] + [r for r in ctx.params.get("fallback", ()) if r != route and r in table]
        return [(r, table[r]) for r in order], (fallback[0][0] if fallback else None)

    def _pick(self, family: str, *, primary: bool, prev: list[Stage],
              rejected: dict[str, list[str]], tag: Any, fired: list[str],
              kernels: list[KernelInfo]) -> Stage | None:
        cands = sorted((k for k in kernels if k.family == family), key=lambda k: (-k.priority, k.id))
        forced_here = self.forced is not None and self.forced.family == family
        if forced_here:
            cands = [k for k in cands if k.id == self.forced.id]  # type: ignore[union-attr]
        chosen: Stage | None = None
        chosen_fired: list[str] = []
        # Every candidate is judged, even after one fits, so explain can say why each
        # other kernel was not the one.
        for k in cands:
            typed = k.dtype_reasons(self.spec)
            if typed:
                # rules size tiles by dtype: a kernel of other dtypes is passed over first
                rejected[tag(k.id)] = typed
                continue
            user = dict(self.params) if primary else {}
            if prev and "split_size" in prev[0].params:       # later stages follow the first
                user.setdefault("split_size", prev[0].params["split_size"])
            ctx = rules.Ctx(self.spec, self.caps, self.flags, self.op, kernel=k,
                            params=dict(user), user=frozenset(user),
                            candidates=tuple(self.kernels))
            k_fired = rules.apply(self.rules, ctx, "params")
            if "split_size" in ctx.params:
                # The one place the split count is derived: T = ceil(C / split_size).
                ctx.params.update(SplitGeometry.over(self.spec.capacity,
                                                     int(ctx.params["split_size"])).params)
            reasons = k.not_supported_reasons(self.spec, self.caps, ctx.params)
            # A caller's parameter the kernel does not take would be silently dropped.
            reasons += [f"takes no parameter {n} (the caller set {n}={user[n]!r})"
                        for n in sorted(ctx.user) if primary and not k.takes(n)]
            if (self.caps.id, k.id) in self.exclude:
                reasons.append(self.exclude[(self.caps.id, k.id)])
            if not forced_here:
                reasons += self._selection_reasons(k, ctx)
            elif k.flag is not None and k.matrix is not None and not k.emulated(ctx.params) \
                    and not self.flags.get(k.flag):
                # the hardware build needs what the flag opens on the device (Dawn's
                # experimental features), forced or not
                reasons.append(f"its matrix units need flag {k.flag}=1 on this device")
            if reasons:
                rejected[tag(k.id)] = reasons
            elif chosen is None:
                rejected.pop(tag(k.id), None)
                chosen_fired = k_fired
                chosen = Stage(k.id, family, {**k.defaults, **ctx.params, **k.params})
            else:
                rejected[tag(k.id)] = [f"could run, but {chosen.kernel} ranks first "
                                       "(higher priority, then id order)"]
        fired += chosen_fired
        return chosen

    def _selection_reasons(self, k: KernelInfo, ctx: rules.Ctx) -> list[str]:
        why = []
        if k.vendor is not None and k.vendor != self.caps.vendor:
            why.append(f"tuned for {k.vendor} devices; this device's vendor is {self.caps.vendor}"
                       " (force the kernel to run it anyway)")
        if k.flag is not None and not self.flags.get(k.flag) and not k.emulated(ctx.params):
            why.append(f"opt-in: needs flag {k.flag}=1")
        why += rules.matrix_reasons(k, ctx.params, ctx.user, self.flags)
        for name, value in k.params.items():
            if name in ctx.params and ctx.params[name] != value:
                src = "the caller" if name in ctx.user else "the rules"
                why.append(f"{src} chose {name}={ctx.params[name]}; this variant has {name}={value}")
        return why

    def _ignored(self) -> dict[str, str]:
        out = {}
        for name, flag in flagmod.table().items():
            if flag.vendor and self.flags.get(name) != flag.default and flag.vendor != self.caps.vendor:
                out[name] = (f"applies to {flag.vendor} devices; this device's vendor is "
                             f"{self.caps.vendor}")
        return out
