"""Dawn backend (wgpudawn: Chrome's WebGPU engine, Dawn with the Tint compiler, in-process):
the WGSL programs of backends.webgpu, hosted on a second implementation of WebGPU.

Modules, one concern each (the same names as every GPU backend):
  plugin    the attnreg hookimpls (backend, kernels, rules, flags, the vk-shim command)
  probe     Dawn's adapters -> DeviceCaps (features, limits, subgroup sizes, subgroup-matrix
            configs, the toggles in force); a child process checks Dawn first
  toggles   the Dawn toggles set, as data, each with why and what decides it
  kernels   backends.webgpu's kernel declarations re-homed as dawn.*
  device    one Dawn device per adapter: webgpu's GpuDevice with wgpudawn and Tint
The runtime and memory are backends.webgpu's (WebGpuRuntime with a DawnDevice); programs come
from backends/webgpu/program.py in its TINT dialect, as for the browser.
"""
