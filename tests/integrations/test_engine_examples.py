"""docs/interop.md's engines run as written: a two-layer toy decoder whose own kernels write
Q/K/V into its buffers, attnreg attending inside the engine's encoder (wgpu-py, lavapipe in
CI) or on its queue (pyopencl, PoCL in CI), no host transfer inside the loop, and the hidden
state after the loop matching the same decoder in numpy over attnreg's float64 reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import require_devices

PAGE = Path(__file__).parents[2] / "docs" / "interop.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_model_and_two_engines() -> None:
    assert len(BLOCKS) == 3 and "import wgpu" in BLOCKS[1] and "import pyopencl" in BLOCKS[2]


@pytest.mark.parametrize("backend,index", [("webgpu", 1), ("opencl", 2)])
def test_engine_example_runs(backend: str, index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    require_devices(backend)
    if backend == "opencl":      # create_some_context: the OpenCL device the tests use
        import pyopencl as cl

        from tests.support import require_opencl_device

        dev = require_opencl_device()
        plat = cl.get_platforms()[dev.extra["platform_index"]]
        monkeypatch.setenv("PYOPENCL_CTX", f"{dev.extra['platform_index']}:"
                                           f"{dev.extra['device_index']}")
        assert plat.get_devices()
    scope: dict[str, object] = {}
    for block in (BLOCKS[0], BLOCKS[index]):
        exec(compile(block, f"docs/interop.md ({backend})", "exec"), scope)
