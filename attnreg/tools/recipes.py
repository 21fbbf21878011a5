"""The contract's features (docs/contract.md) as input recipes: one case per feature for a
backend's own case list and for the covering conformance cells (cases.py), and the block-diagonal
document masks that block-skipping kernels are tested with."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..spec import AttentionSpec

# A contract feature as an input recipe: (tag, spec changes, make_tensors keywords plus
# ``stored`` / ``docs`` / ``doc_values``, whether query row 0 is fully masked). ``stored``
# names tensors held in the other dtypes the checks accept for them (tensors.STORED_AS: the
# spec's dtype for bias and head_sink), one cell per such dtype (cells.storages).
Feature = tuple[str, dict[str, Any], dict[str, Any], bool]


def contract_features(b: int, nq: int, s: int, c: int) -> list[Feature]:
    """One case per contract feature (docs/contract.md) for a backend's own case list: (tag, spec
    changes, make_tensors keywords (+ ``stored``), whether query row 0 is fully masked). b, nq, s,
    c are the batch, query heads, query rows and KV capacity, for the broadcast bias shapes."""
    return [
        ("plain", {}, {}, False),
        ("noncausal", {"causal": False}, {}, False),
        ("bias", {"bias": True}, {}, False),
        ("bias-bcast-b", {"bias": True}, {"bias_shape": (1, nq, s, c)}, False),
        ("bias-bcast-h", {"bias": True}, {"bias_shape": (b, 1, s, c)}, False),
        ("bias-bcast-s", {"bias": True, "causal": False}, {"bias_shape": (b, nq, 1, c)}, False),
        ("bias-masked", {"bias": True}, {"mask_frac": 0.3}, False),
        ("masked-rows-lse", {"bias": True, "return_lse": True}, {}, True),
        ("seqlens-capacity", {"seqlens_k": True, "kv_capacity": c + 13}, {}, False),
        ("capacity", {"kv_capacity": c + 9}, {}, False),
        # two-sided (docs/contract.md "Every head size, two-sided windows"): the random shapes
        # meet both window edges, long totals included; the causal left window is in "all" and the
        # feature cells
        ("window2", {"local_window": 5, "right_window": 2, "causal": False}, {}, False),
        ("softcap", {"softcap": 1.5}, {}, False),
        ("alibi", {"alibi_max_bias": 8.0}, {}, False),
        ("alibi-noncausal", {"alibi_max_bias": 8.0, "causal": False}, {}, False),
        ("sink-lse", {"head_sink": True, "return_lse": True}, {}, False),
        ("sink-masked-rows", {"head_sink": True, "bias": True, "return_lse": True}, {}, True),
        ("all", {"seqlens_k": True, "kv_capacity": c + 5, "softcap": 3.0, "alibi_max_bias": 4.0,
                 "local_window": 37, "right_window": 3, "head_sink": True, "return_lse": True,
                 "bias": True},
         # bias and head_sink in the spec's dtype here: "all" is the recipe every (kernel,
         # dtype) keeps in the quick matrix, and its own program on OpenCL (built per bias
         # dtype) is the one extra build this costs per kernel and dtype
         {"bias_shape": (1, nq, s, c + 5), "mask_frac": 0.1, "stored": ("bias", "head_sink")},
         False),
    ]


def document_features(b: int, nq: int, s: int, c: int) -> list[Feature]:
    """What a block-skipping kernel runs (it needs a bias): the bias features of
    contract_features, plus document masks (block-diagonal biases that leave whole KV blocks
    -inf, see doc_mask) with a shared zero bias, per-head values, and everything at once."""
    return [f for f in contract_features(b, nq, s, c) if f[1].get("bias")] + [
        ("docs-shared-zero", {"bias": True}, {"docs": 3, "bias_shape": (1, 1, s, c)}, False),
        ("docs-heads", {"bias": True, "causal": False}, {"docs": 4, "doc_values": True}, False),
        ("docs-everything", {"seqlens_k": True, "kv_capacity": c + 5, "softcap": 3.0,
                             "alibi_max_bias": 4.0, "head_sink": True, "return_lse": True,
                             "bias": True},
         {"docs": 2, "doc_values": True, "bias_shape": (1, nq, s, c + 5)}, False),
    ]


def doc_mask(spec: AttentionSpec, bias: np.ndarray, docs: int, keep_values: bool) -> np.ndarray:
    """A block-diagonal bias (packed sequences): query row i sees key j only if both lie in
    the same of ``docs`` equal documents of the key range; inside a document the bias is 0
    (or keeps its values), across documents -inf."""
    c = bias.shape[3]
    rows = spec.total_len - spec.seq_len + np.arange(bias.shape[2])
    same = (rows[:, None] * docs // c) == (np.arange(c)[None, :] * docs // c)
    inside = bias if keep_values else np.zeros_like(bias)
    return np.where(same[None, None], inside, -np.inf).astype(bias.dtype)
