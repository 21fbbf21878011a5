"""The plugin manager, the kernel table, device probing and planning (explained dispatch):
devices are tried best first, each by the planner (planner.py), until one can run the spec."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pluggy

from . import env, headpad, hookspecs, plugin_tables, ports, rules
from . import flags as flagmod
from . import params as paramsmod
from .caps import DeviceCaps, unavailable
from .errors import NoKernelError, SpecError, clip
from .hookspecs import Backend, Command, Interop, Runtime
from .kernel import KernelInfo
from .plan import OPS, Plan
from .planner import DevicePlanner
from .spec import AttentionSpec

PLUGINS_ENV = "ATTNREG_PLUGINS"       # extra plugin modules, comma-separated
HOOKS = ("attnreg_register_flags", "attnreg_register_backends", "attnreg_register_kernels",
         "attnreg_register_rules", "attnreg_register_commands", "attnreg_register_interop")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class Registry:
    """Everything plugins registered, and the planner that chooses among it."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._lock = threading.RLock()
        self._loaded = False
        self._load_errors: dict[str, str] = {}     # plugin name -> why it failed to load
        self._interrupted: set[str] = set()        # plugins a KeyboardInterrupt stopped once
        self._broken: dict[str, str] = {}          # the above, and plugins whose hooks failed
        self._backends: dict[str, Backend] = {}
        self._kernels: dict[str, KernelInfo] = {}
        self._rules: list[rules.Rule] = []
        self._commands: dict[str, Command] = {}
        self._interop: dict[str, Interop] = {}
        self._devices: dict[str, list[DeviceCaps]] = {}

    # -- loading -----------------------------------------------------------------------
    def load(self) -> None:
        """Load entry-point plugins (and ATTNREG_PLUGINS modules) once. Atomic: an exception
        that escapes (a KeyboardInterrupt) leaves the registry unloaded, so the next call
        loads again; a plugin that raises anything else is reported broken with its reason
        (``attnreg devices`` lists it unavailable) and the others load."""
        with self._lock:
            if self._loaded:
                return
            for name, load in self._plugin_sources():
                if self.pm.has_plugin(name):
                    continue
                try:
                    plugin = load()
                    if not self.pm.is_registered(plugin):   # an entry point too: loaded once
                        self.pm.register(plugin, name=name)
                except KeyboardInterrupt:
                    # Ctrl-C mid-load: the next call retries; a module that raises it on
                    # import every time is broken the second time (reference keeps working).
                    if name not in self._interrupted:
                        self._interrupted.add(name)
                        raise
                    self._load_errors[name] = f"plugin {name} raised KeyboardInterrupt " \
                        "while loading, twice"
                except BaseException as exc:  # SystemExit too: a plugin never ends the caller
                    self._load_errors[name] = f"plugin {name} failed to load: {clip(repr(exc), 500)}"
            self._collect()
            self._loaded = True

    def _plugin_sources(self) -> list[tuple[str, Callable[[], object]]]:
        """(name, loader) of every entry point and ATTNREG_PLUGINS module. A malformed
        ATTNREG_PLUGINS is a broken entry whose reason is the SpecError naming it."""
        out: list[tuple[str, Callable[[], object]]] = [
            (ep.name, ep.load) for ep in
            importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)]
        try:
            names = env.items(PLUGINS_ENV)
        except SpecError as exc:
            self._load_errors[PLUGINS_ENV] = str(exc)
            return out
        for mod in names:
            if not _MODULE.fullmatch(mod):
                self._load_errors[clip(mod, 100)] = str(SpecError(
                    PLUGINS_ENV, env.text(PLUGINS_ENV), "comma-separated module names "
                    f"(pkg.module); not {mod!r}"))
                continue
            out.append((mod, functools.partial(importlib.import_module, mod)))
        return out

    def _collect(self) -> None:
        """The tables, from every registered plugin's hooks, called one plugin at a time: a
        plugin whose hook raises, or that registers what another registered differently,
        is left out and reported broken; the others' registrations stand."""
        calls = {hook: [(impl.plugin_name, impl.function) for impl in
                        reversed(getattr(self.pm.hook, hook).get_hookimpls())] for hook in HOOKS}
        staged, failed = plugin_tables.stage(calls)
        got = plugin_tables.merge(staged, failed)
        while got is None:                      # a conflict failed one more plugin: again
            got = plugin_tables.merge(staged, failed)
        flags, backends, kernels, extra_rules, commands, interop = got
        for f in flags.values():
            flagmod.declare(f)
        self._broken = {**self._load_errors, **failed}
        self._backends, self._kernels, self._commands = backends, kernels, commands
        self._interop = interop
        self._rules = list(rules.BUILTIN_RULES) + extra_rules
        self._devices = {n: d for n, d in self._devices.items() if n in backends}

    def register_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object or module at run time (same hooks as entry points); a
        plugin whose hooks raise or conflict is refused (SpecError with the reason), the
        registry unchanged."""
        with self._lock:
            self.load()
            got = self.pm.register(plugin, name=name)
            self._collect()
            if got is not None and got in self._broken:
                why = self._broken[got]
                self.pm.unregister(name=got)
                self._collect()
                raise SpecError("plugin", got, f"a plugin whose hooks register cleanly ({why})")

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

    def open(self, caps: DeviceCaps, flags: Mapping[str, Any]) -> Runtime:
        """A runtime for a probed device, given the Session's resolved flags (dawn:
        experimental_features picks the device)."""
        return self.backend(caps.backend).open(caps, dict(flags))

    def interop(self, backend: str) -> Interop | None:
        """How ``backend`` runs on its caller's device objects, or None where it does not."""
        self.load()
        return self._interop.get(backend)

    def adopt(self, backend: str | None, device: object, flags: Mapping[str, Any]) -> Runtime:
        """A runtime on a device object the caller opened (Session(device=<object>))."""
        if backend is None:
            raise SpecError("backend", backend, "a backend name, because device is a device "
                            f"object ({type(device).__name__}), not a device id")
        self.backend(backend)
        interop = self.interop(backend)
        if interop is None:
            raise SpecError("device", device, f"a device id, index or name: backend "
                            f"{backend!r} runs on no caller's device objects")
        return interop.adopt(device, flags, [d for d in self.devices(backend) if d.available])

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
        if kernel is not None and not isinstance(kernel, str):
            raise SpecError("kernel", kernel, "None or a registered kernel id (a str)")
        params = paramsmod.check(params, self.kernels())
        forced_k = None
        if kernel:
            forced_k = self.kernel(kernel)
        elif f.get("force_kernel"):
            if f["force_kernel"] not in {k.id for k in self.kernels()}:
                raise SpecError("flags['force_kernel']", f["force_kernel"],
                                f"a registered kernel id; known: {sorted(k.id for k in self.kernels())}")
            forced_k = self.kernel(f["force_kernel"])
        forced = forced_k.id if forced_k is not None else None
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
        rejected: dict[str, list[str]] = {}
        multi = {d.backend for d in devs if sum(x.backend == d.backend for x in devs) > 1}
        for i, dev in enumerate(devs):
            tag = _tagger(dev, multi)
            if not dev.available:
                for k in self.kernels(dev.backend):
                    rejected[tag(k.id)] = [f"device unavailable: {dev.reason}"]
                continue
            got = DevicePlanner(self.rules(), self.kernels(dev.backend), spec, op, dev, f,
                                forced_k, dict(params or {}), exclude or {}).run(rejected, tag)
            run_spec = spec
            if got is None:
                run_spec, got = self._plan_padded(spec, op, dev, f, forced_k, params, exclude,
                                                  rejected, tag)
            if got is not None:
                for later in devs[i + 1:]:
                    for k in self.kernels(later.backend):
                        rejected.setdefault(f"{k.id}@{later.id}" if later.backend in multi else k.id,
                                            [f"not considered: {dev.label} ranks before "
                                             f"{later.label}"])
                return Plan(spec=run_spec, op=op, route=got[0], caps=dev, stages=got[1],
                            rejected=rejected, rules=got[2], ignored_flags=got[3],
                            flags=flagmod.non_default(f), split=got[4],
                            request=spec if run_spec is not spec else None)
        nke = NoKernelError(spec, rejected, what=f"kernel for op {op!r}")
        too_big = _binding_error(spec, devs) if op != "reduce" else None
        if too_big is not None:
            raise too_big from nke
        raise nke

    def _plan_padded(self, spec: AttentionSpec, op: str, dev: DeviceCaps, f: Mapping[str, Any],
                     forced_k: KernelInfo | None, params: Mapping[str, Any] | None,
                     exclude: Mapping[tuple[str, str], str] | None,
                     rejected: dict[str, list[str]], tag: Any) -> tuple[AttentionSpec, Any]:
        """The plan of ``spec`` with its head sizes padded (rules.head_padding), when no
        kernel of the device's backend runs them as they are: (padded spec, planner result),
        or (spec, None). The rejections and rules shown are the padded plan's."""
        kernels = self.kernels(dev.backend)
        for h, hv in rules.head_padding(spec, kernels):
            try:
                padded = headpad.padded_spec(spec, h, hv)
            except SpecError:
                continue
            tried: dict[str, list[str]] = {}
            got = DevicePlanner(self.rules(), kernels, padded, op, dev, f, forced_k,
                                dict(params or {}), exclude or {}).run(tried, tag)
            if got is not None:
                why = (f"head_padding: no {dev.backend} kernel runs head sizes "
                       f"{spec.head_size}/{spec.head_size_v} (k/v) as they are -> "
                       f"{headpad.describe(spec, padded)}: q, k, v get zero columns (no dot "
                       "product or output column changes) and out is cut back")
                for k in kernels:
                    rejected.pop(tag(k.id), None)
                rejected.update(tried)
                return padded, (got[0], got[1], (why, *got[2]), got[3], got[4])
        return spec, None


