"""The plugin manager, the kernel table, device probing and planning (explained dispatch)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from . import flags as flagmod
from . import hookspecs, rules
from .caps import DeviceCaps, unavailable
from .errors import NoKernelError, SpecError
from .hookspecs import Backend, Command
from .kernel import ROUTES, SPLIT_FAMILIES, KernelInfo
from .plan import OPS, Plan, SplitGeometry, Stage
from .spec import AttentionSpec

PLUGINS_ENV = "ATTNREG_PLUGINS"       # extra plugin modules, comma-separated


class Registry:
    """Everything plugins registered, and the planner that chooses among it."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._lock = threading.RLock()
        self._loaded = False
        self._broken: dict[str, str] = {}          # plugin name -> why it failed to load
        self._backends: dict[str, Backend] = {}
        self._kernels: dict[str, KernelInfo] = {}
        self._rules: list[rules.Rule] = []
        self._commands: dict[str, Command] = {}
        self._devices: dict[str, list[DeviceCaps]] = {}

    # -- loading -----------------------------------------------------------------------
    def load(self) -> None:
        """Load entry-point plugins (and ATTNREG_PLUGINS modules) once."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
                if self.pm.has_plugin(ep.name):
                    continue
                try:
                    self.pm.register(ep.load(), name=ep.name)
                except Exception as exc:  # a broken plugin must not break the others
                    self._broken[ep.name] = f"plugin {ep.value} failed to load: {exc!r}"
            for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
                if self.pm.has_plugin(mod):
                    continue
                try:
                    self.pm.register(importlib.import_module(mod), name=mod)
                except Exception as exc:
                    self._broken[mod] = f"plugin module {mod} failed to load: {exc!r}"
            self._collect()

    def _collect(self) -> None:
        backends: dict[str, Backend] = {}
        kernels: dict[str, KernelInfo] = {}
        extra_rules: list[rules.Rule] = []
        commands: dict[str, Command] = {}

        def add_backend(b: Backend) -> None:
            if not isinstance(b, Backend):
                raise TypeError(f"{b!r} does not implement attnreg.Backend (name, priority, "
                                "probe, open)")
            backends[b.name] = b

        def add_kernel(k: KernelInfo) -> None:
            if k.id in kernels and kernels[k.id] != k:
                raise ValueError(f"kernel id {k.id!r} registered twice with different data")
            kernels[k.id] = k

        self.pm.hook.attnreg_register_flags(register=flagmod.declare)
        self.pm.hook.attnreg_register_backends(register=add_backend)
        self.pm.hook.attnreg_register_kernels(register=add_kernel)
        def add_command(c: Command) -> None:
            if c.name in commands and commands[c.name] != c:
                raise ValueError(f"command {c.name!r} registered twice")
            commands[c.name] = c

        self.pm.hook.attnreg_register_rules(register=extra_rules.append)
        self.pm.hook.attnreg_register_commands(register=add_command)
        self._backends, self._kernels, self._commands = backends, kernels, commands
        self._rules = list(rules.BUILTIN_RULES) + extra_rules
        self._devices = {n: d for n, d in self._devices.items() if n in backends}

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object or module at run time (same hooks as entry points)."""
        with self._lock:
            self.load()
            self.pm.register(plugin, name=name)
            self._collect()

    def unregister_plugin(self, plugin: object | None = None, name: str | None = None) -> None:
        with self._lock:
            self.pm.unregister(plugin, name=name)
            self._collect()

    # -- tables ------------------------------------------------------------------------
    def backends(self) -> dict[str, Backend]:
        self.load()
        return dict(self._backends)

    def broken_plugins(self) -> dict[str, str]:
        self.load()
        return dict(self._broken)

    def kernels(self, backend: str | None = None, family: str | None = None) -> list[KernelInfo]:
        self.load()
        return [k for k in self._kernels.values()
                if (backend is None or k.backend == backend) and (family is None or k.family == family)]

    def kernel(self, kernel_id: str) -> KernelInfo:
        self.load()
        if kernel_id not in self._kernels:
            raise SpecError("kernel", kernel_id, f"a registered kernel id; known: {sorted(self._kernels)}")
        return self._kernels[kernel_id]

    def rules(self) -> list[rules.Rule]:
        self.load()
        return list(self._rules)

    def commands(self) -> dict[str, Command]:
        """CLI subcommands that plugins registered (attnreg_register_commands)."""
        self.load()
        return dict(self._commands)

    def backend(self, name: str) -> Backend:
        backends = self.backends()
        if name not in backends:
            raise SpecError("backend", name, f"one of the installed backends {sorted(backends)}"
                            + (f" (failed to load: {self._broken})" if self._broken else ""))
        return backends[name]

    # -- devices -----------------------------------------------------------------------
    def devices(self, backend: str | None = None, refresh: bool = False) -> list[DeviceCaps]:
        """Probed devices (cached per process), best first; unavailable ones included."""
        self.load()
        names = [backend] if backend else sorted(self._backends)
        out: list[DeviceCaps] = []
        for name in names:
            b = self.backend(name)
            with self._lock:
                if refresh or name not in self._devices:
                    try:
                        found = list(b.probe())
                    except Exception as exc:  # probe contract says never raise; be safe anyway
                        found = [unavailable(name, f"probe raised {exc!r}")]
                    self._devices[name] = found or [unavailable(name, "probe found no device")]
            out += self._devices[name]
        if backend is None:
            out += [unavailable(n, why) for n, why in sorted(self._broken.items())]
        prio = {n: b.priority for n, b in self._backends.items()}
        return sorted(out, key=lambda c: rules.device_order(c, prio.get(c.backend, -1000)))

    def find_device(self, backend: str | None, device: str | int | None) -> list[DeviceCaps]:
        """Devices matching a backend and a device selector (index, id, or name substring)."""
        devs = self.devices(backend)
        if device is None:
            return devs
        if isinstance(device, int):
            if not 0 <= device < len(devs):
                raise SpecError("device", device, f"an index below {len(devs)}")
            return [devs[device]]
        hits = [d for d in devs if device in (d.id, d.name) or str(device).lower() in d.name.lower()]
        if not hits:
            raise SpecError("device", device, "a device id or part of a name; probed: "
                            + ", ".join(f"{d.id} ({d.name})" for d in devs))
        return hits

    # -- planning ----------------------------------------------------------------------
    def plan(self, spec: AttentionSpec, *, op: str = "attention", backend: str | None = None,
             device: str | int | None = None, caps: DeviceCaps | Iterable[DeviceCaps] | None = None,
             flags: Mapping[str, Any] | None = None, kernel: str | None = None,
             params: Mapping[str, Any] | None = None,
             exclude: Mapping[tuple[str, str], str] | None = None) -> Plan:
        """Choose backend, device, kernels and params for ``spec``; runs nothing.

        ``caps`` plans for given device capabilities (profiles) instead of probing.
        ``exclude`` maps (device id, kernel id) to a reason, for kernels that failed to
        compile there; they are rejected with that reason.
        """
        if not isinstance(spec, AttentionSpec):
            raise SpecError("spec", spec, "an attnreg.AttentionSpec")
        if op not in OPS:
            raise SpecError("op", op, f"one of {OPS}")
        f = flagmod.resolve(flags) if flags is None or not _is_resolved(flags) else dict(flags)
        forced = kernel or f.get("force_kernel") or None
        forced_k = self.kernel(forced) if forced else None
        if forced_k is not None:
            if backend is not None and backend != forced_k.backend:
                raise SpecError("kernel", forced, f"a kernel of the selected backend {backend!r}")
            backend = forced_k.backend
        if caps is not None:
            devs = [caps] if isinstance(caps, DeviceCaps) else list(caps)
            if backend is not None:
                devs = [d for d in devs if d.backend == backend]
        else:
            if backend is not None:
                self.backend(backend)
            devs = self.find_device(backend, device)
        if params is not None and not isinstance(params, Mapping):
            raise SpecError("params", params, "a mapping of parameter name -> value")
        rejected: dict[str, list[str]] = {}
        multi = {d.backend for d in devs if sum(x.backend == d.backend for x in devs) > 1}
        for i, dev in enumerate(devs):
            tag = _tagger(dev, multi)
            if not dev.available:
                for k in self.kernels(dev.backend):
                    rejected[tag(k.id)] = [f"device unavailable: {dev.reason}"]
                continue
            got = _Planner(self, spec, op, dev, f, forced_k, dict(params or {}),
                           exclude or {}).run(rejected, tag)
            if got is not None:
                for later in devs[i + 1:]:
                    for k in self.kernels(later.backend):
                        rejected.setdefault(f"{k.id}@{later.id}" if later.backend in multi else k.id,
                                            [f"not considered: {dev.label} ranks before "
                                             f"{later.label}"])
                return Plan(spec=spec, op=op, route=got[0], caps=dev, stages=got[1],
                            rejected=rejected, rules=got[2], ignored_flags=got[3],
                            flags=flagmod.non_default(f), split=got[4])
        raise NoKernelError(spec, rejected, what=f"kernel for op {op!r}")


