"""A plan's stages as what any WebGPU host needs: the specialised WGSL, entry point,
binding layout (with the buffer each binding takes) and dispatch grid -- no wgpu involved.

The WGSL and its constants come from backends.webgpu's own specialisation
(``WebGpuRuntime._pipeline``, run against a recorder instead of a wgpu device) and the
workgroup count from ``WebGpuRuntime._groups_of``, so the browser compiles exactly the text
wgpu-py compiles for the same plan -- plus, where subgroup builtins are called, the
``enable subgroups;`` directive that Tint requires and naga refuses. The binding order
follows backends.webgpu.device.BINDINGS and the buffers backends.webgpu.runtime binds.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from attnreg.caps import DeviceCaps
from attnreg.errors import KernelUnavailable
from attnreg.plan import Plan, Stage
from attnreg.spec import AttentionSpec
from backends.webgpu import device as wdevice
from backends.webgpu import runtime as wruntime
from backends.webgpu import source as wsource

from . import kernels

ENTRY_POINT = "main"
# The buffer each binding takes, per family, in BINDINGS order (backends/webgpu/runtime.py
# _prepare: params, q, k, v, bias, seqlens, sink, then the outputs).
_ATTN_IN = ("params", "q", "k", "v", "bias", "seqlens", "sink")
BUFFERS: Mapping[str, tuple[str, ...]] = {
    "prefill": (*_ATTN_IN, "out", "lse"),
    "decode_partial": (*_ATTN_IN, "o_parts", "lse_parts"),
    "reduce": ("params", "o_parts", "lse_parts", "sink", "out", "lse"),
}
for _fam, _names in BUFFERS.items():
    assert len(_names) == len(wdevice.BINDINGS[_fam]), f"bindings of {_fam} changed"

# Tint (Chromium) refuses subgroup builtins unless the module says `enable subgroups;`;
# naga (wgpu-py 0.32) refuses that directive ("not yet supported"). So the shared source
# carries none and the browser adds it to modules that call a subgroup builtin.
SUBGROUP_DIRECTIVE = "enable subgroups;\n"
_SUBGROUP_CALL = re.compile(r"\bsubgroup[A-Z]\w*\s*\(")


def for_tint(wgsl: str) -> str:
    """The module as Tint accepts it: ``enable subgroups;`` first where subgroups are used."""
    if _SUBGROUP_CALL.search(wgsl) and not re.search(r"^\s*enable\s+[^;]*\bsubgroups\b", wgsl, re.M):
        return SUBGROUP_DIRECTIVE + wgsl
    return wgsl


@dataclass(frozen=True)
class StageProgram:
    """One dispatch: ``bindings`` are (binding, kind, buffer name); kind is uniform|read|rw."""

    kernel: str
    family: str
    wgsl: str
    entry: str
    bindings: tuple[tuple[int, str, str], ...]
    grid: tuple[int, int, int]
    workgroups: int
    consts: Mapping[str, int]
    dtype: str                  # what the stage computes in (float32 for a host-cast variant)

    @property
    def key(self) -> str:
        """The page's pipeline-cache key: the source and the binding kinds."""
        kinds = ",".join(k for _, k, _ in self.bindings)
        return f"{wsource.digest(self.wgsl)}-{kinds}"


class _Recorder:
    """Stands in for backends.webgpu's device: 'compiling' returns the source."""

    def pipeline(self, kernel_id: str, layout: str, wgsl: str) -> str:
        return wgsl


class _Specialiser:
    """What WebGpuRuntime._pipeline reads from ``self``: the caps and a device."""

    def __init__(self, caps: DeviceCaps) -> None:
        self.caps = caps
        self.dev = _Recorder()


_PIPELINE_KW = set(inspect.signature(wruntime.WebGpuRuntime._pipeline).parameters)


def specialise(stage: Stage, spec: AttentionSpec, caps: DeviceCaps, *,
               bias_shape: tuple[int, ...] | None = None, op: str = "attention"
               ) -> tuple[str, dict[str, int]]:
    """(WGSL, constants) of one stage, exactly as backends.webgpu builds them, for the spec
    the device computes (float32 for a host-cast variant)."""
    dev_spec = kernels.device_spec(spec, stage.params)
    aux = getattr(wruntime, "stage_aux", lambda st, sp: ())(stage, dev_spec)
    if aux:
        raise KernelUnavailable(stage.kernel, f"the browser backend binds no {', '.join(aux)} "
                                "(paged KV / masked-block lists are not wired up here)")
    kw: dict[str, Any] = {k: v for k, v in (("bias_shape", bias_shape), ("op", op))
                          if k in _PIPELINE_KW}
    fake = cast(wruntime.WebGpuRuntime, _Specialiser(caps))
    wgsl, consts = wruntime.WebGpuRuntime._pipeline(fake, stage, dev_spec, **kw)
    return cast(str, wgsl), dict(consts)


def workgroups(stage: Stage, spec: AttentionSpec, consts: Mapping[str, int]) -> int:
    """How many workgroups the stage dispatches (before folding into a grid)."""
    fake = cast(wruntime.WebGpuRuntime, _Specialiser.__new__(_Specialiser))
    return int(wruntime.WebGpuRuntime._groups_of(fake, stage, spec, consts))


def launch_stages(plan: Plan) -> list[Stage]:
    """The stages a launch dispatches (a reduce-only op runs just the reduce)."""
    return [plan.stage("reduce")] if plan.op == "reduce" else list(plan.stages)


def program(stage: Stage, spec: AttentionSpec, caps: DeviceCaps, *,
            bias_shape: tuple[int, ...] | None = None, op: str = "attention") -> StageProgram:
    """Everything a host needs to compile and dispatch one stage."""
    wgsl, consts = specialise(stage, spec, caps, bias_shape=bias_shape, op=op)
    wgsl = for_tint(wgsl)
    n = workgroups(stage, spec, consts)
    limit = caps.limit("workgroups_per_dim") or 65535
    names = BUFFERS[stage.family]
    bindings = tuple((b, kind, names[i]) for i, (b, kind) in enumerate(wdevice.BINDINGS[stage.family]))
    return StageProgram(stage.kernel, stage.family, wgsl, ENTRY_POINT, bindings,
                        wruntime.fold_grid(n, limit), n, consts,
                        kernels.device_spec(spec, stage.params).dtype)


def programs(plan: Plan, caps: DeviceCaps | None = None,
             bias_shape: tuple[int, ...] | None = None) -> list[StageProgram]:
    """The plan's dispatches in launch order."""
    c = caps or plan.caps
    return [program(st, plan.spec, c, bias_shape=bias_shape, op=plan.op)
            for st in launch_stages(plan)]


def split_params(plan: Plan, n_parts: int | None = None) -> dict[str, Any]:
    """The parameters the shared parameter block is packed from: the split stage's, with
    n_splits = ceil(C / split_size) as the contract fixes it (or, for a reduce of given
    partial states, their count ``n_parts``)."""
    stages = launch_stages(plan)
    split = next((s for s in stages if s.family == "decode_partial"), stages[0])
    geometry = dict(split.params)
    if split.family == "decode_partial":
        size = int(geometry.setdefault("split_size", plan.spec.capacity))
        geometry["n_splits"] = -(-plan.spec.capacity // size)
    elif n_parts is not None:
        geometry["n_splits"] = n_parts
    return geometry
