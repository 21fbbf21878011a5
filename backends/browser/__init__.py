"""The browser backend: the WebGPU kernels run inside headless Chromium (Dawn + Tint).

Modules, one concern each: plugin, probe, kernels, runtime (the backend's usual rooms; the
programs are backends/webgpu/program.py's, in Tint's dialect), chromium (the browser
process), server (the local page server), host (one browser + page, a request/reply
channel), wire (the binary message framing), export (``attnreg export-wgsl``, a command
this plugin registers). The page itself is page.js.
"""
