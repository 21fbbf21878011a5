"""The OpenCL room's device (tests.support.require_opencl_device: PoCL in CI, or the device
$ATTNREG_OPENCL_DEVICE names), a Session on it (one a module), and PoCL's device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import attnreg
from tests.support import missing, require_devices, require_opencl_device


@pytest.fixture(scope="module")
def dev() -> attnreg.DeviceCaps:
    return require_opencl_device()


@pytest.fixture(scope="module")
def session(dev: attnreg.DeviceCaps) -> Iterator[attnreg.Session]:
    with attnreg.Session(backend="opencl", device=dev.id) as s:
        yield s


@pytest.fixture(scope="module")
def pocl() -> attnreg.DeviceCaps:
    """PoCL's device (CI's), for the tests that dress its caps as another device's."""
    for d in require_devices("opencl"):
        if d.vendor == "pocl":
            return d
    missing("no PoCL device")
