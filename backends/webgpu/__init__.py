"""WebGPU backend (wgpu-py): adapter probing, WGSL pipelines, split-KV and flash prefill.

Modules, one concern each:
  probe     adapters -> DeviceCaps (features shader-f16 / subgroups / timestamp-query, limits)
  kernels   the kernel variants as data, and the constants each derives from (spec, params)
  source    WGSL assembly: generated prefix (dtype alias, constants, Params) + shaders/*.wgsl
  device    one wgpu device per adapter, process-wide, with its pipeline cache
  runtime   a Session's buffers and bind groups; one encoder and one submit per run
  plugin    the attnreg hookimpls (backend, kernels, the tile-fitting rule)
  cases     the conformance cases (tests, and ``python3 -m backends.webgpu.cases`` anywhere)
  bench     timing and tuning sweeps (``python3 -m backends.webgpu.bench``)
"""
