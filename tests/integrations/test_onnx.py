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


@pytest.mark.parametrize("seed", range(N_CASES))
def test_gqa_matches_onnxruntime(seed: int) -> None:
    check_gqa(seed)


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_gqa_right_padded_matches_onnxruntime(seed: int) -> None:
    check_gqa_padded(seed)


@pytest.mark.parametrize("seed", range(N_CASES))
def test_attention_matches_onnxruntime(seed: int) -> None:
    check_attention(seed)


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_attention_v_head_size_and_left_padding_match_onnxruntime(seed: int) -> None:
    check_attention(seed, model=True)


@pytest.mark.parametrize("seed", range(N_CASES))
def test_mha_matches_onnxruntime(seed: int) -> None:
    check_mha(seed)


@pytest.mark.parametrize("seed", range(N_MODEL_CASES))
def test_mha_v_head_size_and_left_padding_match_onnxruntime(seed: int) -> None:
    check_mha(seed, model=True)


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
