"""attnreg.integrations.onnx against onnxruntime's CPU EP: single-node models of the standard
Attention op and com.microsoft GroupQueryAttention / MultiHeadAttention, random cases from a
seeded RNG (tests/onnx_cases.py), compared within the contract tolerance of the dtype (never
attnreg with itself)."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from tests.onnx_attention_cases import check_attention, check_mha  # noqa: E402
from tests.onnx_cases import N_CASES, N_MODEL_CASES, check_gqa, check_gqa_padded  # noqa: E402
from tests.support import require_devices  # noqa: E402

# op -> (how many seeded cases, the check); "-model": the mappings onto seqlens_q (GQA's
# right-padded first prompts), v_head_size and kv_start (Attention / MHA left padding)
OPS = {
    "gqa": (N_CASES, check_gqa),
    "gqa-right-padded": (N_MODEL_CASES, check_gqa_padded),
    "attention": (N_CASES, check_attention),
    "attention-model": (N_MODEL_CASES, lambda seed: check_attention(seed, model=True)),
    "mha": (N_CASES, check_mha),
    "mha-model": (N_MODEL_CASES, lambda seed: check_mha(seed, model=True)),
}
RUNS = [(op, seed) for op, (n, _) in OPS.items() for seed in range(n)]


@pytest.mark.parametrize(("op", "seed"), RUNS, ids=[f"{op}-{seed}" for op, seed in RUNS])
def test_matches_onnxruntime(op: str, seed: int) -> None:
    OPS[op][1](seed)


# -- GPU backends (lavapipe, PoCL in CI) -----------------------------------------------------
@pytest.mark.parametrize("backend", ["webgpu", "opencl"])
def test_gpu_backends_match_onnxruntime(backend: str) -> None:
    require_devices(backend)
    # chosen to cover seqlens_k, kv_capacity (shared buffers), windows, sinks, rotary, softcap,
    # masks as biases, both q layouts, causal frontiers, float16 and a KV cache
    for seed in (0, 1, 3, 19):
        check_gqa(seed, backend)
    for seed in (3, 4, 5, 11):
        check_attention(seed, backend)
    for seed in (0, 3, 11, 22):
        check_mha(seed, backend)


@pytest.mark.parametrize("backend", ["webgpu", "opencl"])
def test_gpu_backends_model_fields_match_onnxruntime(backend: str) -> None:
    """The mappings onto seqlens_q, v_head_size and kv_start on a GPU backend."""
    require_devices(backend)
    # right-padded first prompts (window, f16), query_seqlens chunks (an idle entry; sinks,
    # softcap, f16); Attention / MHA with V head sizes != K's and left-padding masks
    for seed in (5, 18, 31):
        check_gqa_padded(seed, backend)
    for seed in (6, 14):
        check_attention(seed, backend, model=True)
    for seed in (4, 25):
        check_mha(seed, backend, model=True)
