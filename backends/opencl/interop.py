"""The caller's queue: ``Session(backend="opencl", device=<pyopencl.CommandQueue>)`` runs on
that queue, its context and its device, and what an engine does there (a buffer, a submit, a
wait) for tests, the interop conformance cells and the bench."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyopencl as cl

from attnreg.caps import DeviceCaps
from attnreg.errors import SpecError

from . import device, probe
from .memory import raw_bytes
from .runtime import OpenCLRuntime

# Ids of the caller's queues, one per Session that adopts one ("opencl:caller1", ...).
_CALLERS = itertools.count(1)


def _probed(queue: cl.CommandQueue, probed: list[DeviceCaps]) -> DeviceCaps:
    """The probed caps of the queue's device (the probe ran its compiler and sub-group
    checks there once)."""
    for caps in probed:
        pi, di = caps.extra.get("platform_index"), caps.extra.get("device_index")
        if pi is not None and cl.get_platforms()[pi].get_devices()[di] == queue.device:
            return caps
    raise SpecError("device", queue, f"a queue on a device the {probe.NAME} backend probed: "
                    + ", ".join(f"{c.id} ({c.name})" for c in probed))


def adopt(queue: Any, flags: Mapping[str, Any], probed: list[DeviceCaps]) -> OpenCLRuntime:
    """A runtime on the caller's queue. It must run commands in order: the stages of a plan,
    and its uploads, rely on the queue's order."""
    if not isinstance(queue, cl.CommandQueue):
        raise SpecError("device", queue, "a device id, index or name, or an in-order "
                        "pyopencl.CommandQueue the caller made")
    props = queue.properties
    if props & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
        raise SpecError("device", queue, "an in-order CommandQueue (a plan's stages and its "
                        "writes are ordered by the queue)")
    caps = _probed(queue, probed)
    timed = "with" if props & cl.command_queue_properties.PROFILING_ENABLE else "without"
    line = (f"the caller's CommandQueue ({timed} profiling): attnreg enqueues on it and waits "
            "only for its own commands")
    caps = caps.model_copy(update={"id": f"{probe.NAME}:caller{next(_CALLERS)}",
                                   "settings": (*caps.settings, line)})
    return OpenCLRuntime(caps, queue)


def engine_queue(caps: DeviceCaps, flags: Mapping[str, Any]) -> cl.CommandQueue:
    """An engine's in-order queue on the context attnreg made for a probed device (so the
    programs built there are shared)."""
    ctx, dev = device.context(caps)
    return cl.CommandQueue(ctx, dev)


def buffer(queue: cl.CommandQueue, array: np.ndarray) -> cl.Buffer:
    """A buffer of the engine's holding the array's bytes."""
    raw = raw_bytes(np.ascontiguousarray(array))
    if raw.size == 0:
        return cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, 4)
    return cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                     hostbuf=raw)


def submit(queue: cl.CommandQueue, record: Callable[[Any], Any]) -> Any:
    """``record(queue)``, then the queue flushed to the device."""
    got = record(queue)
    queue.flush()
    return got


def wait(queue: cl.CommandQueue) -> None:
    queue.finish()
