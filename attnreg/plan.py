"""Plan: what explain() returns and run() executes -- backend, device, kernels, params, and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .caps import DeviceCaps
from .quant import kv_storage_text
from .spec import AttentionSpec

OPS = ("attention", "partial", "reduce")


@dataclass(frozen=True)
class SplitGeometry:
    """How a split-KV plan cuts the KV range [0, C): ``n_splits`` splits of ``split_size``
    keys (the last may be shorter), T = ceil(C / split_size) as the contract fixes it. A
    reduce of given partial states knows only their count (split_size None)."""

    n_splits: int
    split_size: int | None = None

    @staticmethod
    def over(capacity: int, split_size: int) -> SplitGeometry:
        # A split longer than the cache is the whole cache (the same single split); keeping
        # it at C keeps the kernels' key arithmetic ((t + 1) * split_size) inside int32.
        size = max(1, min(int(split_size), int(capacity)))
        return SplitGeometry(-(-int(capacity) // size), size)

    @property
    def params(self) -> dict[str, int]:
        """The geometry as the stage parameters explain shows."""
        out = {"n_splits": self.n_splits}
        if self.split_size is not None:
            out["split_size"] = self.split_size
        return out


@dataclass(frozen=True)
class Stage:
    """One kernel launch of a plan, with its final parameters."""

    kernel: str
    family: str
    params: Mapping[str, Any]


@dataclass(frozen=True)
class Plan:
    """The registry's decision for one request. Building it compiles and runs nothing.

    ``rejected`` maps every other candidate kernel to its reasons; ``rules`` lists the rules
    that fired, as "name: why -> params"; ``ignored_flags`` says which flags had no effect
    on this device and why.
    """

    spec: AttentionSpec
    op: str
    route: str
    caps: DeviceCaps
    stages: tuple[Stage, ...]
    rejected: Mapping[str, list[str]] = field(default_factory=dict)
    rules: tuple[str, ...] = ()
    ignored_flags: Mapping[str, str] = field(default_factory=dict)
    flags: Mapping[str, Any] = field(default_factory=dict)
    split: SplitGeometry | None = None        # the split-KV geometry every stage shares
    # The spec the caller asked for, when the kernels run ``spec`` with its head sizes padded
    # by zero columns (attnreg/headpad.py); None when they run the asked spec as it is.
    request: AttentionSpec | None = None

    @property
    def asked(self) -> AttentionSpec:
        """The caller's spec (``request``, or ``spec`` when nothing was padded)."""
        return self.request if self.request is not None else self.spec

    @property
    def backend(self) -> str:
        return self.caps.backend

    @property
    def device(self) -> str:
        return self.caps.label

    @property
    def kernel(self) -> str:
        """The primary kernel id (the first stage)."""
        return self.stages[0].kernel

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(s.kernel for s in self.stages)

    @property
    def params(self) -> dict[str, Any]:
        """The primary kernel's parameters."""
        return dict(self.stages[0].params)

    def stage(self, family: str) -> Stage:
        for s in self.stages:
            if s.family == family:
                return s
        raise KeyError(f"plan has no {family} stage (stages: {self.kernels})")

    def explain(self) -> str:
        """The plan as text a person can read."""
        lines = [
            f"spec:    {self.asked!r}",
            f"op:      {self.op} (route: {self.route})",
            f"backend: {self.backend}",
            f"device:  {self.device}  vendor={self.caps.vendor}"
            + (f" arch={self.caps.architecture}" if self.caps.architecture else ""),
            "kernels: " + " -> ".join(self.kernels),
        ]
        lines[4:4] = [f"         {line}" for line in self.caps.settings]
        if self.request is not None:
            lines.insert(1, f"runs as: {self.spec!r} (zero columns added; out cut back)")
        if self.split is not None:
            lines.insert(-1, "split:   " + ", ".join(f"{k}={v}" for k, v in
                                                  sorted(self.split.params.items())))
        if self.op != "reduce":
            kv = "kv:      " + kv_storage_text(self.spec)
            if self.spec.kv_dtype is not None:
                kv += ("; dequantized on the host (numpy)" if self.backend == "reference"
                       else "; dequantized in the kernel as K/V are loaded")
            lines.insert(-1, kv)
        for s in self.stages:
            ps = ", ".join(f"{k}={v}" for k, v in sorted(s.params.items()))
            lines.append(f"  {s.kernel}: {ps or '(no params)'}")
        if self.flags:
            lines.append("flags:   " + ", ".join(f"{k}={v}" for k, v in sorted(self.flags.items())))
        if self.rules:
            lines.append("rules fired:")
            lines += [f"  - {r}" for r in self.rules]
        if self.ignored_flags:
            lines.append("ignored flags:")
            lines += [f"  - {k}: {v}" for k, v in sorted(self.ignored_flags.items())]
        if self.rejected:
            lines.append("rejected:")
            for k, reasons in sorted(self.rejected.items()):
                lines.append(f"  {k}:")
                lines += [f"    - {r}" for r in reasons]
        return "\n".join(lines)

    __str__ = explain
