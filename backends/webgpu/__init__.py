"""WebGPU backend (wgpu-py / wgpu-native): flash prefill, split-KV decode and the reduce.

Modules, one concern each (the same names as every GPU backend):
  plugin    the attnreg hookimpls (backend, kernels, rules)
  probe     adapters -> DeviceCaps (features shader-f16 / subgroups / timestamp-query, limits)
  kernels   the kernel variants as data, and the constants each derives from (spec, params)
  mma       the matrix-unit variants (flag matrix_units): the prefill on subgroup matrices
  rules     this backend's routing rules (tile fitting, block skipping, the unfused crossover)
  program   the one WGSL program builder: WGSL, bindings and grid of a plan stage, for every
            WebGPU host (this one, the browser)
  device    one wgpu device per adapter, process-wide, with its pipeline cache
  runtime   a Session's launches: bind groups prepared once, one encoder and one submit
  memory    a Session's buffers: DeviceTensors, staging, read-back, the copy-bandwidth roof
"""
