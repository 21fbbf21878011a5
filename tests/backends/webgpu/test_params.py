"""The prefill tunables the vendor rules set (max_k_step, kv_staging, out_tile, q_tile): each
value builds a different kernel, every value is correct on the local adapter, the choices
are declared for `attnreg tune`, and the plans per profile read as the rules say."""

from __future__ import annotations

import itertools

import pytest

import attnreg
from attnreg import rules
from attnreg.backends.webgpu import program as wprogram
from attnreg.backends.webgpu import tiles as wtiles
from attnreg.profiles import profiles
from tests.support import check_close, make_tensors, require_devices

KERNEL = "webgpu.prefill.{dt}.{red}"


@pytest.fixture(scope="module")
def session():
    require_devices("webgpu")
    with attnreg.Session(backend="webgpu") as s:
        yield s


def _wgsl(spec: attnreg.AttentionSpec, params: dict) -> str:
    p = {**wtiles.PREFILL_DEFAULTS, **params}
    return wprogram.source("prefill", spec, wtiles.prefill_consts(spec, p, 4), subgroups=True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("head_size", [8, 64, 128])
def test_every_value_changes_the_kernel(dtype, head_size):
    spec = attnreg.AttentionSpec(seq_len=64, past_len=0, head_size=head_size, dtype=dtype)
    for name, values in wtiles.PREFILL_CHOICES.items():
        for staging in wtiles.KV_STAGING:
            base = {"kv_staging": staging, "kv_tile": 64}
            texts = {v: _wgsl(spec, {**base, name: v}) for v in values}
            assert len(set(texts.values())) == len(values), (name, staging)


def test_choices_are_declared_for_tuning():
    k = attnreg.registry.get().kernel("webgpu.prefill.f16.sg")
    assert set(k.choices) == {"max_k_step", "kv_staging", "out_tile", "q_tile"}
    for name, values in k.choices.items():
        assert k.defaults[name] in values or name == "q_tile", name


# Every value of every tunable, on key counts that straddle steps of 8..64 keys (a path that
# drops keys 16-31 of a 32-key step fails here), with masks, seqlens, GQA and odd heads. The
# dtype and q_tile rotate over the sets (each set is one compiled kernel: lavapipe compiles
# take most of the time).
SWEEP = [dict(zip(("kv_staging", "out_tile", "max_k_step"), v)) for v in itertools.product(
    wtiles.KV_STAGING, wtiles.OUT_TILE, (8, 16, 32, 64))]
SWEEP = [{**p, "q_tile": (4, 16)[i % 2], "dtype": ("float16", "float32")[i // 2 % 2]}
         for i, p in enumerate(SWEEP)]


@pytest.mark.parametrize("params", SWEEP, ids=["-".join(str(v) for v in p.values()) for p in SWEEP])
def test_every_parameter_set_is_correct(session, params):
    params = dict(params)
    dtype = params.pop("dtype")
    spec = attnreg.AttentionSpec(batch=2, seq_len=21, past_len=58, num_heads=4, kv_num_heads=2,
                                 head_size=80 if dtype == "float16" else 64, dtype=dtype,
                                 causal=True, seqlens_k=True, kv_capacity=100, bias=True,
                                 local_window=70, return_lse=True)
    t = make_tensors(spec, 3, lengths=[95, 61], mask_frac=0.1)
    red = "sg" if "subgroups" in session.plan(spec).caps.features else "wgmem"
    kid = KERNEL.format(dt="f16" if dtype == "float16" else "f32", red=red)
    got = session.run(spec, t, kernel=kid, params={**params, "kv_tile": 32})
    check_close(spec, got, t, what=str(params))


def test_wgmem_variant_with_direct_and_half_tiles(session):
    spec = attnreg.AttentionSpec(seq_len=20, past_len=45, num_heads=2, kv_num_heads=1,
                                 head_size=128, dtype="float16", causal=True)
    t = make_tensors(spec, 4)
    for p in ({"kv_staging": "direct", "out_tile": "half_workgroup", "q_tile": 8},
              {"kv_staging": "workgroup", "out_tile": "half_workgroup", "q_tile": 8,
               "kv_tile": 16, "max_k_step": 8, "prefetch": 0}):
        check_close(spec, session.run(spec, t, kernel="webgpu.prefill.f16.wgmem", params=p), t)


PREFILL = attnreg.AttentionSpec(seq_len=512, past_len=0, num_heads=32, kv_num_heads=8,
                                head_size=128, dtype="float16", causal=True)
STEP = rules.default_max_k_step(PREFILL)


@pytest.mark.parametrize("profile,want", [
    ("nvidia-h100", {"kv_staging": "workgroup", "max_k_step": 16, "kv_tile": 32,
                     "qk_layout": "sliced"}),
    ("apple-m4-max", {"kv_staging": "direct", "max_k_step": STEP, "out_tile": "registers"}),
    ("qualcomm-adreno-x1", {"kv_staging": "direct", "out_tile": "half_workgroup"}),
    ("intel-meteor-lake", {"kv_staging": "direct", "out_tile": "registers"}),
    ("lavapipe", {"q_tile": 4, "kv_staging": "direct"}),
])
def test_profile_plans(profile, want):
    caps = profiles()[profile]
    plan = attnreg.registry.get().plan(PREFILL, caps=caps)
    assert plan.kernel == "webgpu.prefill.f16.sg"
    assert {k: plan.params[k] for k in want} == want
    k = attnreg.registry.get().kernel(plan.kernel)
    assert k.storage_need(PREFILL, plan.params) <= caps.limit("workgroup_storage")


def test_apple_flag_raises_the_step():
    reg = attnreg.registry.get()
    apple = profiles()["apple-m4-max"]
    base = reg.plan(PREFILL, caps=apple).params["max_k_step"]
    tuned = reg.plan(PREFILL, caps=apple, flags={"apple_tuned_flash": True})
    assert tuned.params["max_k_step"] == rules.default_max_k_step(PREFILL, rules.PRIVATE_BYTES)
    assert tuned.params["max_k_step"] > base
    intel = reg.plan(PREFILL, caps=profiles()["intel-meteor-lake"],
                     flags={"apple_tuned_flash": True})
    assert intel.params["max_k_step"] == base and "apple_tuned_flash" in intel.ignored_flags
