"""ONNX opset 25's Attention windows (``left_window_size`` / ``right_window_size``) through
attnreg.integrations.onnx: the mapping rule of its docstring (local_window = left + 1,
right_window = right, at ONNX's positions i + offset), against the onnx package's own
reference evaluator on nodes built here (every cache mode, with and without is_causal and
masks) on the reference backend and the GPU backends, and ONNX's own window node tests
(generated from onnx.backend.test.case, the wheel ships no data) on the reference backend.
No onnxruntime needed."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import attnreg  # noqa: E402
from attnreg.integrations.onnx import run_node, spec_from_node  # noqa: E402
from tests.support import require_devices  # noqa: E402

NAMES = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
OUT = ("Y", "present_key", "present_value")


def _node(feeds: dict[str, np.ndarray], n_out: int = 1, **attrs: Any) -> Any:
    inputs = [n if n in feeds else "" for n in NAMES]
    while inputs and not inputs[-1]:
        inputs.pop()
    return helper.make_node("Attention", inputs, list(OUT[:n_out]), **attrs)


def _onnx_outputs(node: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX's own reference implementation of the node (opset 25)."""
    def info(name: str, x: np.ndarray | None = None) -> Any:
        elem = TensorProto.FLOAT if x is None else helper.np_dtype_to_tensor_dtype(x.dtype)
        return helper.make_tensor_value_info(name, elem, None if x is None else x.shape)

    graph = helper.make_graph([node], "g", [info(n, feeds[n]) for n in node.input if n],
                              [info(n) for n in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    return list(ReferenceEvaluator(model).run(None, {n: feeds[n] for n in node.input if n}))


def _case(mode: str, causal: bool, left: int, right: int, mask: str, seed: int
          ) -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    b, nq, nkv, h, s = 2, 4, 2, 16, 5
    t = {"self": s, "cross": 9, "past": 3, "nonpad": 12}[mode]

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    feeds = {"Q": r(b, nq, s, h), "K": r(b, nkv, t, h), "V": r(b, nkv, t, h)}
    n_out = 1
    if mode == "past":
        feeds.update(past_key=r(b, nkv, 6, h), past_value=r(b, nkv, 6, h))
        n_out = 3
    if mode == "nonpad":
        feeds["nonpad_kv_seqlen"] = np.array([12, 7], np.int64)
    total = t + (6 if mode == "past" else 0)
    if mask == "bool":
        feeds["attn_mask"] = rng.random((s, total)) < 0.8
    elif mask == "float":
        feeds["attn_mask"] = r(b, 1, s, total)
    attrs = {"left_window_size": left, "right_window_size": right}
    if causal:
        attrs["is_causal"] = 1
    return _node(feeds, n_out, **attrs), feeds


# (mode, is_causal, left_window_size, right_window_size, attn_mask)
CASES = [
    ("self", False, 1, 2, "none"),          # ONNX's positions are attnreg's: spec fields
    ("self", False, 0, 0, "bool"),          # the row's own key only
    ("self", False, -1, 1, "float"),
    ("self", True, 2, 3, "none"),           # causal: the right side changes nothing
    ("nonpad", False, 2, 1, "bool"),        # per-batch offsets nonpad - S: spec fields
    ("nonpad", True, 3, -1, "float"),
    ("past", False, 2, 0, "none"),          # offset = past (6) != 9 - 5: a -inf bias
    ("past", True, 1, 1, "bool"),
    ("cross", False, 1, 2, "none"),         # offset 0 with 9 keys: top-left, a -inf bias
    ("cross", False, 2**40, 2**40, "none"),  # beyond every key: no bound
]


@pytest.mark.parametrize("backend", ["reference", "webgpu", "opencl"])
def test_windows_match_onnx_reference(backend: str) -> None:
    if backend != "reference":
        require_devices(backend)
    with attnreg.Session(backend=backend) as session:
        for i, case in enumerate(CASES):
            node, feeds = _case(*case, seed=i)
            want = _onnx_outputs(node, feeds)
            got = run_node(node, [feeds.get(n) for n in NAMES], session=session)
            for g, w in zip(got, want):
                assert g is not None
                np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=f"{case}")


def test_aligned_windows_become_spec_fields() -> None:
    """local_window = left + 1 (attnreg counts the row's own key), right_window = right;
    -1 and bounds past every key are none; the bias appears only for ONNX's other offsets."""
    for case, lw, rw in ((CASES[0], 2, 2), (CASES[1], 1, 0), (CASES[2], -1, 1),
                         (CASES[3], 3, 3), (CASES[4], 3, 1), (CASES[9], -1, -1)):
        node, feeds = _case(*case, seed=0)
        spec, how = spec_from_node(node, feeds)
        assert (spec.local_window, spec.right_window) == (lw, rw), case
        assert spec.bias == (case[4] != "none") and spec.causal == case[1], case
    for case in (CASES[6], CASES[8]):
        spec, how = spec_from_node(*_case(*case, seed=0))
        assert spec.bias and (spec.local_window, spec.right_window) == (-1, -1)
        assert any("windows at positions i + offset" in r for r in how.rules), how.rules


@pytest.mark.parametrize("attr", ["left_window_size", "right_window_size"])
def test_window_below_minus_one_is_refused(attr: str) -> None:
    node, feeds = _case("self", False, 1, 1, "none", 0)
    node = _node(feeds, **{attr: -2})
    with pytest.raises(attnreg.SpecError) as info:
        spec_from_node(node, feeds)
    assert attr in info.value.field and "-1" in str(info.value)


def _onnx_window_tests() -> list[Any]:
    import onnx.backend.test.case.node as nd
    nd._TargetOpType = "Attention"
    importlib.import_module("onnx.backend.test.case.node.attention")
    return [c for c in nd._NodeTestCases
            if "window" in c.name and not c.name.endswith("_expanded")]


def test_onnx_node_tests_of_windows() -> None:
    """ONNX's own Attention window tests (opset 25) pin the rule: each passes on the
    reference backend, or asks for qk_matmul_output and is refused by name."""
    cases = _onnx_window_tests()
    assert len(cases) >= 11, [c.name for c in cases]
    refused = []
    for c in cases:
        node = c.model.graph.node[0]
        inputs, outputs = c.data_sets[0]
        given: list[Any] = [None] * len(node.input)
        named = [i for i, n in enumerate(node.input) if n]
        for i, x in zip(named, inputs):
            given[i] = x
        if len(node.output) > 3 and node.output[3]:
            with pytest.raises(attnreg.SpecError, match="qk_matmul_output"):
                run_node(node, given, backend="reference")
            refused.append(c.name)
            continue
        got = run_node(node, given, backend="reference")
        for g, w in zip(got, outputs):
            np.testing.assert_allclose(g, w, atol=2e-5 if w.dtype == np.float32 else 4e-3,
                                       rtol=1e-4 if w.dtype == np.float32 else 4e-3,
                                       err_msg=c.name)
    assert len(refused) <= 1, refused
