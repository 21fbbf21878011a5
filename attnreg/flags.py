"""The declared table of session flags: opt-ins and overrides, each with a type and a doc."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import env
from .errors import SpecError, short

ENV_VAR = "ATTNREG_FLAGS"


@dataclass(frozen=True)
class Flag:
    name: str
    type: type
    default: Any
    doc: str
    vendor: str | None = None          # applies only on devices of this vendor
    choices: tuple[Any, ...] | None = None


_TABLE: dict[str, Flag] = {}


def declare(flag: Flag) -> Flag:
    """Add a flag to the table (built-ins here; plugins through attnreg_register_flags)."""
    old = _TABLE.get(flag.name)
    if old is not None and old != flag:
        raise SpecError("flag", flag.name, "a flag name not already declared differently")
    _TABLE[flag.name] = flag
    return flag


for _f in (
    Flag("apple_tuned_flash", bool, False,
         "Use the Apple-tuned max_k_step in flash prefill. Opt-in; ignored on non-Apple devices.",
         vendor="apple"),
    Flag("route", str, "auto", "Force the route: 'prefill' (one pass), 'split_kv' "
         "(decode_partial + reduce) or 'split_kv_unfused' (decode_qk + decode_pv + reduce); "
         "'auto' lets the rules decide.",
         choices=("auto", "prefill", "split_kv", "split_kv_unfused", "split_kv_fused")),
    Flag("force_kernel", str, "", "Run exactly this kernel id (conformance, debugging); "
         "an error lists why if it cannot run the spec."),
    Flag("split_size", int, 0, "Keys per split-KV split; 0 lets the rules choose."),
    Flag("max_splits", int, 64, "Upper bound on split-KV splits per (batch, head, row)."),
    Flag("m_tile", int, 0, "Query rows per decode workgroup (1, 2 or 4); 0 lets the rules choose."),
    Flag("block_skip", str, "auto", "Masked-block skipping for a bias: 'on' iterates only over "
         "KV blocks the bias leaves visible, 'off' never, 'auto' where the rules measured it "
         "faster.", choices=("auto", "on", "off")),
    Flag("matrix_units", str, "auto", "Matrix-unit kernels (tensor cores, subgroup "
         "matrices): 'auto' runs them where a rule measured them faster, 'on' wherever the "
         "device has the primitive, 'off' never, 'emulate' builds them with a software "
         "polyfill of the primitive (same tile contract) on any device, for testing.",
         choices=("auto", "on", "off", "emulate")),
    Flag("use_tuning_cache", bool, False, "Let measured values from `attnreg tune` override "
         "rule defaults on this device."),
):
    declare(_f)


def table() -> dict[str, Flag]:
    return dict(_TABLE)


def _convert(name: str, value: Any, flag: Flag) -> Any:
    if isinstance(value, str) and flag.type is not str:
        text = value.strip().lower()
        if flag.type is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return flag.type(text)
            except ValueError:
                pass
        raise SpecError(f"flags[{name!r}]", value, f"a {flag.type.__name__} ({flag.doc})")
    ok = isinstance(value, flag.type) and not (flag.type is int and isinstance(value, bool))
    if flag.type is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value, ok = float(value), True
        except OverflowError:                     # an int past float's range
            ok = False
    if not ok:
        raise SpecError(f"flags[{name!r}]", value, f"a {flag.type.__name__} ({flag.doc})")
    if flag.choices is not None and value not in flag.choices:
        raise SpecError(f"flags[{name!r}]", value, f"one of {list(flag.choices)}")
    if flag.type is int and not 0 <= value <= 2**31 - 1:
        raise SpecError(f"flags[{name!r}]", value, "an integer in [0, 2**31-1]")
    return value


def parse_env(text: str | None) -> dict[str, str]:
    """'a=1,b=x' -> {'a': '1', 'b': 'x'}; malformed items are errors, not ignored."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise SpecError(ENV_VAR, text, "comma-separated name=value pairs")
        name, value = item.split("=", 1)
        out[name.strip()] = value.strip()
    return out


def resolve(*layers: Mapping[str, Any] | None, use_env: bool = True) -> dict[str, Any]:
    """Defaults < ATTNREG_FLAGS < each layer in order. Unknown names are SpecErrors."""
    merged: dict[str, Any] = {n: f.default for n, f in _TABLE.items()}
    if use_env:
        raw = env.text(ENV_VAR)
        try:
            _merge(merged, parse_env(raw))
        except SpecError as exc:                 # name the variable the flag came from
            if exc.field == ENV_VAR:
                raise
            raise SpecError(ENV_VAR, raw, exc.expected, detail=f"({exc.field})") from None
    for layer in layers:
        if layer:
            _merge(merged, layer)
    return merged


def _merge(merged: dict[str, Any], layer: Any) -> None:
    if not isinstance(layer, Mapping):
        raise SpecError("flags", layer, "a mapping of flag name -> value")
    for name, value in layer.items():
        if name not in _TABLE:
            raise SpecError(f"flags[{short(name)}]", value,
                            f"a known flag; known flags: {sorted(_TABLE)}")
        merged[name] = _convert(name, value, _TABLE[name])


def non_default(flags: Mapping[str, Any]) -> dict[str, Any]:
    return {n: v for n, v in flags.items() if n in _TABLE and v != _TABLE[n].default}
