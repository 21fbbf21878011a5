"""The dawn backend plugin: hookimpls only; the work lives in the sibling modules."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import attnreg
from attnreg import vkshim
from attnreg.backends.webgpu import rules as wrules
from attnreg.backends.webgpu.runtime import WebGpuRuntime
from attnreg.caps import DeviceCaps
from attnreg.flags import Flag
from attnreg.rules import Rule
from attnreg.spec import AttentionSpec

from . import device, kernels, probe


class DawnBackend:
    """WebGPU through Dawn and Tint in-process. Ranked just below backends.webgpu (wgpu-native),
    which remains the default WebGPU host where both see the same adapter."""

    name = probe.NAME
    priority = 8

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps, flags: Mapping[str, Any] | None = None) -> WebGpuRuntime:
        """A Session's runtime; with flag experimental_features, on the device that also
        requests Dawn's experimental features (a separate device: tensors of the two never mix)."""
        experimental = bool((flags or {}).get(EXPERIMENTAL.name, False))
        return WebGpuRuntime(caps, device.get(caps, experimental))


EXPERIMENTAL = Flag(
    "experimental_features", bool, False,
    "Let Dawn devices use Dawn's experimental WebGPU features "
    "(chromium-experimental-subgroup-matrix); off, nothing experimental is requested.")


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


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(DawnBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare():
        register(k)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    for rule in (wrules.block_skip(probe.NAME), wrules.fit_tiles(probe.NAME),
                 wrules.step_in_tile(probe.NAME)):
        register(rule)


@attnreg.hookimpl
def attnreg_register_flags(register: Callable[[Flag], None]) -> None:
    register(EXPERIMENTAL)


@attnreg.hookimpl
def attnreg_register_commands(register: Callable[[attnreg.Command], None]) -> None:
    register(VK_SHIM)
