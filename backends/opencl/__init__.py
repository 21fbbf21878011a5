"""OpenCL backend: pyopencl probing, program build cache, enqueue (kernels in kernels_cl/)."""