def _binding_error(spec: AttentionSpec, devs: list[DeviceCaps]) -> SpecError | None:
    """When an input is larger than one storage binding on every available device (kernels
    bind q, k, v and the bias whole), the SpecError that names it, its size and the limit:
    the reason no kernel ran, said plainly instead of in every kernel's rejection."""
    found = []
    for dev in (d for d in devs if d.available):
        cap = dev.limit("storage_binding")
        big = [(n, p.nbytes(spec)) for n in ("q", "k", "v", "bias")
               if (p := ports.named(n)).exists(spec)]
        over = [(n, b) for n, b in big if cap is not None and b > cap]
        if not over:
            return None
        found.append((dev, cap, *over[0]))
    if not found:
        return None
    dev, cap, name, nbytes = found[0]
    return SpecError(f"tensors[{name!r}]", nbytes, f"at most {cap} bytes: {dev.label} binds "
                     f"{name} whole as one storage buffer and its storage_binding limit is {cap} "
                     f"bytes ({name} would take {nbytes}); a smaller capacity, batch or head "
                     "count, or another device")


def _tagger(dev: DeviceCaps, multi: set[str]) -> Any:
    """Rejection keys: the kernel id, qualified by device when a backend has several."""
    def tag(kernel_id: str) -> str:
        return f"{kernel_id}@{dev.id}" if dev.backend in multi else kernel_id
    return tag


def _is_resolved(flags: Mapping[str, Any]) -> bool:
    return set(flags) == set(flagmod.table())


_REGISTRY: Registry | None = None


def get() -> Registry:
    """The process-wide registry (plugins load on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY
