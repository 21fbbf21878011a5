"""The module-level functions of attnreg: run, explain, devices, partial/reduce, merge."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from . import registry as regmod
from .caps import DeviceCaps
from .kernel import KernelInfo
from .plan import Plan
from .session import Session
from .spec import AttentionSpec
from .states import merge, states_layout

_DEFAULT: dict[tuple[Any, Any], Session] = {}
_LOCK = threading.Lock()


def default_session(backend: str | None = None, device: str | int | None = None) -> Session:
    """The process-wide Session used by attnreg.run (so repeated calls reuse compiled kernels)."""
    with _LOCK:
        s = _DEFAULT.get((backend, device))
        if s is None or s.closed:
            s = _DEFAULT[(backend, device)] = Session(backend=backend, device=device)
        return s


def run(spec: AttentionSpec, tensors: Mapping[str, Any], backend: str | None = None,
        flags: Mapping[str, Any] | None = None, *, device: str | int | None = None,
        kernel: str | None = None, params: Mapping[str, Any] | None = None) -> Any:
    """Validate, plan and run attention. Returns out, or (out, lse) when spec.return_lse."""
    return default_session(backend, device).run(spec, tensors, kernel=kernel, params=params,
                                                 flags=flags)


def explain(spec: AttentionSpec, backend: str | None = None,
            caps: DeviceCaps | Iterable[DeviceCaps] | None = None,
            flags: Mapping[str, Any] | None = None, *, op: str = "attention",
            device: str | int | None = None, kernel: str | None = None,
            params: Mapping[str, Any] | None = None) -> Plan:
    """The Plan run() would follow, from metadata only: nothing is compiled or run."""
    return regmod.get().plan(spec, op=op, backend=backend, device=device, caps=caps,
                             flags=flags, kernel=kernel, params=params)


def devices(backend: str | None = None, refresh: bool = False) -> list[DeviceCaps]:
    """Probed devices of every installed backend, best first; failures are listed with reasons."""
    return regmod.get().devices(backend, refresh=refresh)


def kernels(backend: str | None = None, family: str | None = None) -> list[KernelInfo]:
    """Every registered kernel variant (optionally of one backend or family)."""
    return regmod.get().kernels(backend, family)


def partial_states(spec: AttentionSpec, tensors: Mapping[str, Any], split_size: int | None = None,
                   backend: str | None = None, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """Split-KV partial states (docs/contract.md "Split-KV partial states and merging"),
    float32."""
    return default_session(backend, kw.pop("device", None)).partial_states(
        spec, tensors, split_size=split_size, **kw)


def reduce_states(spec: AttentionSpec, o_parts: Any, lse_parts: Any, head_sink: Any = None,
                  backend: str | None = None, **kw: Any) -> Any:
    """Reduce partial states (from any backend) into out, or (out, lse)."""
    return default_session(backend, kw.pop("device", None)).reduce_states(
        spec, o_parts, lse_parts, head_sink, **kw)


def merge_states(states: Any, backend: str | None = None,
                 device: str | int | None = None, *, layout: str | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Merge attention states over disjoint key sets: the split-KV reduce's rule.

    Each state is (o [..., H], lse [...]) with lse of o's shape without H, or what
    ``run(..., return_lse=True)`` returns in either q_layout (BSNH: o [B, S, Nq, H] with lse
    [B, Nq, S]); the result comes back in the states' layout. ``layout`` ("rows", "BSNH",
    "BNSH") says which; where the shapes cannot tell (a BSNH out with S == Nq) rows is
    assumed, so pass layout="BSNH" for run's BSNH outputs. All states must share shapes and
    dtypes. States whose lse is -inf contribute nothing. Without ``backend`` this runs in
    float64 numpy and returns the inputs' dtypes; with one (e.g. "webgpu") it runs that
    backend's reduce kernel and returns float32.
    """
    if backend is None:
        return merge(states, states_layout(states, layout))
    return default_session(backend, device).merge_states(states, layout=layout)


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Register a plugin object or module now (the same hooks as an entry point)."""
    regmod.get().register_plugin(plugin, name)


def unregister_plugin(plugin: object | None = None, name: str | None = None) -> None:
    regmod.get().unregister_plugin(plugin, name)
