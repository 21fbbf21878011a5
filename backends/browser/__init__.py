"""The browser backend: the WebGPU kernels run inside headless Chromium (Dawn + Tint).

Besides the usual plugin, probe, kernels and runtime (the programs are
backends/webgpu/program.py's, in Tint's dialect), its modules run the browser process, the
local page server, the request / reply channel to the page and its binary framing, and
``attnreg export-wgsl``; docs/architecture.md maps each one.
"""
