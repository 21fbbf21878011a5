"""KernelInfo: a kernel variant declared as plain data, and why it cannot run a spec."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import ports
from .caps import DeviceCaps
from .spec import AttentionSpec

# Contract tolerances (docs/contract.md "Tolerances"): dtype -> (atol, rtol); lse atol per dtype.
TOLERANCE: Mapping[str, tuple[float, float]] = MappingProxyType(
    {"float32": (2e-5, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (1.6e-2, 1.6e-2)})
LSE_ATOL: Mapping[str, float] = MappingProxyType(
    {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2})

FAMILIES = ("prefill", "decode_partial", "reduce", "decode_qk", "decode_pv", "decode_fused")
# Families of the split-KV routes, in launch order.
ROUTES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "prefill": ("prefill",),
    "split_kv": ("decode_partial", "reduce"),
    "split_kv_unfused": ("decode_qk", "decode_pv", "reduce"),
    # split-KV in one launch: the last workgroup of each row merges the splits
    "split_kv_fused": ("decode_fused",),
})
# Routes of op "partial" (partial states, no reduce): the split-KV routes without their reduce.
PARTIAL_ROUTES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "partial": ROUTES["split_kv"][:1],
    "partial_unfused": ROUTES["split_kv_unfused"][:2],
})
# Families that cut the KV range into splits (the plan's SplitGeometry comes from them).
SPLIT_FAMILIES = ("decode_partial", "decode_qk", "decode_fused")
# Contract features a kernel implements unless it says otherwise.
CORE_FEATURES = frozenset({"causal", "bias", "seqlens_k", "head_sink", "return_lse", "softcap",
                           "local_window", "alibi", "kv_capacity", "gqa"})
# The shapes real models need (docs/contract.md "Shapes real models need"): a kernel lists them in
# ``supports`` once it implements them, so one that does not is passed over with the reason.
MODEL_FEATURES = frozenset({"v_head_size", "kv_start", "seqlens_q"})
# Two-sided windows (docs/contract.md "Every head size, two-sided windows"): listed in
# ``supports`` by the kernels that bound keys on the right too, so a plugin's kernel written
# before them is passed over with the reason rather than silently ignoring the bound. (Reported
# only without causal masking, where it can change the result: AttentionSpec.features.)
WINDOW_FEATURES = frozenset({"right_window"})
# Every contract feature a spec can use (AttentionSpec.features names them).
ALL_FEATURES = CORE_FEATURES | MODEL_FEATURES | WINDOW_FEATURES
_EMPTY: Mapping[str, Any] = MappingProxyType({})
# How a matrix-unit kernel's products are built (its param "mma"): on the device's matrix
# units, or through a software polyfill of the same primitive and tile contract (flag
# matrix_units=emulate) so the kernel's indexing, masking and softmax run on any device.
MMA_BUILDS = ("hardware", "emulate")


@dataclass(frozen=True)
class MatrixUnit:
    """The matrix primitive a kernel multiplies with: C[m, n] += A[m, k] B[k, n], A and B of
    type ``a``, C of ``acc``, through ``api``: "subgroup_matrix" (WGSL's
    chromium_experimental_subgroup_matrix) or "ptx_mma" (inline PTX mma.sync)."""

    api: str
    m: int
    n: int
    k: int
    a: str = "f16"
    acc: str = "f32"

    def text(self) -> str:
        return f"{self.api} {self.a} {self.m}x{self.n}x{self.k}->{self.acc}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def binding_bytes(family: str, spec: AttentionSpec, params: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of each buffer a kernel of this family binds for ``spec`` (ports.py), for
    storage-binding limits; those not sized by the spec (the parameter block, block lists,
    tickets) are small."""
    splits = int(params.get("n_splits", 1))   # the planner sets it with split_size
    return {p.name: p.nbytes(spec, splits) for p in ports.bound(family, spec, params)
            if p.shape is not None}


