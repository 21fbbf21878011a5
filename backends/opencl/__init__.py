"""OpenCL backend (pyopencl): the same kernel families in OpenCL C (kernels_cl/).

Its modules have the names every GPU backend uses for the same concerns (plugin, probe,
kernels, rules, program, device, runtime, memory), plus the tensor-core tiles and the
device checks its probe runs; docs/architecture.md maps each one.
"""
