"""The plugin and runtime contract: the attnreg_* hooks, the Backend and the Runtime.

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

import argparse
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

from .memory import Memory

if TYPE_CHECKING:
    from .caps import DeviceCaps
    from .device_tensor import DeviceTensor
    from .flags import Flag
    from .kernel import KernelInfo
    from .plan import Plan
    from .rules import Rule
    from .spec import AttentionSpec

PROJECT = "attnreg"
ENTRY_POINT_GROUP = "attnreg.plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@runtime_checkable
class Runtime(Memory, Protocol):
    """A device opened for one Session: its memory (:class:`attnreg.memory.Memory`: alloc /
    upload / download / free / copy_rows, K/V quantization), its launches and its
    measurements.

    Every backend implements all of it (a backend that computes on the host keeps device
    memory in host bytes, see :class:`attnreg.hostmem.HostMemory`); where a device cannot
    do something, a refusal method says why. Compiled programs should be shared per device
    by the backend, so that a new Session does not recompile.
    """

    counters: Counter[str]
    """Events and bytes, under one name on every backend: launches (calls of launch),
    host_uploads, host_upload_bytes, readbacks, readback_bytes, allocs, frees, prepares;
    a backend may add its own (tests read them)."""

    def launch(self, plan: Plan, inputs: Mapping[str, Any],
               outputs: Mapping[str, DeviceTensor] | None = None) -> dict[str, Any]:
        """Run ``plan`` (op 'attention', 'partial' or 'reduce') on validated inputs (numpy
        arrays, or DeviceTensors of this runtime).

        Outputs by op -- attention: ``out`` (q layout, spec dtype) and ``lse`` if
        return_lse; partial: ``o_parts`` [B,Nq,S,T,H] f32, ``lse_parts`` [B,Nq,S,T] f32;
        reduce: like attention. An output named in ``outputs`` is written into that
        DeviceTensor and returned as it is (a device backend neither reads it back nor
        waits). Launch errors that mean "this kernel cannot run here" raise
        :class:`attnreg.KernelUnavailable` so the next candidate is tried.
        """
        ...

    def timings(self, plan: Plan, inputs: Mapping[str, Any], *, iters: int = 20,
                warmup: int = 3) -> dict[str, Any]:
        """Seconds per launch of ``plan`` with inputs bound once and nothing read back:
        ``wall_s`` always, ``gpu_s`` where the device has timers (timestamp queries,
        profiling events); ``b2b_s`` where measured: ``iters`` launches enqueued without
        waiting, the first one's start to the last one's end divided by ``iters`` (one
        value per burst); backends may add detail under other keys."""
        ...

    def copy_bandwidth(self, nbytes: int = 256 << 20) -> float:
        """Measured copy bandwidth of the device's memory in GB/s (bytes read + written),
        copying ``nbytes``: the roof the bench compares kernels with."""
        ...

    def matrix_peak(self) -> tuple[float | None, str]:
        """The f16 x f16 -> f32 matrix-product rate in TFLOP/s that this backend's kernels
        can reach on the device's matrix units, measured by a GEMM probe, with a line
        naming the probe's config; or None and why there is none (no matrix units reachable
        through this API). The bench's peak for the matrix kernels."""
        ...

    def record_refusal(self, plan: Plan, inputs: Mapping[str, Any]) -> str | None:
        """None if :meth:`record` can record ``plan`` on these inputs (DeviceTensors of this
        runtime, the output on the device: the caller checked); otherwise why not, in words
        (a device runtime refuses what it would derive on the host per launch)."""
        ...

    def record(self, plan: Plan, inputs: Mapping[str, Any], outputs: Mapping[str, DeviceTensor],
               stream: Any, wait_for: Any = None) -> Any:
        """Record a launch of ``plan`` into the caller's command stream instead of running it
        (``PreparedRun.encode``): WebGPU dispatches into a GPUCommandEncoder (in a compute
        pass of their own) or a GPUComputePassEncoder, for the caller to submit; OpenCL
        enqueues on its CommandQueue after the events ``wait_for`` and returns the event of
        the last stage. Nothing is uploaded, read back or waited for. Called only where
        :meth:`record_refusal` said None."""
        ...

    def close(self) -> None:
        """Free this session's buffers (compiled code may stay cached in the backend)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A backend plugin's entry object (:class:`BackendInfo` makes one from data)."""

    name: str
    priority: int          # among devices of the same type, the higher is preferred

    def probe(self) -> list[DeviceCaps]:
        """Devices this backend can use. Never raises: failures become caps with
        ``available=False`` and a reason (see ``attnreg.caps.unavailable``)."""
        ...

    def open(self, caps: DeviceCaps, flags: Mapping[str, Any]) -> Runtime:
        """A Runtime for one of the probed devices, given the Session's resolved flags
        (dawn: experimental_features picks the device; most backends ignore them)."""
        ...


@dataclass(frozen=True)
class BackendInfo:
    """A Backend as data: its name, its priority, and the functions that probe its devices
    and open one of them."""

    name: str
    priority: int
    probe: Callable[[], list[DeviceCaps]]
    open: Callable[[DeviceCaps, Mapping[str, Any]], Runtime]


@dataclass(frozen=True)
class Interop:
    """How a backend runs on a device its caller opened (``Session(backend=..., device=<the
    device object>)``) and what an engine does there, for tests, the interop conformance
    cells and the bench (registered through ``attnreg_register_interop``)."""

    backend: str
    adopt: Callable[[Any, Mapping[str, Any], list[DeviceCaps]], Runtime]
    """(the caller's device object, the Session's resolved flags, the backend's probed
    devices) -> a Runtime on that device, whose caps are the device's as the caller opened
    it; a SpecError if the object is not one this backend runs on."""
    device: Callable[[DeviceCaps, Mapping[str, Any]], Any]
    """(a probed device, a Session's flags) -> its object as an engine holds it: the device
    attnreg opens for it under those flags, so compiled programs are shared."""
    buffer: Callable[[Any, Any], Any]
    """(device object, numpy array) -> a buffer of the engine's holding the array's bytes,
    usable as a storage buffer and copied to and from."""
    submit: Callable[[Any, Callable[[Any], Any]], Any]
    """(device object, record) -> calls ``record(stream)`` with a new command stream of the
    engine's (an encoder; the queue) and submits it, without waiting."""
    wait: Callable[[Any], None]
    """Until the device object's queue has finished everything submitted."""


def registers(items: Callable[[], Iterable[Any]]) -> Callable[[Callable[[Any], None]], None]:
    """A hook implementation that registers everything ``items()`` returns: a plugin module
    binds it under the hook's name (``attnreg_register_kernels = registers(declare)``)."""
    @hookimpl
    def register_all(register: Callable[[Any], None]) -> None:
        for item in items():
            register(item)
    return register_all


@dataclass(frozen=True)
class Command:
    """A subcommand of the ``attnreg`` CLI that a plugin brings (e.g. export-wgsl).

    ``configure`` adds the command's own options to its parser; with ``takes_spec`` the CLI
    also adds the spec options and passes the parsed AttentionSpec to ``run``, which returns
    the exit status.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, AttentionSpec | None], int]
    takes_spec: bool = False


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


@hookspec
def attnreg_register_interop(register: Callable[[Interop], None]) -> None:
    """Say how a backend runs on its caller's device objects (:class:`Interop`)."""


@hookspec
def attnreg_register_commands(register: Callable[[Command], None]) -> None:
    """Add subcommands to the ``attnreg`` CLI (:class:`attnreg.hookspecs.Command`)."""
