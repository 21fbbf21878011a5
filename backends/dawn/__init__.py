"""Dawn backend (wgpudawn: Chrome's WebGPU engine, Dawn with the Tint compiler, in-process):
the WGSL programs of backends.webgpu, hosted on a second implementation of WebGPU.

It has no runtime or memory modules of its own: those are backends.webgpu's (WebGpuRuntime
with a DawnDevice), and programs come from backends/webgpu/program.py in its TINT dialect,
as for the browser.
docs/architecture.md maps each module; docs/dawn.md explains the toggles and the Vulkan shim.
"""
