"""The attnreg_* hooks: the only way backends, kernels, rules and flags enter attnreg.

Built-in backends use exactly these hooks, found through the ``attnreg.plugins`` entry-point
group, as a third-party package would. A plugin module implements any subset::

    import attnreg

    @attnreg.hookimpl
    def attnreg_register_backends(register):
        register(MyBackend())

    @attnreg.hookimpl
    def attnreg_register_kernels(register):
        register(attnreg.KernelInfo(id="mine.prefill.f32", backend="mine", family="prefill",
                                    dtypes=frozenset({"float32"})))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import pluggy

if TYPE_CHECKING:
    from .caps import DeviceCaps
    from .flags import Flag
    from .kernel import KernelInfo
    from .plan import Plan
    from .rules import Rule

PROJECT = "attnreg"
ENTRY_POINT_GROUP = "attnreg.plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@runtime_checkable
class Runtime(Protocol):
    """A device opened for one Session: it owns that session's buffers and bind state.

    Compiled pipelines/programs should be shared per device by the backend, so that a
    new Session does not recompile.
    """

    caps: DeviceCaps

    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``plan`` (op 'attention', 'partial' or 'reduce') on validated inputs.

        Outputs by op -- attention: ``out`` (q layout, spec dtype) and ``lse`` if
        return_lse; partial: ``o_parts`` [B,Nq,S,T,H] f32, ``lse_parts`` [B,Nq,S,T] f32;
        reduce: like attention. Launch errors that mean "this kernel cannot run here"
        raise :class:`attnreg.KernelUnavailable` so the next candidate is tried.
        """
        ...

    def close(self) -> None:
        """Free this session's buffers (compiled code may stay cached in the backend)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A backend plugin's entry object."""

    name: str
    priority: int          # among devices of the same type, the higher is preferred

    def probe(self) -> list[DeviceCaps]:
        """Devices this backend can use. Never raises: failures become caps with
        ``available=False`` and a reason (see ``attnreg.caps.unavailable``)."""
        ...

    def open(self, caps: DeviceCaps) -> Runtime:
        """A Runtime for one of the probed devices."""
        ...


@hookspec
def attnreg_register_backends(register: Callable[[Backend], None]) -> None:
    """Register backend objects (one per API: 'webgpu', 'opencl', ...) by calling register."""


@hookspec
def attnreg_register_kernels(register: Callable[[KernelInfo], None]) -> None:
    """Declare kernel variants as data (:class:`attnreg.KernelInfo`), for any backend.

    A plugin may add kernels to another plugin's backend only if that backend's Runtime
    knows how to launch them; most plugins declare kernels for their own backend.
    """


@hookspec
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    """Add routing rules (:class:`attnreg.rules.Rule`); they run after the built-in ones."""


@hookspec
def attnreg_register_flags(register: Callable[[Flag], None]) -> None:
    """Declare extra session flags (:class:`attnreg.flags.Flag`)."""


