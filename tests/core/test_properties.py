"""Hypothesis: random specs inside each kernel's declared support, forced on every available
device, against the float64 reference. Failures shrink to a minimal spec, printed as Python.

Profiles: "ci" (default; few examples per kernel, derandomized so CI is reproducible) and
"dev" (HYPOTHESIS_PROFILE=dev: more, random examples).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import attnreg
from attnreg.kernel import KernelInfo
from attnreg.testing import compare, expected, make_tensors
from attnreg.tools import conformance as conf
from tests.support import HOST_BACKENDS

# ci: 2 examples per (kernel, device) pair: each example compiles its own programs (a few
# seconds on lavapipe), and the conformance matrix covers the axes systematically; the
# random draws are here to meet combinations nobody listed.
settings.register_profile("ci", max_examples=2, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICES = [d for d in attnreg.devices() if d.available]
# Pairs whose device has every feature the kernel needs (others are rejected by design and
# covered by the registry tests and ci/required_matrix.json).
# In CI (the ci profile) the pairs of the webgpu backend's hosts are left out: Dawn and the
# browser run the webgpu backend's WGSL (drawn here on lavapipe through webgpu), and each of
# their examples costs seconds of Tint compiles or Chromium round trips; their own cells and
# test modules cover them. The dev profile draws on every device.
_CI = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
PAIRS = [(k, d) for d in DEVICES for k in attnreg.kernels(d.backend) if k.features <= d.features
         and not (_CI and d.backend in HOST_BACKENDS)]
_SESSIONS: dict[str, attnreg.Session] = {}


@st.composite
def spec_for(draw: Any, k: KernelInfo) -> tuple[attnreg.AttentionSpec, dict[str, Any]]:
    sup = k.supports
    heads = [h for h in (8, 16, 32, 40, 64, 80, 96, 128, 256) if k.head_size_ok(h)]
    assume(heads)
    max_s = {"prefill": 40, "reduce": 5}.get(k.family, 6)
    if k.max_seq_len:
        max_s = min(max_s, k.max_seq_len)
    s = draw(st.integers(1, max_s))
    nkv = draw(st.integers(1, 2))
    g = draw(st.sampled_from([1, 2, 4, 7])) if "gqa" in sup else 1
    past = draw(st.integers(0, 200))
    extra = draw(st.integers(0, 20)) if "kv_capacity" in sup else 0
    fields: dict[str, Any] = dict(
        batch=draw(st.integers(1, 2)), seq_len=s, past_len=past, num_heads=nkv * g,
        kv_num_heads=nkv, head_size=draw(st.sampled_from(heads)),
        dtype=draw(st.sampled_from(sorted(k.dtypes))),
        q_layout=draw(st.sampled_from(sorted(k.q_layouts))),
        kv_layout=draw(st.sampled_from(sorted(k.kv_layouts))),
        causal=draw(st.booleans()) if "causal" in sup else False,
        kv_capacity=past + s + extra if extra else None)
    for name, feat, strat in (
            ("bias", "bias", st.booleans()), ("seqlens_k", "seqlens_k", st.booleans()),
            ("head_sink", "head_sink", st.booleans()), ("return_lse", "return_lse", st.booleans()),
            ("softcap", "softcap", st.sampled_from([0.0, 0.0, 2.0, 30.0])),
            ("local_window", "local_window", st.sampled_from([-1, -1, 1, 7, 64])),
            ("right_window", "right_window", st.sampled_from([-1, -1, 0, 2, 9])),
            ("alibi_max_bias", "alibi", st.sampled_from([0.0, 0.0, 8.0])),
            ("kv_start", "kv_start", st.booleans()), ("seqlens_q", "seqlens_q", st.booleans())):
        if feat in sup:
            fields[name] = draw(strat)
    if "v_head_size" in sup:
        fields["v_head_size"] = draw(st.sampled_from([None, *heads]))
    if fields["kv_layout"] == "paged":
        ps = draw(st.sampled_from([1, 5, 16]))
        cap = fields["kv_capacity"] or past + s
        fields["page_size"] = ps
        fields["num_pages"] = fields["batch"] * -(-cap // ps) + draw(st.integers(0, 3))
    spec = attnreg.AttentionSpec(**fields)
    recipe: dict[str, Any] = {"seed": draw(st.integers(0, 2**16))}
    if spec.seqlens_k:
        recipe["lengths"] = [draw(st.integers(s, spec.capacity)) for _ in range(spec.batch)]
    if spec.bias:
        recipe["bias_shape"] = tuple(draw(st.sampled_from([1, n])) for n in
                                     (spec.batch, spec.num_heads, spec.seq_len)) + (spec.capacity,)
        recipe["mask_frac"] = draw(st.sampled_from([0.0, 0.3, 1.0]))
    return spec, recipe


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{d.backend}-{d.slug}-{k.id}" for k, d in PAIRS])
def test_random_specs_match_reference(pair: tuple[KernelInfo, attnreg.DeviceCaps]) -> None:
    k, dev = pair
    s = _SESSIONS.get(dev.id) or _SESSIONS.setdefault(
        dev.id, attnreg.Session(backend=dev.backend, device=dev.id))

    @given(spec_for(k))
    def check(drawn: tuple[attnreg.AttentionSpec, dict[str, Any]]) -> None:
        spec, recipe = drawn
        assume(not k.not_supported_reasons(spec, dev))
        if k.params.get("block_skip"):
            assume(spec.bias)
        note(f"spec = {spec!r}; inputs = {recipe!r}")
        t = make_tensors(spec, **recipe)
        tol = k.tolerance[spec.dtype]
        if k.family == "reduce":
            from attnreg import reference as ref
            o_p, l_p = ref.partial_states(spec, t, 8)
            got = s.reduce_states(spec, o_p.astype(np.float32), l_p.astype(np.float32),
                                  t.get("head_sink"), seqlens_q=t.get("seqlens_q"),
                                  kernel=k.id)
        else:
            got = s.run(spec, t, kernel=k.id)
        _, problem = compare(spec, got, expected(spec, t), tol)
        assert not problem, problem

    check()


def test_conformance_cases_stay_inside_declared_support() -> None:
    """Every cell runs what its kernel declares; a head_padding cell asks for head sizes off
    the kernel's steps on purpose, and its kernel declares the sizes the registry pads to."""
    reg = attnreg.registry.get()
    for c in conf.cases(DEVICES, quick=True):
        k = reg.kernel(c.kernel)
        dev = next(d for d in DEVICES if d.id == c.device)
        spec = c.spec
        if c.feature == "head_padding":
            plan = reg.plan(spec, caps=dev, kernel=k.id, params=dict(c.params))
            assert plan.request == spec and plan.spec != spec, c.id
            spec = plan.spec
        assert not k.not_supported_reasons(spec, dev, dict(c.params)), c.id
