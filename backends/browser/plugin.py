"""The browser backend plugin: hookimpls only; the work lives in the sibling modules."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attnreg
from attnreg.backends.webgpu.rules import fit_tiles
from attnreg.caps import DeviceCaps
from attnreg.rules import Rule
from attnreg.spec import AttentionSpec

from . import kernels, probe
from .runtime import BrowserRuntime


class BrowserBackend:
    """WebGPU in headless Chromium. Ranked below backends.webgpu: a CPU adapter behind a
    browser is for proving portability, not for speed."""

    name = probe.NAME
    priority = 0            # below webgpu (10) and opencl (5); above reference (-100)

    def probe(self) -> list[DeviceCaps]:
        return probe.probe()

    def open(self, caps: DeviceCaps) -> BrowserRuntime:
        return BrowserRuntime(caps)


def _export_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--backend-caps", default="browser-profile", metavar="CAPS",
                   help="plan for: browser-profile (WebGPU default limits, the default), browser, "
                   "webgpu (the probed adapters), or a stored WebGPU profile name")
    p.add_argument("--check", action="store_true", help="also run the module in headless "
                   "Chromium against the float64 reference")


def _export(a: argparse.Namespace, spec: AttentionSpec | None) -> int:
    from .export import main  # the page server and Chromium only when the command runs

    assert spec is not None
    return main(a, spec)


EXPORT_WGSL = attnreg.Command(
    "export-wgsl", "write a plan's specialised WGSL and an ES module (attention.js) for a web app",
    _export_options, _export, takes_spec=True)


@attnreg.hookimpl
def attnreg_register_backends(register: Callable[[attnreg.Backend], None]) -> None:
    register(BrowserBackend())


@attnreg.hookimpl
def attnreg_register_kernels(register: Callable[[attnreg.KernelInfo], None]) -> None:
    for k in kernels.declare():
        register(k)


@attnreg.hookimpl
def attnreg_register_rules(register: Callable[[Rule], None]) -> None:
    register(fit_tiles(probe.NAME))


@attnreg.hookimpl
def attnreg_register_commands(register: Callable[[attnreg.Command], None]) -> None:
    register(EXPORT_WGSL)
