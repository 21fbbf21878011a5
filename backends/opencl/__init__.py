"""OpenCL backend (pyopencl): the same kernel families in OpenCL C (kernels_cl/).

Its modules have the design's names, the same in every backend (plugin, probe, kernels,
rules, program, device, runtime, memory, and the extras tests/backends/test_layout.py
declares per concern: tiles, mma, quantize, the probe's device checks); docs/architecture.md
maps each one.
"""
