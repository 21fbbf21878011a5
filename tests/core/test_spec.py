"""Bad specs and bad tensors: every one is a SpecError that names the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnreg
from attnreg.tensors import check_tensors
from tests.support import make_tensors

OK = dict(batch=2, seq_len=2, past_len=6, num_heads=4, kv_num_heads=2, head_size=8)

BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("batch-zero", {"batch": 0}, "batch"),
    ("batch-float", {"batch": 2.0}, "batch"),
    ("batch-bool", {"batch": True}, "batch"),
    ("batch-str", {"batch": "2"}, "batch"),
    ("seq_len-zero", {"seq_len": 0}, "seq_len"),
    ("past_len-negative", {"past_len": -1}, "past_len"),
    ("num_heads-zero", {"num_heads": 0}, "num_heads"),
    ("kv_heads-not-divisor", {"num_heads": 6, "kv_num_heads": 4}, "kv_num_heads"),
    ("kv_heads-more-than-q", {"num_heads": 2, "kv_num_heads": 4}, "kv_num_heads"),
    ("head_size-negative", {"head_size": -8}, "head_size"),
    ("dtype-bf16-short", {"dtype": "bf16"}, "dtype"),
    ("kv_dtype-fp8", {"kv_dtype": "fp8"}, "kv_dtype"),
    ("kv_dtype-int4-head48", {"kv_dtype": "int4", "head_size": 48}, "kv_dtype"),
    ("dtype-numpy", {"dtype": np.float16}, "dtype"),
    ("q_layout", {"q_layout": "BHSD"}, "q_layout"),
    ("kv_layout", {"kv_layout": "bsnh"}, "kv_layout"),
    ("causal-int", {"causal": 1}, "causal"),
    ("scale-negative", {"scale": -0.5}, "scale"),
    ("scale-zero", {"scale": 0.0}, "scale"),
    ("scale-inf", {"scale": float("inf")}, "scale"),
    ("softcap-negative", {"softcap": -1.0}, "softcap"),
    ("softcap-nan", {"softcap": float("nan")}, "softcap"),
    ("window-below-minus-one", {"local_window": -5}, "local_window"),
    ("alibi-negative", {"alibi_max_bias": -8.0}, "alibi_max_bias"),
    ("capacity-too-small", {"kv_capacity": 7}, "kv_capacity"),
    ("unknown-field", {"heads": 4}, "heads"),
    ("bias-str", {"bias": "yes"}, "bias"),
]


@pytest.mark.parametrize("case", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec(case: tuple[str, dict[str, Any], str]) -> None:
    _, changes, field = case
    with pytest.raises(attnreg.SpecError) as info:
        attnreg.AttentionSpec(**{**OK, **changes})
    assert info.value.field == field
    assert field in str(info.value) and "expected" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_spec_is_frozen_and_derives_sizes() -> None:
    spec = attnreg.AttentionSpec(**OK, kv_capacity=16)
    assert (spec.total_len, spec.capacity, spec.group_size) == (8, 16, 2)
    assert spec.q_shape == (2, 2, 4, 8) and spec.kv_shape == (2, 2, 16, 8)
    assert spec.effective_scale == pytest.approx(8 ** -0.5)
    with pytest.raises(ValueError):
        spec.batch = 3  # type: ignore[misc]
    assert eval(repr(spec), {"AttentionSpec": attnreg.AttentionSpec}) == spec
    with pytest.raises(attnreg.SpecError, match="kv_capacity"):
        spec.replace(past_len=100)


def test_numpy_integers_are_exact_and_accepted() -> None:
    spec = attnreg.AttentionSpec(**{**OK, "batch": np.int64(2), "head_size": np.int32(8)})
    assert spec.batch == 2 and type(spec.batch) is int


FULL = dict(OK, bias=True, seqlens_k=True, head_sink=True, kv_capacity=10)


def _t(**changes: Any) -> tuple[attnreg.AttentionSpec, dict[str, Any]]:
    spec = attnreg.AttentionSpec(**FULL)
    t: dict[str, Any] = make_tensors(spec, seed=0, poison=False)
    t["seqlens_k"] = np.array([5, 10], np.int32)
    for k, v in changes.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v(t) if callable(v) else v
    return spec, t


BAD_TENSORS: list[tuple[str, dict[str, Any], str]] = [
    ("q-missing", {"q": None}, "tensors['q']"),
    ("unknown-tensor", {"mask": np.zeros(3)}, "tensors['mask']"),
    ("q-wrong-dtype", {"q": lambda t: t["q"].astype(np.float64)}, "tensors['q'].dtype"),
    ("q-wrong-shape", {"q": lambda t: t["q"][:, :1]}, "tensors['q'].shape"),
    ("q-other-layout", {"q": lambda t: t["q"].transpose(0, 2, 1, 3).copy()}, "tensors['q'].shape"),
    ("k-wrong-capacity", {"k": lambda t: t["k"][:, :, :8]}, "tensors['k'].shape"),
    ("v-f16-for-f32-spec", {"v": lambda t: t["v"].astype(np.float16)}, "tensors['v'].dtype"),
    ("k-not-array", {"k": [[1.0]]}, "tensors['k']"),
    ("seqlens-uint8", {"seqlens_k": np.array([5, 10], np.uint8)}, "tensors['seqlens_k'].dtype"),
    ("seqlens-int64-wraps", {"seqlens_k": np.array([5, 2**32 + 10], np.int64)},
     "tensors['seqlens_k'][1]"),
    ("seqlens-too-long", {"seqlens_k": np.array([5, 11], np.int32)}, "tensors['seqlens_k'][1]"),
    ("seqlens-below-seq-len", {"seqlens_k": np.array([1, 4], np.int32)}, "tensors['seqlens_k'][0]"),
    ("seqlens-wrong-shape", {"seqlens_k": np.array([5], np.int32)}, "tensors['seqlens_k'].shape"),
    ("seqlens-missing", {"seqlens_k": None}, "tensors['seqlens_k']"),
    ("bias-3d", {"bias": np.zeros((4, 2, 10), np.float32)}, "tensors['bias'].shape"),
    ("bias-short-keys", {"bias": np.zeros((2, 4, 2, 9), np.float32)}, "tensors['bias'].shape"),
    ("bias-bad-broadcast", {"bias": np.zeros((2, 3, 2, 10), np.float32)}, "tensors['bias'].shape"),
    ("bias-int", {"bias": np.zeros((2, 4, 2, 10), np.int32)}, "tensors['bias'].dtype"),
    ("sink-wrong-shape", {"head_sink": np.zeros(2, np.float32)}, "tensors['head_sink'].shape"),
    ("sink-f16", {"head_sink": np.zeros(4, np.float16)}, "tensors['head_sink'].dtype"),
    ("sink-nan", {"head_sink": np.full(4, np.nan, np.float32)}, "tensors['head_sink'][0]"),
    ("sink-inf", {"head_sink": np.array([0, 0, -np.inf, 0], np.float32)}, "tensors['head_sink'][2]"),
]


@pytest.mark.parametrize("case", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_bad_tensor(case: tuple[str, dict[str, Any], str]) -> None:
    _, changes, field = case
    spec, t = _t(**changes)
    with pytest.raises(attnreg.SpecError) as info:
        check_tensors(spec, t)
    assert info.value.field == field, str(info.value)
    assert "expected" in str(info.value)
    # run() validates before any planning or kernel launch
    with pytest.raises(attnreg.SpecError):
        attnreg.run(spec, t, backend="reference")


def test_tensor_for_disabled_feature_is_refused() -> None:
    spec = attnreg.AttentionSpec(**OK)
    t = make_tensors(spec, seed=0)
    t["bias"] = np.zeros((1, 1, 1, 8), np.float32)
    with pytest.raises(attnreg.SpecError, match=r"spec\.bias is False"):
        check_tensors(spec, t)


def test_fortran_and_strided_inputs_are_copied_not_refused() -> None:
    spec = attnreg.AttentionSpec(**OK)
    t = make_tensors(spec, seed=4)
    t2 = {"q": np.asfortranarray(t["q"]), "k": t["k"][..., ::1].copy(order="F"),
          "v": np.concatenate([t["v"], t["v"]], axis=-1)[..., ::2]}
    t2["v"][...] = t["v"]
    assert not t2["v"].flags.c_contiguous
    checked = check_tensors(spec, t2)
    assert all(a.flags.c_contiguous for a in checked.values())
    np.testing.assert_array_equal(attnreg.run(spec, t2, backend="reference"),
                                  attnreg.run(spec, t, backend="reference"))


def test_bad_run_arguments() -> None:
    spec = attnreg.AttentionSpec(**OK)
    t = make_tensors(spec, seed=0)
    with pytest.raises(attnreg.SpecError, match="backend"):
        attnreg.run(spec, t, backend="cuda")
    with pytest.raises(attnreg.SpecError, match="flags\\['nope'\\]"):
        attnreg.run(spec, t, backend="reference", flags={"nope": 1})
    with pytest.raises(attnreg.SpecError, match="flags\\['route'\\]"):
        attnreg.run(spec, t, backend="reference", flags={"route": "sideways"})
    with pytest.raises(attnreg.SpecError, match="kernel"):
        attnreg.run(spec, t, kernel="no.such.kernel")
    with pytest.raises(attnreg.SpecError, match="spec"):
        attnreg.run({"batch": 1}, t)  # type: ignore[arg-type]
    with pytest.raises(attnreg.SpecError, match="tensors"):
        attnreg.run(spec, [t["q"], t["k"], t["v"]])  # type: ignore[arg-type]


def test_merge_states_bad_inputs() -> None:
    o = np.zeros((2, 3, 8), np.float32)
    lse = np.zeros((2, 3), np.float32)
    for bad, field in [([], "states"), ([(o,)], "states[0]"), ([(o, lse[:, :2])], "states[0][1]"),
                       ([(o, lse), (o.astype(np.float64), lse)], "states[1]")]:
        with pytest.raises(attnreg.SpecError) as info:
            attnreg.merge_states(bad)
        assert info.value.field == field
