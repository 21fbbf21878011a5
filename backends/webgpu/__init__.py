"""WebGPU backend (wgpu-py / wgpu-native): flash prefill, split-KV decode and the reduce.

Its modules have the names every GPU backend uses for the same concerns (plugin, probe,
kernels, rules, program, device, runtime, memory); its program module is the one WGSL
program builder, whose programs the dawn and browser backends host too. docs/architecture.md
maps each module.
"""
