"""The dawn backend plugin: the backend as data and its hookimpls; the work lives in the
sibling modules."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import attnreg
from attnreg import vkshim
from attnreg.backends.webgpu import rules as wrules
from attnreg.backends.webgpu.interop import Host
from attnreg.backends.webgpu.runtime import WebGpuRuntime
from attnreg.caps import DeviceCaps
from attnreg.flags import Flag
from attnreg.hookspecs import BackendInfo, registers
from attnreg.spec import AttentionSpec

from . import device, kernels, probe

EXPERIMENTAL = Flag(
    "experimental_features", bool, False,
    "Let Dawn devices use Dawn's experimental WebGPU features "
    "(chromium-experimental-subgroup-matrix); off, nothing experimental is requested.")


def _open(caps: DeviceCaps, flags: Mapping[str, Any]) -> WebGpuRuntime:
    """A Session's runtime; with flag experimental_features, on the device that also
    requests Dawn's experimental features (a separate device: tensors of the two never mix)."""
    experimental = bool(flags.get(EXPERIMENTAL.name, False))
    return WebGpuRuntime(caps, device.get(caps, experimental))


def _wgpudawn() -> Any:
    import wgpudawn

    return wgpudawn


def _tick() -> None:
    from wgpudawn.backends.dawn import extras

    extras.process_events()


# The caller's wgpudawn devices: the webgpu backend's interop with Dawn's API and devices.
HOST = Host(probe.NAME, "wgpudawn", _wgpudawn, lambda adapter, view: probe.caps_of(0, adapter, view),
            probe.REQUEST, device.opened,
            lambda caps, flags: device.get(caps, bool(flags.get(EXPERIMENTAL.name, False))),
            lambda caps, obj: device.DawnDevice(caps, None, device=obj), _tick)

# WebGPU through Dawn and Tint in-process, ranked just below webgpu (wgpu-native, 10), which
# remains the default WebGPU host where both see the same adapter.
INFO = BackendInfo(probe.NAME, 8, probe.probe, _open)


def _shim_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")


def _shim(a: argparse.Namespace, spec: AttentionSpec | None) -> int:
    try:
        path = vkshim.build(force=a.force)
    except RuntimeError as exc:
        print(f"vk-shim: {exc}")
        return 1
    print(f"vk-shim: {path} (lavapipe: {vkshim.lavapipe_manifest()})")
    return 0


VK_SHIM = attnreg.Command(
    "vk-shim", "build the pass-through Vulkan ICD that lets Dawn use Debian 12's lavapipe "
    "(gcc, libvulkan-dev)", _shim_options, _shim)


attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(kernels.declare)
attnreg_register_rules = registers(lambda: [
    wrules.block_skip(probe.NAME), wrules.decode_staging(probe.NAME),
    wrules.decode_short_splits(probe.NAME),
    wrules.matrix_prefill_rows(probe.NAME), wrules.sliced_prefill(probe.NAME),
    wrules.fit_tiles(probe.NAME), wrules.step_in_tile(probe.NAME), wrules.matrix_prefill(probe.NAME)])
attnreg_register_flags = registers(lambda: [EXPERIMENTAL])
attnreg_register_interop = registers(lambda: [HOST.interop()])
attnreg_register_commands = registers(lambda: [VK_SHIM])