@dataclass(frozen=True)
class KernelInfo:
    """One kernel variant, as data. Backends declare these; the registry plans with them.

    ``params`` are fixed by the variant (``m_tile=4`` for ``...m4``); ``defaults`` are the
    tunables the rules may override. ``vendor`` and ``flag`` only restrict *automatic*
    choice: a forced kernel runs on any device whose capabilities fit, so that vendor
    paths are testable on CI devices.
    """

    id: str
    backend: str
    family: str
    dtypes: frozenset[str]
    head_sizes: tuple[int, int, int] = (1, 1 << 30, 1)          # (min, max, multiple_of)
    # v's head size (v_head_size, Hv: v, out and the partial states), declared apart from q
    # and k's: None takes head_sizes (MLA decode runs q/k 576 with v 512).
    v_head_sizes: tuple[int, int, int] | None = None
    features: frozenset[str] = frozenset()                      # device features required
    supports: frozenset[str] = CORE_FEATURES                    # contract features implemented
    q_layouts: frozenset[str] = frozenset({"BSNH", "BNSH"})
    kv_layouts: frozenset[str] = frozenset({"BSNH", "BNSH"})
    kv_dtypes: frozenset[str] = frozenset()                     # quantized K/V it reads
    params: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    defaults: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=lambda: _EMPTY)  # tunable values
    # Values a rule or a user may set that `attnreg tune` does not sweep (forms that pay on
    # some devices only, chosen there by rules with their measurements)
    options: Mapping[str, tuple[Any, ...]] = field(default_factory=lambda: _EMPTY)
    workgroup_storage: Callable[[AttentionSpec, Mapping[str, Any]], int] | None = None
    max_seq_len: int | None = None
    device_types: frozenset[str] | None = None                   # None = any
    vendor: str | None = None
    flag: str | None = None
    priority: int = 0
    tolerance: Mapping[str, tuple[float, float]] = field(default_factory=lambda: TOLERANCE)
    extra_checks: Callable[[AttentionSpec, DeviceCaps, Mapping[str, Any]], list[str]] | None = None
    # Params under which the kernel stands in for the device ``features`` it needs (e.g. an
    # OpenCL sub-group kernel with its shuffles emulated in local memory): a forced kernel
    # whose params contain these runs on devices without those features. Slower; for tests.
    emulation: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    # The device features the emulation stands in for (empty: all of ``features``); a
    # matrix kernel's emulation replaces its matrix primitive, not shader-f16.
    emulates: frozenset[str] = frozenset()
    # A matrix-unit kernel's primitive (None: scalar FMAs). Its param "mma" picks the build;
    # the session flag matrix_units decides whether it is chosen (attnreg/rules.py).
    matrix: MatrixUnit | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"KernelInfo {self.id}: family {self.family!r} not in {FAMILIES}")
        unknown = self.supports - ALL_FEATURES
        if unknown:
            raise ValueError(f"KernelInfo {self.id}: unknown contract features {sorted(unknown)}")

    def emulated(self, params: Mapping[str, Any]) -> bool:
        """Whether ``params`` select this kernel's emulated build (see ``emulation``)."""
        return bool(self.emulation) and all(
            name in params and params[name] == value for name, value in self.emulation.items())

    def head_size_ok(self, h: int) -> bool:
        """Whether q and k rows of ``h`` elements (spec.head_size) are in its range."""
        lo, hi, step = self.head_sizes
        return lo <= h <= hi and h % step == 0

    def v_head_size_ok(self, h: int) -> bool:
        """Whether v rows of ``h`` elements (spec.head_size_v) are in its v range."""
        lo, hi, step = self.v_head_sizes or self.head_sizes
        return lo <= h <= hi and h % step == 0

    def takes(self, name: str) -> bool:
        """Whether ``name`` is a parameter of this kernel (one the caller may set)."""
        if name in self.params or name in self.defaults or name in self.choices \
                or name in self.options or name in self.emulation:
            return True
        if self.family == "reduce":
            return name == "n_splits"
        return name in ("split_size", "n_splits") and self.family in SPLIT_FAMILIES

    def storage_need(self, spec: AttentionSpec, params: Mapping[str, Any]) -> int:
        return 0 if self.workgroup_storage is None else int(self.workgroup_storage(spec, params))

    def dtype_reasons(self, spec: AttentionSpec) -> list[str]:
        """Why this variant does not compute in spec's dtype or read its K/V storage."""
        why = []
        if spec.dtype not in self.dtypes:
            why.append(f"dtype {spec.dtype} not in {sorted(self.dtypes)}")
        if spec.kv_dtype is not None and self.family != "reduce" \
                and spec.kv_dtype not in self.kv_dtypes:
            why.append(f"kv_dtype {spec.kv_dtype}: reads " + (
                f"only {sorted(self.kv_dtypes)} quantized K/V" if self.kv_dtypes
                else "no quantized K/V (k and v in dtype only)"))
        return why

    def not_supported_reasons(self, spec: AttentionSpec, caps: DeviceCaps,
                              params: Mapping[str, Any] | None = None) -> list[str]:
        """Why this variant cannot run ``spec`` on ``caps`` (empty list: it can).

        Capability only; selection preferences (vendor, opt-in flags, rule-chosen
        parameters) are judged by the registry, so forcing a kernel bypasses them.
        """
        p = {**self.defaults, **(params or {}), **self.params}
        why: list[str] = []
        if caps.backend != self.backend:
            why.append(f"kernel of backend {self.backend!r}, device is {caps.backend!r}")
        if not caps.available:
            why.append(f"device unavailable: {caps.reason}")
        typed = self.dtype_reasons(spec)
        if typed:
            # the checks below size tiles and tensors by dtype: meaningless for another one
            return why + typed
        if not self.head_size_ok(spec.head_size):
            lo, hi, step = self.head_sizes
            why.append(f"head_size {spec.head_size} outside {lo}..{hi} step {step} "
                       "(q and k's head size)")
        if not self.v_head_size_ok(spec.head_size_v):
            lo, hi, step = self.v_head_sizes or self.head_sizes
            why.append(f"v_head_size {spec.head_size_v} outside {lo}..{hi} step {step} "
                       "(v's and out's head size)")
        if spec.q_layout not in self.q_layouts:
            why.append(f"q_layout {spec.q_layout} not in {sorted(self.q_layouts)}")
        if spec.kv_layout not in self.kv_layouts:
            why.append(f"kv_layout {spec.kv_layout} not in {sorted(self.kv_layouts)}")
        missing = sorted(spec.features - self.supports)
        if missing:
            why.append(f"does not implement {', '.join(missing)}")
        if self.max_seq_len is not None and spec.seq_len > self.max_seq_len:
            why.append(f"seq_len {spec.seq_len} > {self.max_seq_len} rows this kernel handles")
        if self.device_types is not None and caps.device_type not in self.device_types:
            why.append(f"device type {caps.device_type} not in {sorted(self.device_types)}")
        lacking = sorted(self.features - caps.features)
        if lacking and self.emulated(p):
            lacking = sorted(set(lacking) - (self.emulates or set(lacking)))
        if lacking:
            why.append(f"device lacks feature(s) {', '.join(lacking)}")
        limit = caps.limit("workgroup_storage")
        need = self.storage_need(spec, p)
        if limit is not None and need > limit:
            why.append(f"needs {need} B of workgroup storage, device limit is {limit} B")
        cap = caps.limit("storage_binding")
        if cap is not None:
            for name, size in binding_bytes(self.family, spec, p).items():
                if size > cap:
                    why.append(f"tensor {name} needs {_mib(size)} in one storage binding, "
                               f"device limit storage_binding is {_mib(cap)}")
        if self.extra_checks is not None and not why:
            why += self.extra_checks(spec, caps, p)
        return why
