"""OpenCL backend (pyopencl): the same kernel families in OpenCL C (kernels_cl/).

Modules, one concern each (the same names as every GPU backend):
  plugin    the attnreg hookimpls (backend, kernels, rules)
  probe     platforms and devices -> DeviceCaps (extensions, sub-groups, NVIDIA inline PTX)
  kernels   the kernel variants as data, and the block geometry each compiles with
  mma       the tensor-core prefill's primitive, builds, tile defaults and local memory
  rules     this backend's routing rules (block skipping, the unfused and two-launch routes)
  program   a family's source (signature from backends/ports.py), build options, grid and
            arguments
  device    one context per device and the process-wide program build cache
  runtime   a Session's launches: kernel objects prepared once per plan and buffers
  memory    a Session's buffers: DeviceTensors, the pool, parameter blocks, the roof
"""
