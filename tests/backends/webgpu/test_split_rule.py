"""The NVIDIA rule that lets a split of the scalar decode_partial hold one kv tile (the core
rule keeps four): the plans it changes, the ones it leaves, and what it never overrides (the
caller's split_size, a tuned one, other vendors). Plans only: no device is opened."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import attnreg
from attnreg import rules
from attnreg import tuned as tuning
from attnreg.profiles import profiles

RULE = "webgpu_decode_short_splits_nvidia"
# The bench's whisper case (8 heads, m_tile 4: 8 row groups) and GQA decodes.
WHISPER = attnreg.AttentionSpec(batch=1, seq_len=4, past_len=1496, num_heads=8, kv_num_heads=8,
                                head_size=64, dtype="float16", causal=False)


def _decode(length: int) -> attnreg.AttentionSpec:
    return attnreg.AttentionSpec(batch=1, seq_len=1, past_len=length - 1, num_heads=32,
                                 kv_num_heads=8, head_size=128, dtype="float16")


def _plan(spec: attnreg.AttentionSpec, profile: str = "nvidia-h100", **kw):
    return attnreg.registry.get().plan(spec, caps=profiles()[profile], **kw)


def _fired(plan) -> list[str]:
    return [r for r in plan.rules if r.startswith(RULE)]


def _core_size(plan, profile: str = "nvidia-h100") -> int:
    return rules.split_size(plan.spec, profiles()[profile], plan.params, {})["split_size"]


@pytest.mark.parametrize("spec", [WHISPER, _decode(2048)], ids=["whisper", "L2048"])
def test_short_caches_get_more_splits(spec):
    plan = _plan(spec)
    assert plan.kernel.startswith("webgpu.decode_partial.") and _fired(plan), plan.explain()
    tile, size = plan.params["kv_tile"], plan.params["split_size"]
    core = _core_size(plan)
    assert core == 4 * tile, core                 # the core rule's minimum held these back
    assert size % tile == 0 and tile <= size < core
    assert plan.params["n_splits"] == math.ceil(spec.capacity / size)
    assert plan.stage("reduce").params["n_splits"] == plan.params["n_splits"]
    assert plan.params["n_splits"] <= 64          # max_splits still caps them


@pytest.mark.parametrize("length", [8192, 32768])
def test_long_caches_keep_their_plans(length):
    plan = _plan(_decode(length))
    assert plan.params["split_size"] == _core_size(plan)
    assert plan.params["n_splits"] == 64


def test_the_callers_split_size_stands():
    plan = _plan(WHISPER, params={"split_size": 64})
    assert plan.params["split_size"] == 64 and not _fired(plan)
    flagged = _plan(WHISPER, flags={"split_size": 128})
    assert flagged.params["split_size"] == 128 and not _fired(flagged)


@pytest.mark.parametrize("profile", ["lavapipe", "apple-m4-max", "intel-meteor-lake"])
def test_other_vendors_keep_the_core_rule(profile):
    plan = _plan(WHISPER, profile)
    assert not _fired(plan)
    # (the geometry clips a split to the capacity: compare the counts)
    assert plan.params["n_splits"] == math.ceil(WHISPER.capacity / _core_size(plan, profile))


def test_a_tuned_split_size_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ATTNREG_CACHE_DIR", str(tmp_path))
    plain = _plan(WHISPER)
    caps = profiles()["nvidia-h100"]
    tuning.store(caps, "decode_partial", WHISPER, {
        "kernel": plain.kernel, "params": {"split_size": 128}, "us": 1.0,
        "rule_default_us": 2.0})
    tuned = _plan(WHISPER, flags={"use_tuning_cache": True})
    assert tuned.params["split_size"] == 128 and not _fired(tuned), tuned.explain()
