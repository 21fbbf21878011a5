"""The scalar WGSL prefill's sliced QK (qk_layout "sliced", kv_stage "f32"): a row group's lanes
split the head dimension and reduce-scatter their partial dots by shuffles. Against the float64
reference on lavapipe through wgpu-native and Dawn, with the features the logits, the masks and
the output touch; and the rule that picks it on NVIDIA."""

from __future__ import annotations

from typing import Any

import pytest

import attnreg
from attnreg.profiles import profiles
from backends.webgpu import rules as wrules
from tests.support import check_close, make_tensors, require_devices

STAGED = {"kv_staging": "workgroup", "q_tile": 16, "kv_tile": 16}
# lavapipe runs 8-lane subgroups (its adapters report 4-128), so row_lanes 8 is one row group
# a subgroup, 4 interleaves two row groups in each (lanes n and n^1 in different groups), and
# 16 is wider than a subgroup: the fallback, each lane its own keys with q read from memory.
# (A wrong reduce-scatter fails the first two and not the third: checked by breaking it.)
FORMS: dict[str, dict[str, Any]] = {
    "sliced-f32": {**STAGED, "qk_layout": "sliced", "kv_stage": "f32", "row_lanes": 8},
    "interleaved-native": {**STAGED, "qk_layout": "sliced", "kv_stage": "native",
                           "row_lanes": 4, "rows_per_thread": 1},
    "fallback": {**STAGED, "qk_layout": "sliced", "kv_stage": "f32", "row_lanes": 16,
                 "q_tile": 32},
    "keys-f32": {**STAGED, "kv_stage": "f32"},
}
SHORT = {"float16": "f16", "float32": "f32", "bfloat16": "bf16"}
# (head size, dtype, features): head 80 has slices of unequal length (20 vec4s over 8 lanes),
# head 32 fewer vec4s (8) than the fallback's row groups have lanes (16)
SPECS: list[tuple[int, str, dict[str, Any]]] = [
    (128, "float16", {"return_lse": True}),
    (80, "float16", {"softcap": 30.0}),
    (64, "float32", {"bias": True, "local_window": 40}),
    (128, "bfloat16", {"alibi_max_bias": 8.0, "head_sink": True}),
    (64, "float16", {"causal": False, "local_window": 20, "right_window": 10,
                     "q_layout": "BSNH", "kv_dtype": "int8"}),
    (32, "float16", {"seqlens_k": True, "kv_capacity": 96}),
]


def _kernel(backend: str, dtype: str) -> str:
    return f"{backend}.prefill.{SHORT[dtype]}.sg"


def _spec(head: int, dtype: str, extra: dict[str, Any]) -> attnreg.AttentionSpec:
    return attnreg.AttentionSpec(**{"batch": 2, "seq_len": 45, "past_len": 11, "num_heads": 4,
                                    "kv_num_heads": 2, "head_size": head, "dtype": dtype,
                                    "causal": True, **extra})


@pytest.mark.parametrize("backend", ["webgpu", "dawn"])
def test_sliced_prefill_matches_the_reference(backend):
    require_devices(backend)
    forms = FORMS if backend == "webgpu" else {k: FORMS[k] for k in ("sliced-f32", "fallback")}
    with attnreg.Session(backend=backend) as s:
        for head, dtype, extra in SPECS:
            spec = _spec(head, dtype, extra)
            t = make_tensors(spec, 3, lengths=[70, 56] if spec.seqlens_k else None)
            for name, params in forms.items():
                got = s.run(spec, t, kernel=_kernel(backend, dtype), params=params)
                check_close(spec, got, t, what=f"{backend} {name} head {head} {dtype} {extra}")


PREFILL = attnreg.AttentionSpec(seq_len=2048, past_len=0, num_heads=32, kv_num_heads=8,
                                head_size=128, dtype="float16", causal=True)


@pytest.mark.parametrize("seq", [wrules.SLICED_MIN_SEQ, 512, 2048])
def test_rule_picks_the_sliced_prefill_on_nvidia(seq):
    spec = attnreg.AttentionSpec(**{**PREFILL.__dict__, "seq_len": seq})
    caps = profiles()["nvidia-h100"]
    plan = attnreg.registry.get().plan(spec, caps=caps)
    p = plan.params
    assert plan.kernel == "webgpu.prefill.f16.sg"
    assert (p["qk_layout"], p["kv_stage"], p["row_lanes"], p["q_tile"], p["kv_tile"],
            p["max_k_step"]) == ("sliced", "f32", 8, 64, 32, 16)
    k = attnreg.registry.get().kernel(plan.kernel)
    assert k.storage_need(spec, p) <= caps.limit("workgroup_storage")


@pytest.mark.parametrize("profile,spec,user", [
    ("lavapipe", PREFILL, None),                                      # not NVIDIA
    ("nvidia-h100", attnreg.AttentionSpec(seq_len=512, num_heads=8, head_size=256,
                                          dtype="float16", causal=True), None),  # head > 128
    ("nvidia-h100", PREFILL, {"row_lanes": 16}),                       # the user's tiles
    ("nvidia-h100", PREFILL.replace(seq_len=wrules.SLICED_MIN_SEQ - 1), None),  # short prompt
])
def test_rule_leaves_the_keys_layout_elsewhere(profile, spec, user):
    plan = attnreg.registry.get().plan(spec, caps=profiles()[profile], params=user)
    assert plan.params.get("qk_layout", "keys") == "keys"
    fired = [r.split(":")[0] for r in attnreg.explain(spec, caps=profiles()[profile],
                                                       params=user).rules]
    assert "webgpu_sliced_prefill_nvidia" not in fired


def test_rule_says_what_measured_it():
    assert wrules.SLICED.measured == (wrules.SLICED_PREFILL_MEASURED,)
