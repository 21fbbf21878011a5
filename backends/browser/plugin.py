"""The browser backend plugin: the backend as data and its hookimpls; the work lives in the
sibling modules."""

from __future__ import annotations

import argparse

import attnreg
from attnreg.backends.webgpu.rules import decode_staging, fit_tiles
from attnreg.hookspecs import BackendInfo, registers
from attnreg.spec import AttentionSpec

from . import kernels, probe
from .runtime import BrowserRuntime

# WebGPU in headless Chromium, ranked below webgpu (10) and opencl (5), above reference
# (-100): a CPU adapter behind a browser is for proving portability, not for speed.
INFO = BackendInfo(probe.NAME, 0, probe.probe, lambda caps, flags: BrowserRuntime(caps))


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


attnreg_register_backends = registers(lambda: [INFO])
attnreg_register_kernels = registers(kernels.declare)
attnreg_register_rules = registers(lambda: [decode_staging(probe.NAME),
                                            fit_tiles(probe.NAME)])
attnreg_register_commands = registers(lambda: [EXPORT_WGSL])
