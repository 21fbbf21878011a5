"""Routing pinned for real adapters we do not have: each stored profile x (decode L=2048,
whisper S=4 T=1500, prefill S=512), with and without its vendor opt-in flags. A change to
a rule or a kernel declaration that moves any of these shows up here, on purpose."""

from __future__ import annotations

from typing import Any

import pytest

import attnreg

WORK = {
    "decode": attnreg.AttentionSpec(batch=1, seq_len=1, past_len=2047, num_heads=32,
                                    kv_num_heads=8, head_size=128, dtype="float16"),
    "whisper": attnreg.AttentionSpec(batch=1, seq_len=4, past_len=1496, num_heads=8,
                                     kv_num_heads=8, head_size=64, dtype="float16", causal=False),
    "prefill": attnreg.AttentionSpec(batch=1, seq_len=512, past_len=0, num_heads=32,
                                     kv_num_heads=8, head_size=128, dtype="float16"),
}
PINNED_KEYS = ("m_tile", "n_splits", "max_k_step", "kv_staging", "out_tile", "q_tile")

# (profile, opt-in flag or "", workload, kernel, params)
PINS: list[tuple[str, str, str, str, dict[str, Any]]] = [
    ("apple-m4-max", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 19}),
    ("apple-m4-max", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 19}),
    ("apple-m4-max", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("apple-m4-max", "apple_tuned_flash", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 19}),
    ("apple-m4-max", "apple_tuned_flash", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 19}),
    ("apple-m4-max", "apple_tuned_flash", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 64, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("apple-m1-pro", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 8}),
    ("apple-m1-pro", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 8}),
    ("apple-m1-pro", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("apple-m1-pro", "apple_tuned_flash", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 8}),
    ("apple-m1-pro", "apple_tuned_flash", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 8}),
    ("apple-m1-pro", "apple_tuned_flash", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 64, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("nvidia-rtx-2000-ada", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 12}),
    ("nvidia-rtx-2000-ada", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 12}),
    ("nvidia-rtx-2000-ada", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 64, 'max_k_step': 16, 'kv_staging': 'workgroup', 'out_tile': 'registers'}),
    ("nvidia-h100", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 64}),
    ("nvidia-h100", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 47}),
    ("nvidia-h100", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 64, 'max_k_step': 16, 'kv_staging': 'workgroup', 'out_tile': 'registers'}),
    ("intel-meteor-lake", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 4}),
    ("intel-meteor-lake", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 4}),
    ("intel-meteor-lake", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("intel-tiger-lake", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 3}),
    ("intel-tiger-lake", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 3}),
    ("intel-tiger-lake", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("qualcomm-adreno-x1", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 3}),
    ("qualcomm-adreno-x1", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 3}),
    ("qualcomm-adreno-x1", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 32, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'half_workgroup'}),
    ("lavapipe", "", "decode", "webgpu.decode_partial.f16.m1", {'kv_staging': 'direct', 'm_tile': 1, 'n_splits': 1}),
    ("lavapipe", "", "whisper", "webgpu.decode_partial.f16.m4", {'kv_staging': 'workgroup', 'm_tile': 4, 'n_splits': 1}),
    ("lavapipe", "", "prefill", "webgpu.prefill.f16.sg", {'q_tile': 4, 'max_k_step': 32, 'kv_staging': 'direct', 'out_tile': 'registers'}),
    ("pocl", "", "decode", "opencl.decode_fused.f16.m1", {'m_tile': 1, 'n_splits': 1}),
    ("pocl", "", "whisper", "opencl.decode_fused.f16.m4", {'m_tile': 4, 'n_splits': 1}),
    ("pocl", "", "prefill", "opencl.decode_fused.f16.m4", {'m_tile': 4, 'n_splits': 1}),
]


@pytest.mark.parametrize("pin", PINS, ids=[f"{p}-{f or 'noflag'}-{w}" for p, f, w, _, _ in PINS])
def test_profile_plan_is_pinned(pin: tuple[str, str, str, str, dict[str, Any]]) -> None:
    profile, flag, work, kernel, params = pin
    plan = attnreg.explain(WORK[work], caps=attnreg.profile(profile),
                           flags={flag: True} if flag else None)
    got = {k: v for k, v in plan.params.items() if k in PINNED_KEYS}
    assert (plan.kernel, got) == (kernel, params), plan.explain()


def test_every_profile_and_workload_is_pinned() -> None:
    have = {(p, w) for p, _, w, _, _ in PINS}
    assert have == {(p, w) for p in attnreg.profiles() for w in WORK}


def test_vendor_rules_fire_only_where_they_apply() -> None:
    prefill = WORK["prefill"]
    apple = attnreg.explain(prefill, caps=attnreg.profile("apple-m4-max"),
                            flags={"apple_tuned_flash": True})
    assert any(r.startswith("apple_tuned_max_k_step") for r in apple.rules)
    nvidia = attnreg.explain(prefill, caps=attnreg.profile("nvidia-h100"),
                             flags={"apple_tuned_flash": True})
    assert "apple_tuned_flash" in nvidia.ignored_flags
    assert not any(r.startswith("apple_tuned") for r in nvidia.rules)
    assert any(r.startswith("nvidia_kv_in_workgroup_memory") for r in nvidia.rules)
    qc = attnreg.explain(prefill, caps=attnreg.profile("qualcomm-adreno-x1"))
    assert any(r.startswith("qualcomm_half_out_tile") for r in qc.rules)
    cpu = attnreg.explain(prefill, caps=attnreg.profile("lavapipe"))
    assert any(r.startswith("cpu_small_tiles") for r in cpu.rules)


def test_explain_is_deterministic_and_touches_no_device() -> None:
    caps = attnreg.profile("apple-m4-max")
    a = attnreg.explain(WORK["prefill"], caps=caps).explain()
    b = attnreg.explain(WORK["prefill"], caps=caps).explain()
    assert a == b
    assert "Apple M4 Max" in a and "rules fired:" in a
