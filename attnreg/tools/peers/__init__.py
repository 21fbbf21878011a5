"""Comparison peers for `attnreg bench`: what users would run instead of attnreg.

Two optional peers, each computing the same contract math (docs/contract.md) for an
:class:`attnreg.AttentionSpec`, timed the way a real decode loop pays for it:

* :class:`OrtWebGPUAttention` -- ONNX Runtime's WebGPU execution provider (package
  ``onnxruntime-webgpu``, Dawn inside) running a one-node ``com.microsoft`` model:
  ``GroupQueryAttention`` for causal specs (static KV cache in ORT's shared past/present
  buffer mode, so the cache is never copied) and ``MultiHeadAttention`` with BNSH key/value
  (ORT's cross-attention form) for non-causal ones. Inputs, the KV cache and the output are
  bound once as WebGPU-device OrtValues through IO binding; a timed call is
  ``run_with_iobinding`` plus the smallest read-back that waits for the GPU (ORT's own
  ``synchronize_outputs`` returns before the GPU work ends on this EP).
* :class:`TorchSDPA` -- ``torch.nn.functional.scaled_dot_product_attention`` on CUDA when
  available, else CPU; tries each SDPA backend (cuDNN, flash, efficient, math) with both GQA
  strategies and keeps the fastest correct one, named in its label; GPU time per call from
  a CUDA graph of back-to-back calls replayed between two CUDA events (kernel time, no
  Python launch cost); on the CPU, wall clock, which the peer says.

Nothing here is imported at module import time beyond numpy and the standard library:
``onnxruntime``, ``onnx`` and ``torch`` are imported inside functions, and each peer says
why it is unusable through :func:`ort_webgpu_status` / :func:`torch_status` (``None`` when
usable) instead of raising.

Lavapipe: Dawn refuses Debian 12's Mesa 22.3 lavapipe. attnreg builds its own pass-through
Vulkan ICD (``attnreg vk-shim``, attnreg/vkshim.py; ci/bench_peers.sh and ci/setup.sh run it);
when it is built, no hardware GPU node exists and no other driver is named, this module swaps
it in for lavapipe in the loader's driver list before the first ORT WebGPU session. That is
safe for wgpu-py in the same process: the shim forwards to lavapipe unchanged (it only
reports two image-array features as present). It must happen before ORT's first WebGPU
session, because Dawn keeps the adapter list it found first for the life of the process.
``ATTNREG_VK_SHIM`` overrides: a path to an ICD json, or ``0`` for never.

Known peer defects (onnxruntime-webgpu 1.27.0; ``run()`` returns what ORT computed, callers
compare and print, never hide it; ``python -m attnreg.tools.peers --cases probes`` re-checks):
* lavapipe only: more than one new token (prefill, S=4 with past, the S=4 MHA) is wrong;
  single-token decode is right. The same cases are right on an NVIDIA H100.
* every device seen (lavapipe, H100): ``softcap`` is not applied as the contract (and ORT's
  own CPU EP) does, and batches with different ``seqlens_k`` are wrong; ORT's CPU EP gets
  both right on the same model and inputs, so the model is not at fault.
* NaN in the cache past a batch's valid length leaks into the output (0 * NaN), in ORT and
  in torch SDPA alike; the bench's inputs keep that memory finite, as a real cache does.
* f16 prefill S=2048 on the H100: 5 of 8.4M values just outside the f16 tolerance (7e-3).
"""


from __future__ import annotations

from .models import ORT_PACKAGE, ORT_PROVIDER, build_gqa_model, build_mha_model, ort_webgpu_supports
from .ort import OrtWebGPUAttention
from .run import bench_peers, format_table, main, median_us
from .status import ort_webgpu_status, statuses, torch_status
from .torch_sdpa import TorchSDPA, torch_supports
from .vulkan import ensure_vulkan_env, shim_path

__all__ = [
    "ORT_PACKAGE", "ORT_PROVIDER", "OrtWebGPUAttention", "TorchSDPA", "bench_peers",
    "build_gqa_model", "build_mha_model", "ensure_vulkan_env", "format_table", "main",
    "median_us", "ort_webgpu_status", "ort_webgpu_supports", "shim_path", "statuses",
    "torch_status", "torch_supports",
]
