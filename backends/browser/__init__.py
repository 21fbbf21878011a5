"""The browser backend: the WebGPU kernels run inside headless Chromium (Dawn + Tint).

Modules, one concern each: chromium (the browser process), server (the local page server),
host (one browser + page, a request/reply channel), wire (the binary message framing),
stages (a plan's specialised WGSL, bindings and grid, from backends.webgpu), probe, kernels,
runtime, plugin, export (``attnreg export-wgsl``). The page itself is page.js.
"""
