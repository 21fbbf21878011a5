"""WebGPU backend (wgpu-py / wgpu-native): flash prefill, split-KV decode and the reduce.

Its modules have the design's names, the same in every backend (plugin, probe, kernels,
rules, program, device, runtime, memory, and the extras tests/backends/test_layout.py
declares per concern: tiles, mma, quantize, wgsl_io); its program module is the one WGSL
program builder, whose programs the dawn and browser backends host too. docs/architecture.md
maps each module.
"""
