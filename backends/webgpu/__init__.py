"""WebGPU backend (wgpu-py): adapter probing, WGSL pipelines, split-KV and flash prefill."""
