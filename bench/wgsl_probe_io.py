"""Buffers of the standalone WGSL probes (bench/wgsl_*_probe.py): their inputs uploaded, their
outputs made, one bind group over both in binding order (outputs come back through the
device's read_buffer)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def bind(dev: Any, inputs: Sequence[np.ndarray], out_sizes: Sequence[int]
         ) -> tuple[list[Any], Any]:
    """(buffers, bind group): read-only storage for ``inputs`` (bindings 0..), then
    read-write storage of ``out_sizes`` bytes."""
    U = dev.wgpu.BufferUsage
    d = dev.device
    bufs = []
    for arr in inputs:
        b = d.create_buffer(size=arr.nbytes, usage=U.STORAGE | U.COPY_DST)
        d.queue.write_buffer(b, 0, arr.view(np.uint8).reshape(-1))
        bufs.append(b)
    for n in out_sizes:
        bufs.append(d.create_buffer(size=n, usage=U.STORAGE | U.COPY_SRC))
    bgl = dev.layout(("read",) * len(inputs) + ("rw",) * len(out_sizes))[0]
    group = d.create_bind_group(layout=bgl, entries=[{"binding": i, "resource": {"buffer": b}}
                                                     for i, b in enumerate(bufs)])
    return bufs, group

