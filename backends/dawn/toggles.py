"""The Dawn toggles this backend sets, as data: name, stage, on or off, why, and what decides
it. Instance and adapter toggles are fixed once per process, before the first adapter
request (Dawn keeps one instance); device toggles apply to each device opened.

``ATTNREG_DAWN_TOGGLES`` edits the table for the process: ``+name`` enables a Dawn toggle,
``-name`` disables one, ``!name`` leaves one of ours unset (comma-separated; read once, at
the first probe). ``attnreg devices`` and ``explain`` show what is in force.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from attnreg import env
from attnreg.errors import SpecError

ENV = "ATTNREG_DAWN_TOGGLES"
CHECKS_ENV = "ATTNREG_WGSL_CHECKS"          # the webgpu backend's naga switch, shared


@dataclass(frozen=True)
class Toggle:
    name: str
    stage: str                  # instance | adapter | device (where Dawn takes it)
    enable: bool                # True: enabled, False: disabled
    why: str
    source: str = "always"      # what decides it, for the reader
    when: Callable[[], bool] = field(default=lambda: True, compare=False)

    def line(self) -> str:
        return (f"dawn toggle {self.name}={'on' if self.enable else 'off'} ({self.stage}; "
                f"{self.source}): {self.why}")


CHECKS = ("all", "bounds", "none")          # the values of ATTNREG_WGSL_CHECKS
_NAME = re.compile(r"[a-z0-9_]{1,100}")     # how Dawn spells a toggle


def checks_mode() -> str:
    """ATTNREG_WGSL_CHECKS: all, bounds (the default) or none."""
    return env.choice(CHECKS_ENV, "bounds", CHECKS)


def _checks_off() -> bool:
    return checks_mode() == "none"


TOGGLES: tuple[Toggle, ...] = (
    Toggle("allow_unsafe_apis", "instance", True,
           "Dawn offers experimental features (chromium-experimental-subgroup-matrix) only "
           "with it; attnreg asks a device for one only in a Session with "
           "experimental_features=true"),
    Toggle("vulkan_enable_f16_on_nvidia", "adapter", True,
           "Dawn hides shader-f16 on NVIDIA's Vulkan driver unless asked, and the float16 "
           "kernels need it"),
    Toggle("timestamp_quantization", "device", False,
           "Dawn rounds GPU timestamps (a browser's fingerprinting defence); bench and tune "
           "need them exact"),
    Toggle("disable_workgroup_init", "device", True,
           "every kernel writes its workgroup variables before reading them (the conformance "
           "matrix runs with it); Dawn's zeroing of them at each workgroup's start cost the "
           "H100 decode 11% (f16 L=8192: 36.8 -> 32.7 us)"),
    Toggle("disable_robustness", "device", True,
           "Tint's bounds clamping off, as naga's checks are off on the webgpu backend with "
           "the same variable (the kernels' indices are in bounds by construction)",
           source=f"{CHECKS_ENV}=none", when=_checks_off),
)


def edits() -> dict[str, str]:
    """{name: '+' | '-' | '!'} from ATTNREG_DAWN_TOGGLES; a SpecError naming it when an
    item is not +name, -name or !name."""
    out: dict[str, str] = {}
    for item in env.items(ENV):
        if item[0] not in "+-!" or not _NAME.fullmatch(item[1:]):
            raise SpecError(ENV, env.text(ENV), "comma-separated +name, -name or !name items "
                            f"(Dawn toggle names: lower case, digits, _); not {item!r}")
        out[item[1:]] = item[0]
    return out


def in_force(known: Mapping[str, str] | None = None) -> list[Toggle]:
    """The toggles to set now: the table's (where they apply) edited by ATTNREG_DAWN_TOGGLES.
    ``known`` maps Dawn's toggle names to their stage (extras.all_toggles()); an edit naming
    a toggle Dawn does not have is a SpecError naming ATTNREG_DAWN_TOGGLES."""
    wanted = edits()
    out = []
    for t in TOGGLES:
        op = wanted.pop(t.name, None)
        if op is None and t.when():
            out.append(t)
        elif op in ("+", "-"):        # the table's why stands only if the sense does
            same = (op == "+") == t.enable
            out.append(dataclasses.replace(t, enable=op == "+", source=ENV,
                                           why=t.why if same else "asked for in the environment"))
    for name, op in wanted.items():
        if op == "!":
            continue
        if known is not None and name not in known:
            raise SpecError(ENV, env.text(ENV), f"toggles Dawn has; it has no {name!r}")
        stage = known[name] if known is not None else "device"
        out.append(Toggle(name, stage, op == "+", "asked for in the environment", source=ENV))
    return out
