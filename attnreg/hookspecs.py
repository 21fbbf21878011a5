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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import pluggy

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
class Runtime(Protocol):
    """A device opened for one Session: its memory, its launches and its measurements.

    Every backend implements all of it (a backend that computes on the host keeps device
    memory in host bytes, see :class:`attnreg.hostmem.HostMemory`). Compiled programs
    should be shared per device by the backend, so that a new Session does not recompile.
    """

    caps: DeviceCaps
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
        profiling events); backends may add detail under other keys."""
        ...

    def alloc(self, nbytes: int) -> Any:
        """A buffer of at least ``nbytes`` for a DeviceTensor (contents unspecified)."""
        ...

    def upload(self, handle: Any, array: np.ndarray, offset_bytes: int = 0) -> None:
        """Copy a host array into a buffer at a byte offset, ordered with the launches."""
        ...

    def download(self, handle: Any, nbytes: int) -> bytes:
        """The first ``nbytes`` of a buffer, after every launch issued before."""
        ...

    def free(self, handle: Any) -> None:
        """Release a buffer from :meth:`alloc`; nothing prepared with it is used again."""
        ...

    def copy_rows(self, src: Any, dst: Any, rows: int, row_bytes: int, src_pitch: int,
                  dst_pitch: int) -> None:
        """Copy ``rows`` rows of ``row_bytes`` bytes from buffer ``src`` (rows ``src_pitch``
        bytes apart) into buffer ``dst`` (rows ``dst_pitch`` apart), with zeros in the rest
        of each ``dst`` row; ordered with launches and uploads like :meth:`upload`, on the
        device (no host transfer). Pitches and sizes may be any byte counts: it widens or
        narrows a tensor's last axis (attnreg/headpad.py)."""
        ...

    def copy_bandwidth(self, nbytes: int = 256 << 20) -> float:
        """Measured copy bandwidth of the device's memory in GB/s (bytes read + written),
        copying ``nbytes``: the roof the bench compares kernels with."""
        ...

    def close(self) -> None:
        """Free this session's buffers (compiled code may stay cached in the backend)."""
        ...


@runtime_checkable
class QuantizingRuntime(Protocol):
    """Optional: a Runtime that quantizes K/V on its device (KVCache appends with kv_dtype
    "int8" / "int4"). A runtime without these methods gets no quantized KV cache: the
    Session refuses with a SpecError naming kv_dtype. Codes and scales must equal
    :func:`attnreg.quantize_kv`'s except at exact rounding ties (one code off at most)."""

    caps: DeviceCaps

    def quantize_refusal(self, kv_dtype: str, dtype: str, head_size: int) -> str | None:
        """None if this runtime can quantize float ``dtype`` vectors of ``head_size`` into
        ``kv_dtype``; otherwise why not, in words (it becomes the SpecError's message)."""
        ...

    def quantize_into(self, kv_dtype: str, rows: np.ndarray,
                      jobs: list[tuple[np.ndarray, Any, Any]]) -> None:
        """For each job (x, codes, scales): quantize x [R, H] (float32 / float16 / bfloat16,
        finite: the caller checked) and write vector r's codes at vector ``rows[r]`` of the
        buffer ``codes`` (viewed as int8 [V, H] or, int4, uint8 [V, H/2]) and its scales at
        ``rows[r]`` of ``scales`` (float32 [V], or float16 [V, H/32]); ordered with launches
        and uploads like :meth:`Runtime.upload`. ``rows`` int32 [R]: distinct and in range
        (the caller checked); the handles come from :meth:`Runtime.alloc`."""
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
        """A Runtime for one of the probed devices. A backend whose devices depend on session
        flags may declare ``open(caps, flags=None)``: the Session then passes its resolved
        flags (the registry asks a one-argument ``open`` as before)."""
        ...


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
def attnreg_register_commands(register: Callable[[Command], None]) -> None:
    """Add subcommands to the ``attnreg`` CLI (:class:`attnreg.hookspecs.Command`)."""
