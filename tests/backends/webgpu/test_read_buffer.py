"""GpuDevice.read_buffer, the probes' read-back (backends/dawn/gemm_probe.py, bench/wgsl_*_probe.py):
on both WebGPU hosts it returns a buffer's bytes as written, and the GEMM probe's pass_times,
which reads its timestamps through it, times a dispatch."""

from __future__ import annotations

import numpy as np
import pytest

from attnreg.backends.dawn import device as ddevice
from attnreg.backends.dawn import gemm_probe
from attnreg.backends.webgpu import device as wdevice
from tests.support import require_devices

HOSTS = {"webgpu": wdevice.get, "dawn": ddevice.get}
FILL = """@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  out[gid.x] = gid.x * 3u + 1u;
}
"""


@pytest.mark.parametrize("backend", sorted(HOSTS))
def test_read_buffer_returns_what_a_kernel_wrote(backend: str) -> None:
    dev = HOSTS[backend](require_devices(backend)[0])
    U = dev.wgpu.BufferUsage
    n = 256
    buf = dev.device.create_buffer(size=4 * n, usage=U.STORAGE | U.COPY_SRC)
    try:
        pipe = dev.compile(f"read_buffer_fill[{backend}]", FILL, ("rw",))
        group = dev.device.create_bind_group(
            layout=dev.layout(("rw",))[0], entries=[{"binding": 0, "resource": {"buffer": buf}}])
        secs = gemm_probe.pass_times(dev, pipe, group, (n // 64, 1, 1), 2, 3)
        got = np.frombuffer(dev.read_buffer(buf, 4 * n), dtype=np.uint32)
        # only the first half: a partial read is a read of that many bytes
        half = np.frombuffer(dev.read_buffer(buf, 2 * n), dtype=np.uint32)
    finally:
        buf.destroy()
    want = np.arange(n, dtype=np.uint32) * 3 + 1
    assert np.array_equal(got, want)
    assert np.array_equal(half, want[: n // 2])
    assert len(secs) == 3 and all(s > 0 for s in secs)
