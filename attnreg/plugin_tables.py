"""What the plugins register, gathered into the registry's tables: each plugin's hooks called
into lists of their own (stage), then merged in pluggy's order (merge), a plugin whose hook
raises or whose registration is wrong or conflicts with an earlier one left out with why."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import flags as flagmod
from . import rules
from .errors import clip
from .hookspecs import Backend, Command, Interop
from .kernel import KernelInfo

Staged = dict[str, list[tuple[str, list[Any]]]]     # hook -> [(plugin, what it registered)]
Tables = tuple[dict[str, flagmod.Flag], dict[str, Backend], dict[str, KernelInfo],
               list[rules.Rule], dict[str, Command], dict[str, Interop]]


def stage(calls: Mapping[str, list[tuple[str, Callable[..., Any]]]]
           ) -> tuple[Staged, dict[str, str]]:
    """Call every plugin's hooks, each into a list of its own; {plugin: why} for those whose
    hook raised."""
    staged: Staged = {hook: [] for hook in calls}
    failed: dict[str, str] = {}
    for hook, impls in calls.items():
        for name, fn in impls:
            items: list[Any] = []
            try:
                fn(register=items.append)
            except Exception as exc:
                failed.setdefault(name, f"plugin {name}: {hook} raised {clip(repr(exc), 500)}")
            staged[hook].append((name, items))
    return staged, failed


def merge(staged: Staged, failed: dict[str, str]) -> Tables | None:
    """The tables from the plugins not failed, in pluggy's call order; None after failing
    the plugin whose registration is wrong or conflicts with an earlier one (its reason in
    ``failed``)."""
    flags: dict[str, flagmod.Flag] = {}
    backends: dict[str, Backend] = {}
    kernels: dict[str, KernelInfo] = {}
    extra_rules: list[rules.Rule] = []
    commands: dict[str, Command] = {}
    interop: dict[str, Interop] = {}
    for hook, calls in staged.items():
        for name, items in calls:
            if name in failed:
                continue
            for item in items:
                why = _add(hook, item, flags, backends, kernels, extra_rules, commands, interop)
                if why:
                    failed[name] = f"plugin {name}: {why}"
                    return None
    return flags, backends, kernels, extra_rules, commands, interop


def _add(hook: str, item: Any, flags: dict[str, flagmod.Flag], backends: dict[str, Backend],
         kernels: dict[str, KernelInfo], extra_rules: list[rules.Rule],
         commands: dict[str, Command], interop: dict[str, Interop]) -> str | None:
    """Add one registration to its table; why it cannot be, or None."""
    if hook == "attnreg_register_flags":
        old = flags.get(item.name) if isinstance(item, flagmod.Flag) else None
        old = old or (flagmod.table().get(item.name) if isinstance(item, flagmod.Flag) else None)
        if not isinstance(item, flagmod.Flag) or (old is not None and old != item):
            return f"registered flag {clip(repr(item), 200)}: not a Flag, or one declared " \
                "differently before"
        flags[item.name] = item
    elif hook == "attnreg_register_backends":
        if not isinstance(item, Backend):
            return f"{clip(repr(item), 200)} does not implement attnreg.Backend (name, " \
                "priority, probe, open)"
        backends[item.name] = item
    elif hook == "attnreg_register_rules":
        if not isinstance(item, rules.Rule):
            return f"registered rule {clip(repr(item), 200)} is not an attnreg.Rule"
        extra_rules.append(item)
    else:
        # the keyed tables: (table, the type registered, the attribute that keys it)
        keyed: dict[str, tuple[dict[str, Any], type, str]] = {
            "attnreg_register_kernels": (kernels, KernelInfo, "id"),
            "attnreg_register_commands": (commands, Command, "name"),
            "attnreg_register_interop": (interop, Interop, "backend")}
        table, kind, attr = keyed[hook]
        key = getattr(item, attr, None)
        if not isinstance(item, kind) or (key in table and table[key] != item):
            return f"registered {kind.__name__} {clip(repr(key), 200)} twice with different " \
                "data, or not one"
        table[str(key)] = item
    return None