def _tagger(dev: DeviceCaps, multi: set[str]) -> Any:
    """Rejection keys: the kernel id, qualified by device when a backend has several."""
    def tag(kernel_id: str) -> str:
        return f"{kernel_id}@{dev.id}" if dev.backend in multi else kernel_id
    return tag


def _is_resolved(flags: Mapping[str, Any]) -> bool:
    return set(flags) == set(flagmod.table())


class _Planner:
    """Plans one request on one device; records rejections as it goes."""

    def __init__(self, reg: Registry, spec: AttentionSpec, op: str, caps: DeviceCaps,
                 flags: Mapping[str, Any], forced: KernelInfo | None, params: dict[str, Any],
                 exclude: Mapping[tuple[str, str], str]) -> None:
        self.reg, self.spec, self.op, self.caps, self.flags = reg, spec, op, caps, flags
        self.forced, self.params, self.exclude = forced, params, exclude
        self.rules = reg.rules()
        self.kernels = reg.kernels(caps.backend)

    def run(self, rejected: dict[str, list[str]], tag: Any
            ) -> tuple[str, tuple[Stage, ...], tuple[str, ...], dict[str, str],
                       SplitGeometry | None] | None:
        fired: list[str] = []
        kernels = self.kernels
        routes = self._routes(fired)
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
                if n > 0:
                    fired.append(f"fallback_route: no kernel for route {routes[0][0]} on this "
                                 f"device -> route={route}")
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

    def _routes(self, fired: list[str]) -> list[tuple[str, tuple[str, ...]]]:
        if self.op == "reduce":
            return [("reduce", ("reduce",))]
        fam = self.forced.family if self.forced is not None else None
        if self.op == "partial":
            # Partial states come from the fused kernel or the unfused pair.
            if fam in ("decode_qk", "decode_pv"):
                return [("partial_unfused", ROUTES["split_kv_unfused"][:2])]
            return [("partial", ("decode_partial",)),
                    ("partial_unfused", ROUTES["split_kv_unfused"][:2])]
        if self.forced is not None:
            route = {"prefill": "prefill", "decode_qk": "split_kv_unfused",
                     "decode_pv": "split_kv_unfused",
                     "decode_fused": "split_kv_fused"}.get(str(fam), "split_kv")
            fired.append(f"forced_kernel: {self.forced.id} was requested -> route={route}")
            return [(route, ROUTES[route])]
        ctx = rules.Ctx(self.spec, self.caps, self.flags, self.op, candidates=tuple(self.kernels))
        fired += rules.apply(self.rules, ctx, "route", first_only=True)
        fired += rules.apply(self.rules, ctx, "route_refine")
        route = ctx.params.get("route", "prefill")
        if route not in ROUTES:
            raise SpecError("route", route, f"one of {sorted(ROUTES)} (set by a rule)")
        order = [route] + [r for r in ("split_kv", "prefill", "split_kv_unfused", "split_kv_fused")
                           if r != route]
        if self.flags.get("route", "auto") != "auto":
            order = [route]
        return [(r, ROUTES[r]) for r in order]

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
            if (self.caps.id, k.id) in self.exclude:
                reasons.append(self.exclude[(self.caps.id, k.id)])
            if not forced_here:
                reasons += self._selection_reasons(k, ctx)
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
        if k.flag is not None and not self.flags.get(k.flag):
            why.append(f"opt-in: needs flag {k.flag}=1")
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


_REGISTRY: Registry | None = None


def get() -> Registry:
    """The process-wide registry (plugins load on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY
